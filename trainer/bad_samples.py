"""``--max-bad-samples``: a run goes on past samples whose bytes differ from the manifest, up to a budget.

Each rank's loaders leave such samples out (``trainer.data.loader`` with ``max_bad_samples=None``):
a repeat of a good clip takes the bad one's place, marked ``valid`` False as a padding repeat is,
so it weighs nothing in the loss, every rank still steps on batches of the same size (the
collectives stay in step) and every good clip is trained once an epoch. The step's mean still
divides by the real clips the plan gave it (``global_valid``, the same number on every rank), so
that one step's gradient is (n - k) / n of the mean over its n - k clips left, and the clips seen
(the learning rate's position, batch growth's epochs) count the epoch's planned clips: knowing k
before the step would cost every step one more collective.

This hook keeps the budget over every rank, ``--max-bad-samples`` per epoch in each split: a count,
or a share of the split's clips. At every boundary, at an epoch's end and after each validation
batch the ranks sum how many bad samples they met since the last time (a one-number allreduce,
only under the flag); when any did, they gather the records, so every rank counts them alike, and
rank 0 logs each sample once a run (one line naming the shard, the sample, both digests and the
URL) and appends one JSON line per sample and epoch to ``OUTPUT_DIR/bad-samples.jsonl``:
``{"epoch", "step", "split", "clip", "shard", "key", "index", "expected", "found", "url", "rank"}``,
where ``shards verify`` names the same shard and sample, and the viewer shows clip ``clip`` of
``split``. The epoch's metrics record counts them (``bad_samples``, ``val_bad_samples``). One past
the budget stops every rank at the same point with ``TooManyBadSamples`` (a ``DataFault``: one
line saying the budget was exceeded).
"""
from __future__ import annotations

import json
import logging
import os

import torch

from shards.base.commands import share_of
from shards.format.digests import TooManyBadSamples
from shards.io import storage

from .hooks import Hook

log = logging.getLogger(__name__)

FILE = "bad-samples.jsonl"


def limit(budget: str, clips: int) -> int:
    """The bad samples ``--max-bad-samples`` lets an epoch go on without in a split of ``clips``."""
    return share_of(budget, clips)


class BadSamples(Hook):
    """The budget, the log and the list of the samples the loaders left out (module docstring).
    ``clips``: the clips of each split the run reads (the training split first, then validation's)."""

    key = "bad_samples"

    def __init__(self, output_dir: str, budget: str, clips: dict[str, int], rank0: bool):
        self.budget, self.rank0 = budget, rank0
        self.limits = {split: limit(budget, n) for split, n in clips.items()}
        self.train_split, self.val_split = (list(clips) + [None])[:2]
        self.path = os.path.join(output_dir, FILE)
        self.pending: list[dict] = []  # met by this rank since the ranks last agreed
        # the epoch counted, bad samples by split, the last one's line
        self.epoch, self.counts, self.last = 0, {}, {}
        self.step = 0  # the run's step when the ranks last agreed
        self.logged: set[tuple[str, str]] = set()  # (shard, key) of every sample logged this run

    # --- the loop's points --------------------------------------------------------------------
    def before_step(self, t, batch: dict) -> None:
        if batch["period_end"]:  # (a multigrid loader batch's parts all carry its list)
            self.pending += batch.get("bad", [])

    def at_boundary(self, t) -> None:
        self._agree(t)

    def at_epoch_end(self, t) -> dict:
        self._agree(t)
        return {"bad_samples": self.counts.get(self.train_split, 0)}

    def validation_batch(self, t, batch: dict | None) -> None:
        self.pending += batch.get("bad", []) if batch is not None else []
        self._agree(t)

    def at_validation_end(self, t) -> dict:
        return {"val_bad_samples": self.counts.get(self.val_split, 0)}

    # --- agreeing, listing, keeping the budget ------------------------------------------------
    def _agree(self, t) -> None:
        """Every rank takes in what every rank met since the last time, then stops past the budget."""
        if t.epoch != self.epoch:
            self.epoch, self.counts, self.last = t.epoch, {}, {}
        self.step, self.rank0 = t.step, t.backend.rank == 0  # (an elastic job's rank 0 may change)
        met = t.backend.all_sum(torch.tensor([len(self.pending)], dtype=torch.int64)).item()
        if met:
            found = [r for records in t.backend.all_gather_object(self.pending) for r in records]
            for record in found:
                self._take(record)
        self.pending = []
        for split, n in self.counts.items():
            if n > self.limits[split]:
                raise TooManyBadSamples(
                    f"{n} samples of {split} in epoch {self.epoch + 1} are bad (their digests differ from "
                    f"the manifest's, or the format refuses them), more than --max-bad-samples {self.budget} "
                    f"allows ({self.limits[split]}); the last: {self.last[split]}; all are listed in "
                    f"{self.path}")

    def _take(self, record: dict) -> None:
        split = record["split"]
        self.counts[split] = self.counts.get(split, 0) + 1
        self.last[split] = record["line"]
        if not self.rank0:
            return
        if (record["shard"], record["key"]) not in self.logged:
            self.logged.add((record["shard"], record["key"]))
            log.warning("left out (--max-bad-samples %s): %s", self.budget, self.last[split])
        line = {"epoch": self.epoch + 1, "step": self.step,
                **{k: v for k, v in record.items() if k != "slot"}}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    # --- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step": self.step, "counts": self.counts, "last": self.last,
                "logged": sorted(self.logged)}

    def load_state_dict(self, state: dict | None) -> None:
        """Go on counting the saved epoch; rank 0's list keeps the records up to the saved step, those
        after it (written by a run killed since) being met again."""
        if state is None:  # a checkpoint written without the flag
            return
        self.epoch, self.step, self.counts = state["epoch"], state["step"], dict(state["counts"])
        self.last, self.logged = dict(state["last"]), {tuple(k) for k in state["logged"]}
        if self.rank0 and os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as f:
                kept = [line for line in f if line.endswith("\n") and json.loads(line)["step"] <= self.step]
            storage.atomic_write(self.path, "".join(kept).encode())
