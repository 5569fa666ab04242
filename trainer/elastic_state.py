"""The training state as Horovod Elastic handles it: committed in memory, rolled back, re-formed, synced.

A commit copies (in memory, on every rank) the weights, optimizer, schedule, grad scaler,
epoch/batch/step, clips seen and the loader's position. When a rank dies the others get
``HorovodInternalError`` from a collective; Horovod calls, in this order, ``restore`` (back to
the last commit), then re-forms the ring, then ``reset`` (rank, size, loaders and recipe for
the new world size), then ``sync`` (every rank, joining ones included, at rank 0's state).
When ranks are added or removed, ``commit`` raises ``HostsUpdatedInterrupt`` right after saving,
and the same re-forming follows without a rollback.

Imports Horovod: load it only for ``trainer elastic`` (``trainer.elastic`` does so lazily).
"""
from __future__ import annotations

import copy
import logging
import time

from horovod.common.elastic import State

from . import metrics, recipe

log = logging.getLogger("trainer.elastic")


def rescale(engine, world_size: int, steps_per_epoch: int, clips_seen: int) -> None:
    """The recipe for a new world size: learning rate linear in the new global batch, schedule
    (warm-up, cosine) counted in the new steps, continued where ``clips_seen`` clips had brought it."""
    a = engine.args
    engine.global_batch = a.batch_size * world_size
    engine.peak_lr = recipe.scaled_lr(a.lr_per_8, engine.global_batch)
    engine.total_steps = a.epochs * steps_per_epoch
    engine.warmup_steps = min(engine.total_steps, round(a.warmup_epochs * steps_per_epoch))
    for group in engine.optimizer.param_groups:
        group["initial_lr"] = engine.peak_lr  # the base a new scheduler takes
    engine.scheduler = recipe.build_scheduler(engine.optimizer, engine.warmup_steps, engine.total_steps)
    state = engine.scheduler.state_dict()
    state["last_epoch"] = round(clips_seen / engine.global_batch)
    recipe.load_scheduler_state(engine.scheduler, state)


class ElasticState(State):
    """A ``trainer.train.Trainer``'s state for ``hvd.elastic.run``.

    ``generation`` counts syncs (equal on every rank, never rolled back): each starts from a
    commit, so a step recorded under a later generation replaces what a rollback undid (``--clip-log``).
    """

    def __init__(self, t, hvd, commit_every: int):
        super().__init__(bcast_object=t.backend.broadcast_object, get_rank=hvd.rank)
        self.t, self.hvd, self.every = t, hvd, commit_every
        self.started = False  # True once the first ring has run Trainer.start (resume, broadcast)
        self.clips_seen = 0
        self.generation = 0
        self.resets = 0
        self.epoch_batches = 0  # batches in the current epoch: see after_step
        self.commits, self.commit_seconds, self.steps_lost = 0, 0.0, 0
        self.saved: dict = {}
        self.save()

    def _small(self) -> dict:
        t, e = self.t, self.t.engine
        return {"epoch": t.epoch, "batch": t.batch, "step": t.step, "clips_seen": self.clips_seen,
                "started": self.started, "loader": t.train_loader.state_dict(),
                "scheduler": e.scheduler.state_dict(), "scaler": e.scaler.state_dict()}

    def _load_small(self, small: dict) -> None:
        t, e = self.t, self.t.engine
        t.epoch, t.batch, t.step = small["epoch"], small["batch"], small["step"]
        self.clips_seen, self.started = small["clips_seen"], small["started"]
        t.train_loader.load_state_dict(small["loader"])
        recipe.load_scheduler_state(e.scheduler, small["scheduler"])
        e.scaler.load_state_dict(small["scaler"])

    def save(self) -> None:
        e = self.t.engine
        self.saved = copy.deepcopy({"model": e.model.state_dict(), "optimizer": e.optimizer.state_dict(),
                                    **self._small()})

    def commit(self) -> None:
        started = time.perf_counter()
        self.save()
        self.commits += 1
        self.commit_seconds += time.perf_counter() - started
        self.check_host_updates()

    def restore(self) -> None:
        t, e = self.t, self.t.engine
        lost = t.step - self.saved["step"]
        e.model.load_state_dict(self.saved["model"])
        e.optimizer.load_state_dict(self.saved["optimizer"])
        self._load_small(self.saved)
        self.steps_lost += lost
        log.info("rank %d: a rank failed; back to the last commit, epoch %d batch %d (step %d): %d steps lost",
                 t.backend.rank, t.epoch, t.batch, t.step, lost)

    def sync(self) -> None:
        """Every rank at rank 0's state (a joining rank gets it here), which becomes the commit."""
        t = self.t
        small, generation = t.backend.broadcast_object((self._small(), self.generation))
        self.generation = generation + 1
        self._load_small(small)
        t.backend.broadcast_state(t.engine.model, t.engine.optimizer)
        self.save()

    def reset(self) -> None:
        """After Horovod re-formed the ring, before ``sync``: rank, size, loaders and recipe for the
        new world size, from the last commit (rolled back to, or just made)."""
        t, b, hvd = self.t, self.t.backend, self.hvd
        before = b.size
        b.rank, b.size, b.local_rank = hvd.rank(), hvd.size(), hvd.local_rank()
        was_rank0, t.rank0 = t.rank0, b.rank == 0
        manifest = t.train_loader.manifest
        t.train_loader = t._loader(manifest, t.args.train_split, train=True)
        if t.val_loader is not None:
            t.val_loader = t._loader(manifest, t.args.val_split, train=False)
        t.steps_per_epoch = len(t.train_loader)
        t.train_loader.load_state_dict(self.saved["loader"])
        rescale(t.engine, b.size, t.steps_per_epoch, self.clips_seen)
        if t.rank0 != was_rank0:  # the metrics log moves with rank 0
            t.log.close()
            t.log = metrics.MetricsLog(t.args.output_dir, enabled=t.rank0, tensorboard=t.args.tensorboard)
        self.resets += 1
        if t.rank0:
            log.info("ring re-formed: %d -> %d ranks; epoch %d continues at batch %d, %d batches left; "
                     "global batch %d, lr %.3g", before, b.size, t.epoch, t.batch, len(t.train_loader),
                     t.engine.global_batch, t.engine.lr)

    def after_step(self) -> None:
        """``trainer.train.fit``'s hook, after every step (``t.batch`` > 0) and at every epoch end
        (``t.batch`` == 0): commit when due.

        Never right after an epoch's last step: restored there, the loop would start that epoch
        again. The commit at the epoch end, once ``fit`` has moved to the next epoch, covers it.
        """
        t = self.t
        if t.batch == 0:
            self.commit()
            self.epoch_batches = len(t.train_loader)
            return
        self.clips_seen += t.engine.global_batch
        if t.step % self.every == 0 and t.batch < self.epoch_batches:
            self.commit()
