"""Training checkpoints: one file with everything ``--resume`` needs, written atomically.

Holds model, optimizer and grad-scaler state, the clips seen (the learning rate's position),
the loader's position, the epoch/step counters, the current epoch's training sums, the model
config and every rank's RNG states. The file is replaced by rename
(``shards.storage.atomic_write``), so a crash while saving leaves the previous one.
``differences`` says why a checkpoint cannot continue the run a command line describes.
"""
from __future__ import annotations

import io
import random

import torch

from shards import storage

NAME = "checkpoint.pt"
# what makes another network, even where the parameter names agree (TSM and TSN have the same)
MODEL_FIELDS = ("shift", "segments", "shift_div", "depth", "width", "num_classes")


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(url: str, state: dict) -> None:
    buf = io.BytesIO()
    torch.save(state, buf)
    storage.atomic_write(url, buf.getvalue())


def load(url: str) -> dict | None:
    """The checkpoint at ``url``, or None when there is none yet."""
    if not storage.exists(url):
        return None
    return torch.load(io.BytesIO(storage.read_bytes(url)), map_location="cpu", weights_only=True)


def differences(state: dict, model_config: dict, bn: str, fingerprint: str, split: str) -> list[str]:
    """Why ``state`` is not a checkpoint of the run described by the rest: each model field, the
    BN mode (it decides which parameters the optimizer holds), the shard set (its manifest
    fingerprint) or the training split that differs, as ``name: checkpoint's vs now``."""
    if "clips_seen" not in state:
        return ["written by a trainer whose schedule counted steps (no clips_seen)"]
    saved, loader = state["model_config"], state["loader"]
    pairs = [(f"model {k}", saved[k], model_config[k]) for k in MODEL_FIELDS]
    pairs += [("--bn", state["args"]["bn"], bn), ("data: manifest fingerprint", loader["fingerprint"], fingerprint),
              ("--train-split", loader["split"], split)]
    return [f"{name} {old} in the checkpoint, {new} now" for name, old, new in pairs if old != new]
