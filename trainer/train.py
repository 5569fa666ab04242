"""Train TSM, TSN (--no-shift) or an I3D (--arch) on a shard set, on one process or many (Horovod by default).

The defaults are the recipe of "Training Kinetics in 15 Minutes" (Lin, Gan and Han, 2019) for a
TSM ResNet-50 on 8-frame clips: SGD momentum 0.9, 0.00125 learning rate per 8 clips of
global batch, 5 warm-up epochs, cosine decay to zero, weight decay 1e-4 on weights only,
no dropout; the learning rate follows the clips seen, not the steps (``recipe.Schedule``).
Every epoch ends with single-clip centre-crop validation and a checkpoint.

Stopping (docs/faults.md): SIGTERM or SIGINT to any process of the job (one rank, every rank,
the loader workers: they ignore it and leave it to their rank) stops every rank after the same
step, or abandons validation; rank 0 writes the checkpoint, every rank waits for it and exits
with 128 + the signal (143 for SIGTERM, 130 for SIGINT). A second SIGINT interrupts at once.
A data fault on any rank (``shards.base.errors.DataFault`` from its loader: a source unreachable past
``--source-deadline``, a corrupt sample) stops the job the same way, with the fault's one line
and status on every rank (75, "try again later", for a source that stayed down). ``--resume``
continues from that checkpoint as if nothing had happened: at the batch it stopped at, or, stopped
after an epoch's last step, it validates that epoch and goes on with the next.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import shutil
import signal
import time
import warnings
from dataclasses import asdict

import torch
import torch.nn.functional as F

from shards.base.errors import CommandError, DataFault, UsageError
from shards.base.progress import Progress as Bar
from shards.format.manifest import Manifest
from shards.io.http_range import Retry
from shards.read.direct import load_manifest

from . import bad_samples, checkpoint, config, metrics
from .clip_log import ClipLog
from .data import (  # the public reading API (docs/library.md), as any training loop reads
    ClipLoader,
    EpochOptions,
    Upsampling,
)
from .data.arguments import loader_kwargs, worded_as_flags
from .data.device_decode import clip_source
from .data.placement import shared_manifest
from .data.rotation import clips_an_epoch
from .distributed import backends as distributed
from .distributed import cores
from .ema import WeightEMA
from .engine import Engine
from .errors import ConfigError
from .hooks import Hook, PeriodicCheckpoint, StepTrace
from .precise_bn import PreciseBN
from .prometheus import PushGateway, run_name
from .schedules import regime

log = logging.getLogger("trainer.train")


FAULT = -1  # what the loop returns (as it returns a signal's number) when a data fault stopped the run


class StopFlag:
    """Records SIGTERM or SIGINT, and a data fault of this rank's loader, for the training loop to
    act on at the next step boundary (``Trainer.agreed_stop``).

    Repeated SIGTERMs are one request (Slurm signals every process of a job, horovodrun then
    signals its ranks again); a SIGINT after any stop signal interrupts at once (Ctrl-C twice).
    """

    def __init__(self):
        self.signum = 0
        self.fault: DataFault | None = None  # this rank's loader failed; the ranks stop at the boundary
        self.agreed: DataFault | None = None  # the fault every rank stops on (FAULT), once they agreed
        self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame):
        if self.signum and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = self.signum or signum

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def describe_fault(fault: DataFault | None, rank: int, size: int) -> dict | None:
    """What the other ranks need of this rank's data fault to stop on it alike: plain data (the
    class travels by name), its message naming the rank in a job of several."""
    if fault is None:
        return None
    cls = type(fault)
    return {"rank": rank, "type": f"{cls.__module__}.{cls.__qualname__}", "status": fault.status,
            "resume": fault.resume, "message": f"rank {rank}: {fault}" if size > 1 else str(fault)}


def agreed_fault(said: list[dict | None]) -> DataFault:
    """The fault every rank stops on, from every rank's ``describe_fault``: the first rank's whose
    cause a plain ``--resume`` cannot cure (a corrupt sample), else the first rank's (a source that
    stayed down); of its class (where this rank knows it), status and message."""
    chosen = min((f for f in said if f), key=lambda f: (f["resume"], f["rank"]))
    known = {f"{c.__module__}.{c.__qualname__}": c for c in _subclasses(DataFault)}
    cls = known.get(chosen["type"], DataFault)
    fault = cls.__new__(cls, chosen["message"])  # (no __init__: a subclass's own arguments are not at hand)
    fault.message, fault.args = chosen["message"], (chosen["message"],)
    fault.status, fault.resume = chosen["status"], chosen["resume"]
    return fault


def _subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


# what every rank takes from a checkpoint besides weights, optimizer and the hooks' states
RESUMED = ("epoch", "batch", "step", "clips_seen", "scaler", "loader", "epoch_totals", "rng", "epoch_cpu")
# what a run writes into --output-dir (deleted by --overwrite; anything else there is left alone)
RUN_FILES = (checkpoint.NAME, "metrics.jsonl", "tensorboard", "clips", "steps-rank*.jsonl", bad_samples.FILE)


class Trainer:
    """A run: backend, loaders, engine (model, optimizer, schedule), position, metrics log."""

    def __init__(self, cfg: config.TrainConfig, elastic: bool = False):
        """``elastic``: no collective here, since a rank joining a running Horovod Elastic job meets the
        others first in the elastic state's sync: every rank reads the manifest, and ``start`` is
        left to ``trainer.elastic``."""
        self.cfg = cfg
        d, s = cfg.data, cfg.system
        # a rank may wait in a collective for another waiting out its data source, up to the deadline
        self.backend = distributed.init(s.backend, pause=Retry(deadline=d.source_deadline).patience)
        self.rank0 = self.backend.rank == 0
        self.threads = cores.cap_threads(self.backend.local_ranks)
        if not elastic:  # (an elastic ring agrees in its sync)
            self.backend.agree_on_nodes()
        if not elastic:  # ranks of an elastic job join its directory at any time, the run in it theirs
            prepare_output(s, self.rank0)
        torch.manual_seed(s.seed + self.backend.rank)
        retry = Retry(deadline=d.source_deadline)
        manifest = load_manifest(d.data, d.direct_reads, retry) if elastic else shared_manifest(
            d.data, self.backend.rank, lambda obj, root: self.backend.broadcast_object(obj), d.direct_reads,
            retry)
        check_splits(manifest, d)
        self.cfg = cfg = fit_to_data(manifest, cfg, self.backend.local_ranks, self.rank0)
        d = cfg.data
        samples = clips_an_epoch(manifest.splits[d.train_split].shards, d.stored_clips)
        self.regime = regime.Regime(cfg, self.backend.size, samples, elastic)
        self.make_loaders(manifest)
        self.engine = Engine(self.regime.backend(self.backend), len(manifest.classes), samples,
                             model=cfg.model,
                             recipe=cfg.recipe, system=s, batch_size=d.batch_size, epochs=self.regime.epochs,
                             bn_group=self.regime.bn_group, modality=d.modality)
        self.regime.attach(self.engine, lambda: self.train_loader)
        self.clips = clip_source(d.decode_on_device, self.engine.device)
        # the features around the loop, in the order they run (trainer.hooks); the regime decided
        # above which of them combine
        self.hooks: list[Hook] = [self.regime]
        if cfg.schedules.trace_steps:
            self.hooks.append(StepTrace(s.output_dir, self.backend.rank))
        if s.clip_log and not elastic:  # trainer.elastic's log adds the ring's generation
            self.hooks.append(ClipLog(s.output_dir))
        if cfg.recipe.ema_decay:
            self.hooks.append(WeightEMA(self.engine.model, cfg.recipe.ema_decay))
        if cfg.schedules.precise_bn:
            self.hooks.append(PreciseBN(cfg.schedules.precise_bn))
        if any(self.bad_sample_limit(manifest, split) for split in (d.train_split, d.val_split) if split):
            # before the periodic checkpoint: what a checkpoint counts was agreed at its boundary
            clips = {split: manifest.splits[split].num_samples for split in (d.train_split, d.val_split)
                     if split}
            self.hooks.append(bad_samples.BadSamples(s.output_dir, d.max_bad_samples, clips, self.rank0))
        if s.checkpoint_steps:
            self.hooks.append(PeriodicCheckpoint(s.checkpoint_steps))
        if s.push_gateway:
            self.hooks.append(PushGateway(s.push_gateway, run_name(s.output_dir), self.backend.rank,
                                          s.print_freq))
        # epochs finished (the checkpoint's position); what people read (log lines, the bar, metrics,
        # --clip-log, --trace-steps) numbers the epoch in progress from 1: epoch + 1
        self.epoch, self.batch, self.step = 0, 0, 0
        self.saved_step = 0  # the step of the last checkpoint this process wrote or started from
        self.epoch_totals = metrics.StepTotals()  # of the current epoch's training, over a resume too
        # CPU seconds this process (and its loader workers) spent on the epoch's training,
        self.epoch_cpu = 0.0
        # over a resume too (rank 0 carries the sum over every rank, as for epoch_totals)
        self.log = metrics.MetricsLog(None)  # nothing logged before start
        if not elastic:
            self.start()

    def make_loaders(self, manifest: Manifest) -> None:
        """The training and validation loaders of this rank in this world size."""
        d = self.cfg.data
        self.train_loader = self.new_loader(manifest, d.train_split, train=True)
        self.val_loader = self.new_loader(manifest, d.val_split, train=False) if d.val_split else None

    def bad_sample_limit(self, manifest: Manifest, split: str) -> int:
        """The bad samples of ``split`` an epoch may go on without (``--max-bad-samples``)."""
        return bad_samples.limit(self.cfg.data.max_bad_samples, manifest.splits[split].num_samples)

    def new_loader(self, manifest: Manifest, split: str, train: bool, full_shape: bool = False) -> ClipLoader:
        """A loader of this rank's share of ``split`` in this world size, with the run's flags; its
        batches have the regime's shapes unless ``full_shape``. Under ``--max-bad-samples`` it leaves
        bad samples out, and the ``BadSamples`` hook keeps the budget over every rank."""
        a = self.cfg.data
        with worded_as_flags(a):
            planning, reading = loader_kwargs(a)
            epochs = EpochOptions(**planning, rank=self.backend.rank, world_size=self.backend.size,
                                  local_size=self.backend.local_size, train=train, seed=self.cfg.system.seed,
                                  shuffle=shuffle_mode(self.cfg),
                                  shapes=None if full_shape else self.regime.shapes)
            return ClipLoader(manifest, split, epochs, **reading,
                              max_bad_samples=None if self.bad_sample_limit(manifest, split) else 0)

    def start(self) -> None:
        """Every rank at rank 0's place (the checkpoint's with --resume, else rank 0's initial
        weights), and rank 0's metrics log opened there."""
        self._resume()
        self.backend.broadcast_state(self.engine.model, self.engine.optimizer)
        # records past the checkpoint's step came from a run killed after it: those steps are trained again
        self.open_log(after_step=self.step if self.cfg.system.resume else None)

    def open_log(self, after_step: int | None = None) -> None:
        """The metrics log, written by rank 0 (``after_step``: ``metrics.MetricsLog``'s)."""
        s = self.cfg.system
        self.log.close()
        self.log = metrics.MetricsLog(s.output_dir, enabled=self.rank0, tensorboard=s.tensorboard,
                                      after_step=after_step)

    @property
    def checkpoint_url(self) -> str:
        return os.path.join(self.cfg.system.output_dir, checkpoint.NAME)

    def _resume(self) -> None:
        """Rank 0 reads and checks the checkpoint; the weights and optimizer reach the others in
        ``start``'s broadcast, the rest of it (or the refusal) here."""
        e = self.engine
        state = small = None
        if self.cfg.system.resume and self.rank0:
            try:
                state = checkpoint.load(self.checkpoint_url)
            # refused on every rank below, never a hang in the broadcast
            except checkpoint.Unreadable as error:
                small = {"unreadable": str(error)}
        saved = state is not None and "loader" in state
        other = self.train_loader.saved_on(state["loader"]) if saved else None
        if other:
            small = {"other_set": f"--resume refused: {self.checkpoint_url} was trained on {other}, but "
                                  f"--data is {self.train_loader.title()}: resume with --data naming the "
                                  "run's set, or start afresh (--overwrite, or another --output-dir)"}
        elif state is not None:
            try:
                refused = checkpoint.differences(state, asdict(e.config), self.cfg)
                if not refused:
                    e.model.load_state_dict(state["model"])
                    e.load_optimizer(state["optimizer"])
            # refused on every rank, never a hang in the broadcast
            except (KeyError, ValueError, RuntimeError) as error:
                refused = [f"its state does not load here ({type(error).__name__}: {error})"]
            small = {"refused": refused, **({} if refused else {k: state.get(k) for k in RESUMED}),
                     "hooks": checkpoint.hook_states(state)}
            changed = [] if refused else checkpoint.changes(state, self.cfg)
            if changed:
                log.info("resumed with other flags than the checkpoint's, applied from here on: %s",
                         ", ".join(changed))
        small = self.backend.broadcast_object(small)
        if small is None:
            return
        if "unreadable" in small:  # each save replaces the one file whole: a damaged one has no older copy
            raise CommandError(f"--resume refused: {small['unreadable']}; the run keeps no other checkpoint: "
                               "restore it from a copy, or start afresh with --overwrite")
        if "other_set" in small:  # every rank alike: the command line names another set than the run's
            raise UsageError(small["other_set"])
        if small["refused"]:
            raise ConfigError(f"--resume refused: {self.checkpoint_url} is another run's: "
                              f"{'; '.join(small['refused'])}")
        self.load_hook_states(small["hooks"])
        self.load_position(small)
        self.saved_step = self.step
        if len(small["rng"]) == self.backend.size:
            checkpoint.set_rng_state(small["rng"][self.backend.rank])
        else:
            log.warning("resuming on %d ranks from %d: fresh random streams", self.backend.size,
                        len(small["rng"]))
        if self.rank0:
            log.info("resumed from %s %s (step %d, %d clips seen)", self.checkpoint_url,
                     checkpoint.position(self.epoch, self.batch, self.regime.epochs), self.step, e.clips_seen)

    def position(self) -> dict:
        """Where the run stands, besides weights, optimizer and the epoch's sums."""
        e = self.engine
        return {"epoch": self.epoch, "batch": self.batch, "step": self.step, "clips_seen": e.clips_seen,
                "scaler": e.scaler.state_dict(), "loader": self.train_loader.state_dict()}

    def hook_states(self) -> dict:
        """The state of every hook that has one, by its key: what checkpoints and elastic commits keep."""
        return {h.key: h.state_dict() for h in self.hooks if h.key}

    def load_hook_states(self, states: dict) -> None:
        """Every hook's state back (None for a hook the states were saved without), before the position."""
        for h in self.hooks:
            if h.key:
                h.load_state_dict(states.get(h.key))

    def load_position(self, state: dict) -> None:
        """Stand where ``state`` (a checkpoint's or an elastic commit's) says, its ``epoch_totals`` too."""
        e = self.engine
        self.epoch, self.batch, self.step = state["epoch"], state["batch"], state["step"]
        e.seek(state["clips_seen"])
        e.scaler.load_state_dict(state["scaler"])
        self.train_loader.load_state_dict(state["loader"])
        self.carry_totals(state["epoch_totals"], state.get("epoch_cpu"))

    def carry_totals(self, values: dict, cpu: float | None = None) -> None:
        """Rank 0 goes on from the epoch's sums over every rank (``values``, and ``cpu`` seconds when
        given: a checkpoint's), the others from zero: their sum stays the epoch's."""
        self.epoch_totals = metrics.StepTotals(values if self.rank0 else None)
        if cpu is not None:
            self.epoch_cpu = cpu if self.rank0 else 0.0

    def save(self) -> None:
        """Rank 0 writes the checkpoint; every rank returns once it is in place (a rank that
        exits earlier would make horovodrun end the others)."""
        rng = self.backend.all_gather_object(checkpoint.rng_state())
        totals = self.epoch_totals.reduce(self.backend.all_sum)
        cpu = self.backend.all_sum(torch.tensor([self.epoch_cpu], dtype=torch.float64)).item()
        if self.rank0:
            checkpoint.save(self.checkpoint_url, {
                "model": self.engine.model.state_dict(), "optimizer": self.engine.optimizer.state_dict(),
                **self.position(), "hooks": self.hook_states(), "rng": rng,
                "epoch_totals": totals.values, "epoch_cpu": cpu, "model_config": asdict(self.engine.config),
                "classes": list(self.train_loader.classes), "config": self.cfg.to_dict()})
        self.saved_step = self.step
        self.backend.all_sum(torch.zeros(1))

    def agreed_stop(self, stop: StopFlag) -> int:
        """Why every rank stops here, as soon as any rank has a reason: ``FAULT`` when a rank's loader
        failed (the fault all raise is in ``stop.agreed``), else the stop signal (0: none), so all
        stop at the same step and exit alike; SIGTERM wins where ranks got different signals."""
        flags = torch.tensor([stop.signum == signal.SIGTERM, stop.signum == signal.SIGINT,
                              stop.fault is not None], dtype=torch.float32)
        term, interrupt, faults = (self.backend.all_sum(flags) if self.backend.size > 1 else flags).tolist()
        if faults:
            said = describe_fault(stop.fault, self.backend.rank, self.backend.size)
            stop.agreed = agreed_fault(self.backend.all_gather_object(said) if self.backend.size > 1
                                       else [said])
            return FAULT
        return signal.SIGTERM if term else signal.SIGINT if interrupt else 0

    def close(self) -> None:
        self.log.close()
        for h in self.hooks:
            h.close()
        self.backend.shutdown()


def prepare_output(system: config.System, rank0: bool) -> None:
    """An --output-dir holding an earlier run is continued (--resume), started afresh (--overwrite:
    rank 0 deletes the run's files), or refused: a second run would replace its checkpoint and
    append to its metrics."""
    found = sorted({os.path.basename(p) for pattern in RUN_FILES
                    for p in glob.glob(os.path.join(glob.escape(system.output_dir), pattern))})
    if not found or system.resume:
        return
    if not system.overwrite:
        raise UsageError(f"--output-dir {system.output_dir} holds an earlier run ({', '.join(found)}): "
                         "--resume continues it, --overwrite starts afresh (deleting it), or give another "
                         "directory")
    if rank0:
        for name in found:
            path = os.path.join(system.output_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        log.info("--overwrite: deleted %s from %s", ", ".join(found), system.output_dir)


def shuffle_mode(cfg: config.TrainConfig) -> str:
    """``--shuffle``, with auto decided: global epochs, the node cache still used, for synchronous
    training, batch growth and K-step averaging alike. Node-affine epochs would be the default only
    if shown equivalent to global (a mean cost within 2 top-1 points, by the rule written before
    the runs, docs/benchmarks/node-affine-equivalence.md); the 14 pairs there could not show it (327
    are needed for 80% power), so ``--shuffle node`` is a choice, made for its traffic."""
    return "global" if cfg.data.shuffle == "auto" else cfg.data.shuffle


def fit_to_data(manifest: Manifest, cfg: config.TrainConfig, local_ranks: int,
                rank0: bool) -> config.TrainConfig:
    """The flags the shard set decides: frames per clip (--segments) from the manifest when not
    given, and refused when the clips have another count; loader workers from the cores when not
    given; a warning when crops are larger than the stored frames (they would be upscaled)."""
    d, m = cfg.data, cfg.model
    clip = manifest.config.get("clip", {})  # as ingest writes it; sets made by other tools may lack it
    stored = clip.get("frames")
    if m.segments is None and stored is None:
        raise UsageError(f"{d.data}: its manifest does not say how many frames a clip has; give --segments")
    if m.segments is not None and stored is not None and m.segments != stored:
        raise UsageError(f"--segments {m.segments}: the clips of {d.data} have {stored} frames (leave "
                         f"--segments out to take them; multigrid's shorter clips are taken from them)")
    short = clip.get("short_side")
    # the loader's, for library users: this names the flags
    warnings.filterwarnings("ignore", category=Upsampling)
    if rank0 and short and max(d.crop_size, d.scale_size) > short:
        log.warning("--crop-size %d / --scale-size %d: the frames of %s are %d pixels on their short side, "
                    "so they are upscaled (--scale-size %d --crop-size %d would crop them as stored)",
                    d.crop_size, d.scale_size, d.data, short, short, short * d.crop_size // d.scale_size)
    workers = d.workers if d.workers is not None else cores.default_workers(local_ranks)
    return cfg.replace(model=dataclasses.replace(m, segments=m.segments or stored),
                       data=dataclasses.replace(d, workers=workers))


def check_splits(manifest: Manifest, data: config.Data) -> None:
    """The splits the flags name are in the shard set, or the run is refused in one line saying which."""
    for flag, split in (("--train-split", data.train_split), ("--val-split", data.val_split)):
        if split and split not in manifest.splits:
            raise ConfigError(f"{data.data}: no split {split!r} ({flag}); the set has "
                              f"{', '.join(manifest.splits)}"
                             + ("; --val-split '' trains without validation" if flag == "--val-split"
                                else ""))


def isolated(batches):
    """Iterate without letting the iteration draw from the global torch RNG.

    PyTorch's DataLoader takes its workers' base seed from the global generator whenever an
    iterator starts, and a resumed run starts one at a different point of that stream: left
    alone, the dropout masks after a resume would differ from those of an unbroken run.
    """
    it = iter(batches)
    while True:
        with torch.random.fork_rng(devices=[]):
            batch = next(it, None)
        if batch is None:
            return
        yield batch


def train_step(t: Trainer, batch: dict, tick: float) -> dict:
    """One optimizer step on ``batch``, the previous one having ended at ``tick``; returns its
    loss and real clips on this rank, and its data, compute and wall time."""
    e = t.engine
    for h in t.hooks:
        h.before_step(t, batch)
    clips = t.clips(batch)  # with --decode-on-device the GPU decode counts as data time
    e.seek(e.clips_seen, t.regime.lr_factor(t.step))
    lr, seen = e.lr, e.clips_seen
    started = time.perf_counter()
    # waits for the GPU
    loss = e.train_step(clips, batch["labels"], batch["valid"], batch["global_valid"]).item()
    done = time.perf_counter()
    for h in t.hooks:
        h.after_step(t, {"clips": clips, "lr": lr, "seen": seen, "loss": loss, "data_time": started - tick,
                         "compute_time": done - started})
    t.batch += batch["period_end"]
    t.step += 1
    if t.train_loader.epoch_finished and batch["period_end"]:
        # ranks saw different batches (K-step averaging: trained different models): agree before anything is
        # saved
        e.backend.average_buffers(e.model)
    return {"loss": loss, "clips": int(batch["valid"].sum()), "data_time": started - tick,
            "compute_time": done - started, "wall_time": (done - tick) if t.rank0 else 0.0}


class Progress:
    """An epoch's progress (rank 0's: a bar on a terminal, else a line every ``$KF_PROGRESS_SECONDS``
    and one at the epoch's end, ``shards.base.progress``) and its ``train`` records, the steps' totals
    over every rank every ``--print-freq`` steps."""

    def __init__(self, t: Trainer):
        self.t, self.window = t, metrics.StepTotals()
        self.bar = Bar(t.batch + len(t.train_loader), initial=t.batch, desc=f"epoch "
                       f"{t.epoch + 1}/{t.regime.epochs}",
                       unit="step", enabled=t.rank0, leave=False)

    def update(self, step: dict, batch: dict) -> None:
        t, e = self.t, self.t.engine
        self.window.add(**step)
        seconds = step["data_time"] + step["compute_time"]
        self.bar.update(batch["period_end"], **{
            "loss": f"{step['loss'] / max(step['clips'], 1):.3f}", "lr": f"{e.lr:.2e}",
            "clips/s": f"{batch['global_valid'] / seconds:.1f}", "data ms": f"{1e3 * step['data_time']:.0f}",
            "compute ms": f"{1e3 * step['compute_time']:.0f}"})
        if t.step % t.cfg.system.print_freq == 0:
            w = self.window.reduce(t.backend.all_sum).summary()
            t.log.log("train", t.step, epoch=t.epoch + 1, clips=e.clips_seen, loss=w["loss"], lr=e.lr,
                      clips_per_s=w["clips_per_s"], data_time=w["data_time"], compute_time=w["compute_time"])
            self.window = metrics.StepTotals()

    def close(self) -> None:
        self.bar.close()


def at_hooks(t: Trainer, stop: StopFlag, call) -> None:
    """``call(hook)`` for every hook; a data fault one raises (``--max-bad-samples``' budget exceeded,
    on every rank alike) becomes this rank's stop request, as a loader's does (``fetch``)."""
    try:
        for h in t.hooks:
            call(h)
    except DataFault as fault:
        stop.fault = fault


def at_boundary(t: Trainer, stop: StopFlag) -> int:
    """Where a run may stop (the end of a loader batch, one model on every rank): the hooks'
    (a periodic checkpoint, Horovod Elastic's commit), then the stop every rank agrees on (0: none)."""
    at_hooks(t, stop, lambda h: h.at_boundary(t))
    return t.agreed_stop(stop)


def fetch(batches, stop: StopFlag) -> dict | None:
    """The next batch (None at the epoch's end). A data fault of the loader (raised here, also from
    its workers) becomes this rank's stop request, for the ranks to agree on at the boundary, instead
    of leaving the others waiting for it in a collective: the one place a ``DataFault`` of the
    training data enters the loop."""
    try:
        return next(batches, None)
    except DataFault as fault:
        stop.fault = fault
        return None


def next_or_stop(t: Trainer, batches, stop: StopFlag) -> tuple[int, dict | None]:
    """At a boundary: the next batch, fetched before the ranks agree whether to stop, so that a rank
    whose read failed says so in that agreement (every rank's next collective). Stopping, the batch
    fetched ahead is given back: the loader stands where it stood, and a resume starts at that batch."""
    place = t.train_loader.state_dict()
    batch = fetch(batches, stop)
    signum = t.agreed_stop(stop)
    if signum:
        batches.close()  # ends the loader's iteration (its workers) before its position is set back
        t.train_loader.load_state_dict(place)
    return signum, batch


def train_one_epoch(t: Trainer, stop: StopFlag) -> int:
    """Train to the end of the epoch or until a stop reaches every rank (a signal or a data fault:
    agreed before each step, so a rank whose batch could not be read never leaves the others in the
    step's collectives); returns it (0: the epoch's training is done)."""
    loader = t.train_loader
    loader.set_epoch(t.epoch)
    if loader.epoch_finished:  # resumed after the epoch's last step: validation is what is left
        return 0
    t.engine.model.train()
    progress = Progress(t)
    tick, cpu = time.perf_counter(), metrics.cpu_seconds()
    # one batch per optimizer step: a multigrid loader batch holds several (t.batch counts loader batches)
    batches = t.regime.batches(loader, isolated, t.step)
    try:
        signum, batch = next_or_stop(t, batches, stop)
        while batch is not None and not signum:
            step = train_step(t, batch, tick)
            t.epoch_totals.add(**step)
            progress.update(step, batch)
            tick = time.perf_counter()
            # the loader's position counts whole loader batches; a checkpoint holds one model
            if batch["period_end"] and not t.regime.drifted:
                at_hooks(t, stop, lambda h: h.at_boundary(t))
                signum, batch = next_or_stop(t, batches, stop)
            # within a loader batch (nothing is read), or K-step averaging's drifted ranks (no boundary)
            else:
                batch = fetch(batches, stop)
                # a fault between averages: no checkpoint can hold the ranks' models
                if stop.fault is not None:
                    raise stop.fault
    finally:  # cleared from the terminal, also when the run ends in a refusal's one line
        progress.close()
    t.epoch_cpu += metrics.cpu_seconds() - cpu  # (the loader's workers have ended with the epoch's iteration)
    return signum


@torch.no_grad()
def evaluate(t: Trainer, stop: StopFlag) -> dict | int:
    """Single-clip centre-crop loss, top-1 and top-5 on the validation split, of the model and of
    the weights hooks add (``Hook.validation_models``: ``<prefix>_val_top1``, ...), in one pass over
    the clips; padding never counts. Abandoned when a stop reaches every rank (a signal, a data
    fault of any rank's validation read): then it is returned (``agreed_stop``'s)."""
    e = t.engine
    models = {"": e.model}
    for h in t.hooks:
        models.update({f"{prefix}_": model for prefix, model in h.validation_models(t).items()})
    sums = {}
    for prefix, model in models.items():
        model.eval()
        sums[prefix] = torch.zeros(4, dtype=torch.float64)  # samples, loss, top-1, top-5
    batches = isolated(t.val_loader)
    while (batch := fetch(batches, stop)) is not None or stop.fault is not None:
        # every rank, also one whose read failed (batch None): the hooks may agree across ranks
        at_hooks(t, stop, lambda h: h.validation_batch(t, batch))
        if batch is not None:  # (a rank whose read failed says so in the agreement below)
            clips = t.clips(batch)
            labels = batch["labels"]
            valid = batch["valid"] & (labels >= 0)
            for prefix, model in models.items():
                logits = e.scores(clips, model).cpu()
                loss = F.cross_entropy(logits, labels.clamp(min=0), reduction="none")
                top1, top5 = metrics.topk_correct(logits, labels, (1, 5), valid)
                sums[prefix] += torch.stack([valid.sum(), (loss * valid).sum(), top1, top5]).double()
        signum = t.agreed_stop(stop)
        if signum:
            return signum
    out = {}
    for prefix, total in sums.items():
        n, loss, top1, top5 = t.backend.all_sum(total).tolist()
        n = max(n, 1)
        out |= {f"{prefix}val_loss": loss / n, f"{prefix}val_top1": 100 * top1 / n,
                f"{prefix}val_top5": 100 * top5 / n, f"{prefix}val_samples": n}
    for h in t.hooks:
        out |= h.at_validation_end(t)
    return out


def epoch_summary(t: Trainer) -> dict:
    """The epoch's training over every rank: loss, times, throughput, synchronisations, CPU seconds."""
    totals = t.epoch_totals.reduce(t.backend.all_sum).summary()
    return {"train_loss": totals["loss"], "epoch_time": totals["time"], "data_time": totals["data_time"],
            "compute_time": totals["compute_time"], "clips_per_s": totals["clips_per_s"],
            "synchronisations": t.regime.synchronisations(t.step),
            "allreduced_floats": t.regime.allreduced_floats(t.step),
            "cpu_time": t.backend.all_sum(torch.tensor([t.epoch_cpu], dtype=torch.float64)).item()}


def train(t: Trainer, stop: StopFlag) -> int:
    """Epochs until the last, or until a stop reaches every rank: then the checkpoint is saved and
    the stop returned (a signal's number or ``FAULT``; 0: finished)."""
    while t.epoch < t.regime.epochs:
        signum = train_one_epoch(t, stop)
        if not signum:
            summary = epoch_summary(t)
            for h in t.hooks:
                summary |= h.at_epoch_end(t)
            val = evaluate(t, stop) if t.val_loader is not None else {}
            signum = val if isinstance(val, int) else 0
        if signum:
            t.save()
            return signum
        t.epoch, t.batch, t.epoch_totals, t.epoch_cpu = t.epoch + 1, 0, metrics.StepTotals(), 0.0
        t.save()
        summary.update(val)
        t.log.log("epoch", t.step, epoch=t.epoch, clips=t.engine.clips_seen, lr=t.engine.lr, **summary)
        if t.rank0:
            log.info("epoch %d/%d: %s", t.epoch, t.regime.epochs,
                     ", ".join(f"{k} {metrics.figure(k, v)}" for k, v in summary.items()))
        signum = at_boundary(t, stop)
        if signum:
            return signum
    return 0


def main(cfg: config.TrainConfig, elastic=None) -> int:
    """Train the run ``cfg`` describes; ``elastic(trainer, stop)``: Horovod Elastic's loop around
    ``train`` (``trainer.elastic``). Refusals raise ``ConfigError``."""
    stop = StopFlag()  # first: a signal during start-up stops the run after its first step
    t = None
    try:
        t = Trainer(cfg, elastic=elastic is not None)
        if t.rank0:
            log.info("%s", t.engine.describe())
            if t.regime.describe():
                log.info("%s", t.regime.describe())
            log.info("config: %s", json.dumps(t.cfg.to_dict(), sort_keys=True))
            log.info("data %s", t.train_loader.describe())
        if t.rank0:
            log.info("writing the checkpoint to %s and metrics to %s", t.checkpoint_url,
                     os.path.join(cfg.system.output_dir, "metrics.jsonl"))
        signum = (elastic or train)(t, stop)
        if signum == FAULT:  # every rank says it in one line, with the fault's status (75: resume later)
            raise stopped_by_fault(t, stop.agreed)
        if signum and t.rank0:
            log.info("stopped by signal %d in epoch %d after batch %d (step %d, %d clips seen): checkpoint "
                     "saved to %s; the same command with --resume continues", signum, t.epoch + 1, t.batch,
                     t.step, t.engine.clips_seen, t.checkpoint_url)
        elif t.rank0:
            log.info("done: checkpoint %s, metrics %s (trainer plot %s draws them)", t.checkpoint_url,
                     os.path.join(cfg.system.output_dir, "metrics.jsonl"), cfg.system.output_dir)
        return 128 + signum if signum else 0
    except Exception as error:
        if t is None or elastic is not None or not isinstance(error, t.backend.peer_lost):
            raise
        # Horovod shuts the job down when a rank exits (a refusal of its own, a crash): this rank's
        # next collective fails at once, and it says so in one line instead of a traceback
        raise CommandError(f"rank {t.backend.rank}: another rank of the job stopped, so this one cannot go "
                           "on (that rank's own error says why)") from None
    finally:
        stop.restore()
        if t is not None:
            t.close()


def stopped_by_fault(t: Trainer, fault: DataFault) -> DataFault:
    """``fault`` (the one every rank agreed on), its message followed by where the run stopped and
    how it goes on; raised by every rank once the checkpoint is in place."""
    remedy = ("once the source answers, the same command with --resume continues from there" if fault.resume
              else "the same command with --resume continues from there once that is repaired")
    where = "during its validation" if t.train_loader.epoch_finished else f"after batch {t.batch}"
    fault.message = (f"{fault}; stopped in epoch {t.epoch + 1} {where} (step {t.step}, {t.engine.clips_seen} "
                     f"clips seen), checkpoint saved to {t.checkpoint_url}: {remedy}")
    fault.args = (fault.message,)
    return fault

