"""The clip log (``--clip-log`` of ``trainer train`` and ``trainer elastic``): the clips every
training step of every process trained on, and what they prove.

Every process appends, before each training step, one JSON line to
``OUTPUT_DIR/clips/<host>-<pid>.jsonl`` (``host`` as horovodrun names the slot):
``{"time", "epoch", "batch", "step", "rank", "size", "clips_seen", "keys", "padding", "weights"}``
and, under ``trainer elastic``, ``"generation"``. ``epoch`` is counted from 1 (as in the log and
metrics.jsonl), ``batch`` is the step's index in its epoch,
``step`` the run's, ``clips_seen`` the real clips of every earlier step (the learning rate's
position), ``keys`` the real clips the step trains on, ``padding`` the keys of the repeats that
fill its batch and ``weights`` a digest of the weights it starts from (hashing them costs a copy
to the CPU per step: this is an audit, not for production runs of large models). Written
before the step, so a step that took part in a commit is always logged, even by a rank killed
just after.

``committed_clips`` reads an elastic run's logs back as its effective history. A generation is
one sync of the ring (``ElasticState.generation``); it starts from a commit, so its first step
in an epoch marks where that epoch was rolled back to: every step an earlier generation logged
at that index or later in the epoch was undone.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import socket
import time
from collections import Counter, defaultdict

from .hooks import Hook

DIRECTORY = "clips"


def weights_digest(named_tensors) -> str:
    """SHA-256 of (name, tensor) pairs in order, e.g. ``model.named_parameters()``: equal on ranks
    that hold the same weights."""
    h = hashlib.sha256()
    for name, tensor in named_tensors:
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class ClipLog(Hook):
    """The loop's hook that logs each training batch before its step; ``generation()``, where
    given, goes in every record (``trainer elastic``)."""

    def __init__(self, output_dir: str, generation=None):
        self.generation = generation
        directory = os.path.join(output_dir, DIRECTORY)
        os.makedirs(directory, exist_ok=True)
        host = os.environ.get("HOROVOD_HOSTNAME", socket.gethostname())  # the name horovodrun gave this slot
        self.file = open(os.path.join(directory, f"{host}-{os.getpid()}.jsonl"), "a",
                         encoding="utf-8", buffering=1)

    def before_step(self, t, batch: dict) -> None:
        valid = batch["valid"].tolist()
        record = {"time": round(time.time(), 3), "epoch": t.epoch + 1, "batch": t.batch, "step": t.step,
                  "rank": t.backend.rank, "size": t.backend.size, "clips_seen": t.engine.clips_seen,
                  "keys": [k for k, v in zip(batch["keys"], valid, strict=True) if v],
                  "padding": [k for k, v in zip(batch["keys"], valid, strict=True) if not v],
                  "weights": weights_digest(t.engine.model.named_parameters())[:16]}
        if self.generation is not None:
            record["generation"] = self.generation()
        self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.file.close()


def read_file(path: str) -> list[dict]:
    """One process's records; a line still being written (or cut by a kill) is left out."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def read(output_dir: str) -> list[dict]:
    """Every process's records."""
    return [r for path in sorted(glob.glob(os.path.join(output_dir, DIRECTORY, "*.jsonl")))
            for r in read_file(path)]


def committed(records: list[dict]) -> list[dict]:
    """The records of an elastic run's steps that count: those no later generation rolled back."""
    starts = defaultdict(dict)  # epoch -> generation -> first batch index
    for r in records:
        first = starts[r["epoch"]]
        first[r["generation"]] = min(first.get(r["generation"], r["batch"]), r["batch"])
    kept = []
    for r in records:
        later = [b for g, b in starts[r["epoch"]].items() if g > r["generation"]]
        if r["batch"] < min(later, default=r["batch"] + 1):
            kept.append(r)
    return kept


def committed_clips(output_dir: str) -> dict[int, Counter]:
    """Epoch -> how many times each clip was trained on in the steps that count (``trainer elastic``)."""
    out = defaultdict(Counter)
    for r in committed(read(output_dir)):
        out[r["epoch"]].update(r["keys"])
    return dict(out)
