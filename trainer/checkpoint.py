"""Training checkpoints: one file with everything ``--resume`` needs, written atomically.

Holds model, optimizer, scheduler and grad-scaler state, the loader's position, the
epoch/step counters, the model config and every rank's RNG states. The file is replaced by
rename (``shards.storage.atomic_write``), so a crash while saving leaves the previous one.
"""
from __future__ import annotations

import io
import random

import torch

from shards import storage

NAME = "checkpoint.pt"


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
