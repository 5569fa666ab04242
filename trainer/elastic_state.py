"""The training state as Horovod Elastic handles it: committed in memory, rolled back, re-formed, synced.

A commit copies (in memory, on every rank) the weights, optimizer, grad scaler, clips seen
(the learning rate follows from them), epoch/batch/step, the loader's position and the epoch's
training totals, summed over the ranks (``metrics.StepTotals``: rank 0 carries them on, as after
a resume). When a rank dies the others get
``HorovodInternalError`` from a collective; Horovod calls, in this order, ``restore`` (back to
the last commit), then re-forms the ring, then ``reset`` (rank, size, loaders and recipe for
the new world size), then ``sync`` (every rank, joining ones included, at rank 0's state).
When ranks are added or removed, ``commit`` raises ``HostsUpdatedInterrupt`` right after saving,
and the same re-forming follows without a rollback.

Imports Horovod: load it only for ``trainer elastic`` (``trainer.elastic`` does so lazily).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import time

from horovod.common.elastic import State

from . import metrics
from .hooks import Hook
from .schedules import recipe

log = logging.getLogger("trainer.elastic")


def rescale(engine, world_size: int) -> None:
    """The recipe for a new world size: the peak rate linear in the new global batch; warm-up and
    cosine are counted in clips, so the schedule goes on from the clips seen."""
    engine.global_batch = engine.batch_size * world_size
    engine.schedule = dataclasses.replace(engine.schedule,
                                          peak=recipe.scaled_lr(engine.recipe.lr_per_8, engine.global_batch))
    engine.seek(engine.clips_seen)


class ElasticState(State, Hook):
    """A ``trainer.train.Trainer``'s state for ``hvd.elastic.run``, and the loop's hook that commits it.

    ``generation`` counts syncs (equal on every rank, never rolled back): each starts from a
    commit, so a step recorded under a later generation replaces what a rollback undid (``--clip-log``).
    """

    def __init__(self, t, hvd, commit_every: int):
        super().__init__(bcast_object=t.backend.broadcast_object, get_rank=hvd.rank)
        self.t, self.hvd, self.every = t, hvd, commit_every
        self.started = False  # True once the first ring has run Trainer.start (resume, broadcast)
        self.totals = metrics.StepTotals().values  # the epoch's at the last commit, summed over the ranks
        self.generation = 0
        self.resets = 0
        self.reformed = 0  # the ring's size before a re-formation sync has not announced yet
        self.commits, self.commit_seconds, self.steps_lost = 0, 0.0, 0
        self.saved: dict = {}
        self.save()

    def _small(self) -> dict:
        return {**self.t.position(), "started": self.started, "epoch_totals": self.totals,
                "hooks": self.t.hook_states()}

    def _load_small(self, small: dict) -> None:
        self.started, self.totals = small["started"], small["epoch_totals"]
        self.t.load_hook_states(small["hooks"])
        self.t.load_position(small)

    def save(self) -> None:
        e = self.t.engine
        self.saved = copy.deepcopy({"model": e.model.state_dict(), "optimizer": e.optimizer.state_dict(),
                                    **self._small()})

    def commit(self) -> None:
        started = time.perf_counter()
        self.totals = self.t.epoch_totals.reduce(self.t.backend.all_sum).values
        self.t.carry_totals(self.totals)
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
        log.info("rank %d: a rank failed; back to the last commit, epoch %d batch %d (step %d): "
                 "%d steps lost", t.backend.rank, t.epoch + 1, t.batch, t.step, lost)

    def sync(self) -> None:
        """Every rank at rank 0's state (a joining rank gets it here), which becomes the commit."""
        t = self.t
        t.backend.agree_on_nodes()  # the ring's node layout, before the loader's position is loaded for it
        t.train_loader.epochs.local_size = t.backend.local_size
        small, generation = t.backend.broadcast_object((self._small(), self.generation))
        self.generation = generation + 1
        self._load_small(small)
        t.backend.broadcast_state(t.engine.model, t.engine.optimizer)
        self.save()
        if self.reformed and t.rank0:
            log.info("ring re-formed: %d -> %d ranks; epoch %d continues at batch %d, %d batches left; "
                     "global batch %d, lr %.3g", self.reformed, t.backend.size, t.epoch + 1, t.batch,
                     len(t.train_loader), t.engine.global_batch, t.engine.lr)
        self.reformed = 0

    def reset(self) -> None:
        """After Horovod re-formed the ring, before ``sync``: rank, size, loaders and recipe for the
        new world size, from the last commit (rolled back to, or just made)."""
        t, b, hvd = self.t, self.t.backend, self.hvd
        self.reformed = b.size  # said in sync, once the ring agreed on its nodes
        b.rank, b.size, b.local_rank = hvd.rank(), hvd.size(), hvd.local_rank()
        b.local_ranks, b.local_size = hvd.local_size(), 1  # the node layout: agreed in sync
        was_rank0, t.rank0 = t.rank0, b.rank == 0
        t.make_loaders(t.train_loader.manifest)
        t.train_loader.load_state_dict(self.saved["loader"])
        rescale(t.engine, b.size)
        t.carry_totals(self.totals)  # a survivor may be the new rank 0
        if t.rank0 != was_rank0:  # the metrics log moves with rank 0
            t.open_log()
        self.resets += 1

    def at_boundary(self, t) -> None:
        """At every step boundary (``t.batch`` > 0) and every epoch end (``t.batch`` == 0): commit
        when due. Restored after an epoch's last step, the loop finds the loader's epoch finished
        and goes on to validation."""
        if t.batch == 0 or t.step % self.every == 0:
            self.commit()
