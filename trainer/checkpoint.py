"""Training checkpoints: one file with everything ``--resume`` needs, written atomically.

Holds model, optimizer and grad-scaler state, the clips seen (the learning rate's position),
the loader's position, the epoch/step counters, the current epoch's training sums, the model
config, the run's config as data (``trainer.config.TrainConfig.to_dict``, versioned; older files
hold the parsed flags as ``args``, which ``trainer.config.of_checkpoint`` reads) and every rank's
RNG states. The file is replaced by rename
(``shards.io.storage.atomic_write``), so a crash while saving leaves the previous one.
``differences`` says why a checkpoint cannot continue the run a command line describes.
"""
from __future__ import annotations

import io
import random

import torch

from shards.base.errors import CommandError, NoSpace
from shards.io import storage

from .config import TrainConfig, architecture, of_checkpoint

NAME = "checkpoint.pt"
# what makes another network, even where the parameter names agree (TSM and TSN have the same); the
# architecture of checkpoints written before --arch is their shift's (trainer.config.architecture)
MODEL_FIELDS = ("arch", "segments", "shift_div", "depth", "width", "num_classes")
# the flags that name the architecture, compared as such by ``differences`` (--no-shift alone is --arch tsn)
NETWORK = (("model", "arch"), ("model", "shift"))
# flags a resumed run cannot take other than the checkpoint's: the optimizer state or the step
# sequence it saved would not fit (docs/faults.md); (concern, field)
REFUSED = (("data", "modality"), ("model", "bn"), ("recipe", "optimizer"), ("schedules", "multigrid"),
           ("schedules", "multigrid_stages"))
# flags that change nothing a run computes: where it runs, what it logs, where it reads and writes
# (the shard set itself is checked by its identity, ``shards.format.manifest``)
INERT = (("data", "data"), ("data", "workers"), ("data", "cache_dir"), ("data", "direct_reads"),
         ("data", "lookahead"), ("data", "source_deadline"),
         ("system", "backend"), ("system", "output_dir"), ("system", "resume"),
         ("system", "checkpoint_steps"), ("system", "print_freq"), ("system", "clip_log"),
         ("system", "tensorboard"), ("schedules", "trace_steps"))


def position(epoch: int, batch: int, epochs: int) -> str:
    """Where a run stands, in words: ``epoch`` (0-based: the epochs finished) and ``batch`` (the
    loader batches done in it) of a run of ``epochs``."""
    if epoch == epochs:
        return f"after its last epoch ({epoch} of {epochs}): nothing is left to train"
    if epoch > epochs:
        return f"after epoch {epoch}, past the {epochs} asked for: nothing is left to train"
    if batch == 0:
        return f"at the start of epoch {epoch + 1}"
    return f"in epoch {epoch + 1}, after batch {batch}"


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


class Unreadable(CommandError):
    """A checkpoint file that does not load: truncated, corrupt, or not a checkpoint."""


def save(url: str, state: dict) -> None:
    """Replace the checkpoint at ``url`` whole; on a full disk, ``NoSpace`` saying that the previous
    one (if any) is kept."""
    buf = io.BytesIO()
    torch.save(state, buf)
    try:
        storage.atomic_write(url, buf.getvalue())
    except NoSpace as full:
        kept = "the previous one is kept" if storage.exists(url) else "there is no earlier one"
        raise NoSpace(f"{full}: this checkpoint is not written, {kept}; with room, the same command with "
                      "--resume continues from the last one written") from None


def load(url: str) -> dict | None:
    """The checkpoint at ``url``, or None when there is none yet; ``Unreadable`` when it does not load."""
    if not storage.exists(url):
        return None
    data = storage.read_bytes(url)
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- whatever the file's damage makes torch raise
        said = (str(e).strip().splitlines() or [""])[0]
        reason = type(e).__name__ + (f": {said}" if said and len(said) <= 100 else "")
        raise Unreadable(f"{url} ({len(data):,} bytes) does not load: truncated or corrupt "
                         f"({reason})") from None


def differences(state: dict, model_config: dict, cfg: TrainConfig) -> list[str]:
    """Why ``state`` is not a checkpoint of the run ``cfg`` describes (its network ``model_config``):
    each model field, the BN mode (it decides which parameters the optimizer holds), the refused
    flags or the training split that differs, as ``name: checkpoint's vs now``. The shard set is
    checked apart, by its identity (``ClipLoader.saved_on``)."""
    if "clips_seen" not in state:
        return ["written by a trainer whose schedule counted steps (no clips_seen)"]
    saved, loader, old = state["model_config"], state["loader"], of_checkpoint(state)
    saved = {**saved, "arch": architecture(saved.get("arch"), saved.get("shift"))}
    pairs = [(f"model {k}", saved[k], model_config[k]) for k in MODEL_FIELDS]
    pairs += [(_flag(field), getattr(getattr(old, concern), field), getattr(getattr(cfg, concern), field))
              for concern, field in REFUSED]
    pairs += [("--train-split", loader["split"], cfg.data.train_split)]
    return [f"{name} {old} in the checkpoint, {new} now" for name, old, new in pairs if old != new]


def changes(state: dict, cfg: TrainConfig) -> list[str]:
    """The flags of ``cfg`` that differ from the checkpoint's and that the resumed run applies (all
    but the refused and the inert ones: the recipe's rate, momentum, weight decay, epochs, ...), as
    ``--flag old -> new``; the next checkpoint records the new values."""
    old, skip = of_checkpoint(state), set(REFUSED) | set(INERT) | set(NETWORK)
    out = []
    for concern in ("data", "model", "recipe", "system", "schedules"):
        then, now = getattr(old, concern), getattr(cfg, concern)
        for field in type(now).__dataclass_fields__:
            if (concern, field) not in skip and getattr(then, field) != getattr(now, field):
                out.append(f"{_flag(field)} {getattr(then, field)} -> {getattr(now, field)}")
    return out


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def hook_states(state: dict) -> dict:
    """The hooks' states by key (``trainer.hooks``); a checkpoint written before the hooks holds the
    regime's alone, under ``regime`` (and none before the regime)."""
    return state["hooks"] if "hooks" in state else {"regime": state.get("regime")}
