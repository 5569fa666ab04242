"""The training regime: what every optimizer step trains on, and how often the ranks synchronise.

``trainer train`` takes the flags below (docs/schedules.md has the rules and the reasoning):

* ``--multigrid long|short|both``: the batch shape and size of every iteration follow
  ``trainer.schedules.multigrid`` (Wu et al. 2020). The run takes the multigrid plan's epochs (1.5x
  ``--epochs``, far fewer iterations); ``--epochs`` stays the baseline's, which the plan is made from.
* ``--batch-growth points|decay|noise``: the batch doubles at set epochs, in place of the
  learning-rate decay, or when the gradient noise scale exceeds it (``trainer.schedules.batch_growth``).
* ``--average-every K`` (``--local-after-epochs E``): K-step model averaging, synchronous for the
  first E epochs (``trainer.schedules.model_averaging``).
* ``--bn-group N``: clips per BN statistics group (``trainer.model.subbatch_bn``); by default the base
  batch whenever the batch varies, so BN sees the same number of clips whatever the batch.

Every decision is a function of numbers every rank shares (the global iteration, the epoch's
position, allreduced gradient norms), so every rank takes the same shape and batch at every step
and the same number of steps per epoch. The learning rate is the base schedule's times
``lr_factor``: the long-cycle batch factor (multigrid) or B/B0 (batch growth), the linear scaling rule.
``batches`` turns the loader's batches into one batch per optimizer step.
"""
from __future__ import annotations

import logging

import torch

from shards.plan import partition

from ..config import CHANNELS, TrainConfig
from ..data.shapes import EpochShapes
from ..errors import ConfigError
from ..hooks import Hook
from . import batch_growth, multigrid
from .model_averaging import KStepBackend

log = logging.getLogger(__name__)

# where the long cycle restarts when no stage is given: the learning-rate steps of the reference
# multigrid config (epochs 94, 154, 196 of 239), as fractions of the baseline's epochs
REFERENCE_STAGES = (94 / 239, 154 / 239, 196 / 239)
# noise-scale measurements (since the start or the last change) before the batch may double
NOISE_MEASUREMENTS = 16


def refuse(message: str):
    """Flags that cannot go together, or a run they cannot continue: one line, no traceback."""
    raise ConfigError(message)


def stages_for(cfg: TrainConfig) -> tuple[int, ...]:
    """Where the long cycle restarts: ``--multigrid-stages``, else the reference's, scaled to ``--epochs``."""
    epochs = cfg.recipe.epochs
    if cfg.schedules.multigrid_stages:
        return tuple(cfg.schedules.multigrid_stages)
    return tuple(sorted({max(1, min(epochs - 1, round(f * epochs))) for f in REFERENCE_STAGES}))


class Growth:
    """The per-rank batch of batch growth, decided alike on every rank."""

    def __init__(self, mode: str, base: int, max_batch: int, world_size: int, points: tuple[float, ...]):
        if mode == "noise" and world_size < 2:
            refuse("--batch-growth noise measures the gradient noise from the ranks' own gradients: "
                   "it needs two or more ranks")
        if mode == "points" and not points:
            refuse("--batch-growth points needs --growth-points")
        self.mode, self.base, self.max_batch, self.world_size, self.points = (mode, base, max_batch,
                                                                              world_size, points)
        self.batch = base
        self.noise = batch_growth.NoiseScale()
        self.since_change = 0

    def decide(self, position: float, multiplier: float, warm: bool) -> int:
        """The batch for the next step, ``position`` epochs into the run, the base schedule's
        rate multiplier there ``multiplier``, warm-up over or not (``warm``)."""
        if self.mode == "points":
            self.batch = batch_growth.batch_at_points(position, self.base, self.points, self.max_batch)
        elif self.mode == "decay" and warm:
            self.batch = max(self.batch, batch_growth.batch_for_decay(multiplier, self.base, self.max_batch))
        elif self.mode == "noise" and warm and self.since_change >= NOISE_MEASUREMENTS:
            grown = batch_growth.batch_for_noise(self.batch * self.world_size, self.noise.value,
                                                 self.max_batch * self.world_size) // self.world_size
            if grown != self.batch:
                self.batch, self.since_change = grown, 0
        return self.batch

    def state_dict(self) -> dict:
        return {"batch": self.batch, "noise": self.noise.state_dict(), "since_change": self.since_change}

    def load_state_dict(self, state: dict) -> None:
        self.batch, self.since_change = state["batch"], state["since_change"]
        self.noise.load_state_dict(state["noise"])


class Regime(Hook):
    """The run's regime from its config, for ``world_size`` ranks and a training split of ``samples``
    clips. Refusals (``ConfigError``) name the flags that cannot go together. It reads every concern
    of the config: it is the one place that knows which features combine."""

    def __init__(self, cfg: TrainConfig, world_size: int, samples: int, elastic: bool = False):
        self.cfg, self.world_size, self.samples = cfg, world_size, samples
        s, d, epochs = cfg.schedules, cfg.data, cfg.recipe.epochs
        # --arch against --no-shift or --depth, refused as the command line's (UsageError); every schedule,
        # K-step averaging, --modality and --compile take any of the networks
        self.network = cfg.model.network
        if elastic and (s.multigrid != "off" or s.batch_growth != "off" or s.average_every is not None):
            refuse("trainer elastic changes the world size, which multigrid's iterations, batch growth's "
                   "decisions and K-step averaging's drifted ranks depend on: use trainer train for those")
        self.schedule = self.shapes = self.growth = self.kstep = self.engine = self.norms = self.loader = None
        if not 0 <= cfg.recipe.ema_decay < 1:
            refuse(f"--ema-decay must be in [0, 1) (0: off), not {cfg.recipe.ema_decay}")
        if cfg.recipe.ema_decay and s.average_every is not None:
            refuse("--ema-decay averages one model's weights, and K-step averaging's ranks hold different "
                   "ones between synchronisations: not with --average-every")
        if s.multigrid != "off":
            if s.batch_growth != "off":
                refuse("--multigrid and --batch-growth both set the batch size: use one")
            if d.decode_on_device:
                refuse("--multigrid decodes parts of several shapes per batch on the CPU: "
                       "not with --decode-on-device")
            try:
                phases = multigrid.plan(epochs, stages_for(cfg), cfg.model.segments, d.crop_size,
                                        long_cycle=s.multigrid in ("long", "both"),
                                        short_cycle=s.multigrid in ("short", "both"))
                self.schedule = multigrid.Schedule(phases, d.batch_size, world_size, samples)
            except ValueError as e:
                refuse(f"--multigrid {s.multigrid} with --epochs {epochs}, --multigrid-stages "
                       f"{list(stages_for(cfg))}, --batch-size {d.batch_size} on {world_size} ranks: {e}")
            self.shapes = EpochShapes(self.schedule, CHANNELS[d.modality])
        if s.batch_growth != "off":
            self.growth = Growth(s.batch_growth, d.batch_size, s.max_batch_size or 8 * d.batch_size,
                                 world_size, tuple(s.growth_points))
        varies = self.schedule is not None or self.growth is not None
        self.bn_group = s.bn_group if s.bn_group is not None else (d.batch_size if varies else 0)
        self.step = 0  # global iteration of the next batch ``batches`` yields

    @property
    def epochs(self) -> int:
        """The run's epochs: a multigrid plan's, else ``--epochs``."""
        return self.schedule.epochs if self.schedule else self.cfg.recipe.epochs

    def lr_factor(self, step: int) -> float:
        """The base schedule's rate is multiplied by this at ``step`` (linear scaling in the batch)."""
        if self.schedule:
            return float(self.schedule.at(step).lr_factor)
        if self.growth:
            return self.growth.batch / self.growth.base
        return 1.0

    # --- synchronisation -------------------------------------------------------------------------
    def backend(self, backend):
        """``backend`` as the run synchronises: itself, or wrapped for K-step averaging."""
        s = self.cfg.schedules
        if s.average_every is None:
            if s.local_after_epochs:
                refuse("--local-after-epochs switches to K-step averaging: give --average-every")
            return backend
        if self.growth and self.growth.mode == "noise":
            refuse("--batch-growth noise measures the noise of synchronously averaged gradients: "
                   "not with --average-every")
        self.kstep = KStepBackend(backend, s.average_every, self.steps_before(s.local_after_epochs))
        return self.kstep

    def steps_before(self, epoch: float) -> int:
        """Optimizer steps in the run's first ``epoch`` epochs (at the base batch under batch growth)."""
        if self.schedule:
            whole = min(int(epoch), self.schedule.epochs)
            frac = self.schedule.iterations[whole] * (epoch - whole) if whole < self.schedule.epochs else 0
            return self.schedule.first[whole] + round(frac)
        batch = self.cfg.data.batch_size
        return round(epoch * (partition.batches_per_rank(self.samples, self.world_size, batch)))

    @property
    def drifted(self) -> bool:
        """Whether the ranks hold different models now (K-step averaging between synchronisations)."""
        return self.kstep is not None and self.kstep.drifted

    def synchronisations(self, steps: int) -> int:
        """Model synchronisations (gradient or model allreduce rounds) so far: one per step unless
        K-step averaging."""
        return self.kstep.synchronisations if self.kstep else steps

    def allreduced_floats(self, steps: int) -> int:
        """Values each rank has put into model synchronisations so far: every gradient at every step,
        or what K-step averaging sent (gradients and BN statistics, plus parameters and optimizer
        state after drifting). Allreduce rounds alone undersell what averaging a drifted model costs."""
        if self.kstep:
            return self.kstep.averaging.floats
        return steps * sum(p.numel() for p in self.engine.model.parameters() if p.requires_grad)

    def attach(self, engine, loader) -> None:
        """The engine the regime steers and ``loader()``, the training loader now; batch growth by
        noise watches the ranks' own gradients."""
        self.engine, self.loader = engine, loader
        if self.growth and self.growth.mode == "noise":
            self.norms = batch_growth.LocalGradNorm(engine.model.parameters())

    # --- the steps of an epoch -------------------------------------------------------------------
    def batches(self, loader, wrap, step: int):
        """One batch per optimizer step for the rest of the loader's epoch, the next global
        iteration being ``step``; ``wrap`` iterates the loader (``train.isolated``). Each batch says
        whether it ends the loader batch (``period_end``): only there may a run stop, since the
        loader's position counts whole loader batches. A grown batch re-splits the rest of the
        epoch (``ClipLoader.resize``)."""
        self.step = step
        while True:
            it = wrap(loader)
            resized = False
            for batch in it:
                parts = batch.pop("parts", None) or [batch]
                for i, part in enumerate(parts):
                    if self.schedule:
                        self._check(part)
                    yield {**batch, **part, "period_end": i == len(parts) - 1}
                    self.step += 1
                if self.growth and self.growth.batch != loader.batch_size:
                    it.close()
                    loader.resize(self.growth.batch)
                    # (a finished epoch: the next starts at the new batch)
                    resized = not loader.epoch_finished
                    break
            if not resized:
                return

    def _check(self, part: dict) -> None:
        """The loader's shape must be the schedule's at the global iteration (both are functions of it)."""
        want = self.schedule.at(self.step)
        got = (part["clips"].shape[0], part["clips"].shape[1], part["clips"].shape[-1])
        if got != (want.batch, want.shape.frames, want.shape.crop):
            raise RuntimeError(f"iteration {self.step}: the loader gave {got} (clips, frames, crop), the "
                               f"multigrid schedule says {(want.batch, want.shape.frames, want.shape.crop)}")

    # --- the loop's hook (trainer.hooks): after each step, and the state under "regime" ---------------
    key = "regime"

    def after_step(self, t, step: dict) -> None:
        """Batch growth's decision for the next step, from what every rank knows alike."""
        if not self.growth:
            return
        e, g = self.engine, self.growth
        if self.norms is not None:
            # the ranks' own squared gradient norms, averaged, and the averaged gradient's
            local = (e.backend.all_sum(torch.tensor([self.norms.pop()], dtype=torch.float64)).item()
                     / self.world_size)
            g.noise.update(local, g.batch, batch_growth.grad_sq_norm(e.model.parameters()),
                           g.batch * self.world_size)
            g.since_change += 1
        seen, sched = e.clips_seen, e.schedule
        before = g.batch
        g.decide(seen / self.samples, sched.lr(seen) / sched.peak, seen >= sched.warmup_clips)
        if g.batch != before and e.backend.rank == 0:
            log.info("batch growth (%s): %d -> %d clips per rank at epoch %.2f (noise scale %.0f)", g.mode,
                     before, g.batch, seen / self.samples, g.noise.value)

    # --- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"world_size": self.world_size, "growth": self.growth.state_dict() if self.growth else None,
                "averaging": self.kstep.state_dict() if self.kstep else None}

    def load_state_dict(self, state: dict | None) -> None:
        """Continue from a checkpoint's regime (None: one written without), before the training
        loader's state is loaded."""
        state = state or {}
        if self.schedule and state.get("world_size", self.world_size) != self.world_size:
            refuse(f"a multigrid run's iterations depend on its world size: resume it on "
                   f"{state['world_size']} ranks, not {self.world_size}")
        if self.growth and state.get("growth"):
            self.growth.load_state_dict(state["growth"])
            self.loader().batch_size = self.growth.batch  # the loader's last segment goes on at this batch
        if self.kstep and state.get("averaging"):
            self.kstep.load_state_dict(state["averaging"])

    def describe(self) -> str:
        lines = []
        if self.schedule:
            s = self.schedule
            lines.append(f"multigrid ({self.cfg.schedules.multigrid}): {s.epochs} epochs, {s.total} "
                         f"iterations, stages at {list(stages_for(self.cfg))} of {self.cfg.recipe.epochs} "
                         "baseline epochs")
            for p in s.phases:
                cycle = ", ".join(f"{c.frames}x{c.crop}x{c.crop} x {self.cfg.data.batch_size * c.factor}"
                                  for c in p.cycle)
                lines.append(f"  epochs {p.start}-{p.end}: stage {p.stage}, lr x{p.shape.factor}: {cycle}")
        if self.growth:
            g = self.growth
            lines.append(f"batch growth ({g.mode}): {g.base} -> at most {g.max_batch} clips per rank"
                         + (f" at epochs {list(g.points)}" if g.mode == "points" else ""))
        if self.kstep:
            lines.append(f"K-step averaging every {self.kstep.every} steps"
                         + (f", synchronous for the first {self.kstep.local_after} steps"
                            if self.kstep.local_after else ""))
        if self.bn_group:
            lines.append(f"sub-batch BN: groups of {self.bn_group} clips")
        return "\n".join(lines)
