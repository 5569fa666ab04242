"""``ClipDataset``: a set's clips as a torch ``IterableDataset``, for a ``DataLoader`` the user builds.

For runners that make their own ``DataLoader`` (Lightning, mmaction2, SlowFast, a loop of one's own).
It reads what ``ClipLoader`` reads, planned by the same planner (``trainer.data.epochs``): the
rank's share of the epoch's seeded order, split among the DataLoader's workers as whole batches, every
sample checked against the manifest's digest. Pass the DataLoader the dataset's ``batch_size`` and
every batch is one worker's, so each rank yields the same number of full batches and every clip
comes once per epoch (with ``remainder="pad"``, repeats marked ``valid`` False fill the last ones).
The ready loader (``ClipLoader``) does the same with shared-memory batch slots, which a user's
``DataLoader`` cannot have: it is the faster of the two (``bench/peers.py``).

A sample is one row of a ``ClipLoader`` batch, under the same names, so that ``default_collate``
makes the same batch: ``clips`` uint8 (T, C, H, W) (a view of channels-last memory; (views, T, C, H, W)
with ``eval_crops=3``), ``labels`` (int, -1 unlabeled), ``keys``, ``videos``, ``valid``. What
``clips`` holds is chosen by ``frames``:

- ``"crops"`` (default): the built-in transforms (``trainer.data.transforms``: TSM's multi-scale crop
  and flip for training, the centre or three crops for evaluation), decoding only each crop's
  rectangle of the JPEGs;
- ``"decoded"``: whole frames, uint8 (T, C, H, W), passed through ``transform`` if given (a callable
  taking and returning such a tensor, torchvision's v2 transforms for one), run under torch's RNG
  seeded by the clip's key, seed and epoch, so its random draws are the same whatever the workers;
- ``"jpeg"``: the frames' JPEG bytes, undecoded (a tuple of T ``bytes``; collate with
  ``ClipDataset.collate``).

``geometry=True`` adds the built-in crop's ``boxes`` (views, 4: left, top, right, bottom in pixels of
the stored frame) and ``flip``, drawn as ``frames="crops"`` draws them, for users who crop themselves.

Epochs: iterating a finished epoch starts the next: each DataLoader worker, once its share is read,
moves its own epoch on in the dataset's shared memory (one entry per worker, so no worker learns of
another's end before its own), where the workers a ``DataLoader`` forks later read it; ``set_epoch(e)``
chooses one for all. Position: under torchdata's ``StatefulDataLoader`` (``state_dict``/``load_state_dict``
in each worker, the protocol it calls) every worker's state is its epoch and the batches it has made
there, so a resumed loader continues the identical sequence wherever it was stopped, with as many
DataLoader workers as before (torchdata refuses another count; a state saved with another world size or
batch size is refused in one line: ``ClipLoader``'s state resumes on those, splitting the rest of the
epoch anew).
"""
from __future__ import annotations

import io
import logging
import sys
from dataclasses import fields

import numpy as np
import torch
from PIL import Image
from torch.utils.data import IterableDataset, default_collate, get_worker_info

from shards.format.sample import video_of
from shards.plan import partition

from ..config import IMAGENET_MEAN, IMAGENET_STD
from .arguments import Flag, Function, OneOf, check, warn
from .epochs import EpochOptions
from .loader import ClipLoader
from .plan import WorkerPlan
from .stages import ordered_samples

log = logging.getLogger(__name__)

FRAMES = ("crops", "decoded", "jpeg")
MAX_WORKERS = 256  # DataLoader workers a dataset keeps an epoch for, each its own (module docstring)
# ClipDataset's own arguments and their rules (trainer.data.arguments); ClipLoader checks the rest
ARGUMENTS = {"frames": OneOf(FRAMES), "transform": Function(), "geometry": Flag(), "skip_bad": Flag()}


class BatchSizeMismatch(UserWarning):
    """A ``DataLoader`` collating a ``ClipDataset``'s clips in batches of another size than the dataset's
    ``batch_size``: its batches are cut across the planned ones (the last of each worker's share short,
    ranks yielding different counts of them)."""


def collated_batch_size(caller) -> int | None:
    """The batch size a torch ``DataLoader`` collates a dataset's samples in, read from ``caller``, the
    frame that asked for the first sample: in a ``DataLoader`` (torchdata's ``StatefulDataLoader`` too),
    its fetcher's ``fetch``, whose index list is one batch. None without batching (``batch_size=None``)
    or for another caller (a loop over the dataset itself)."""
    fetcher, index = caller.f_locals.get("self"), caller.f_locals.get("possibly_batched_index")
    if caller.f_code.co_name != "fetch" or not getattr(fetcher, "auto_collation", False) or index is None:
        return None
    return len(index)


class ClipDataset(IterableDataset):
    """The clips of ``split`` of the set at ``data`` (a directory, ``manifest.json`` or service URL), this
    rank's share, for ``DataLoader(dataset, batch_size=dataset.batch_size, num_workers=N)``.

    The keyword arguments are ``ClipLoader``'s (rank and world size from ``torch.distributed`` or
    ``RANK``/``WORLD_SIZE``/``LOCAL_WORLD_SIZE`` when not given), less its worker count (the DataLoader's)
    and the trainer's own, plus ``frames``, ``transform`` and ``geometry`` (module docstring), all checked as
    the dataset is made (``ValueError`` or ``TypeError`` naming the argument). ``train`` left out: True for
    the split named ``"train"``, False (the evaluation transform, stored order) for the others.
    ``skip_bad``: a sample whose bytes differ from the manifest's digest is replaced by a repeat of a good
    one marked ``valid`` False (and logged) instead of ending the iteration with ``CorruptSample``.

    A ``DataLoader`` whose ``batch_size`` is not the dataset's gets one ``BatchSizeMismatch`` warning, from
    the only process or the first worker (in a worker, on its stderr), once for the dataset's life."""

    def __init__(self, data, split: str = "train", *, batch_size: int, frames: str = "crops", transform=None,
                 geometry: bool = False, skip_bad: bool = False, **options):
        check(ARGUMENTS, locals())
        if transform is not None and frames != "decoded":
            raise ValueError("transform is applied to decoded frames: give frames='decoded' with it")
        # the reading (the node cache, the transform, the source's retries) and the planner, ``epochs``
        planning = {f.name: options.pop(f.name) for f in fields(EpochOptions) if f.name in options}
        self.loader = ClipLoader(data, split, EpochOptions(batch_size=batch_size, **planning), num_workers=1,
                                 max_bad_samples=None, **options)
        self.epochs = self.loader.epochs
        self.batch_size, self.frames = batch_size, frames
        self.user_transform, self.geometry = transform, geometry
        self.skip_bad = skip_bad
        # the epoch each DataLoader worker reads next, by worker (module docstring)
        self._epochs = torch.full((MAX_WORKERS,), self.epochs.epoch, dtype=torch.int64).share_memory_()
        self._warned = torch.zeros(1, dtype=torch.bool).share_memory_()  # BatchSizeMismatch, by any worker
        self._skip = 0  # batches of this worker's stream already made (a resumed StatefulDataLoader worker's)
        self._made = 0  # batches this worker has made this epoch, as its state says

    @property
    def epoch(self) -> int:
        """The epoch the next iteration reads (its first worker's)."""
        return int(self._epochs[0])

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch`` from its start at the next iteration."""
        self._epochs[:] = epoch

    def __len__(self) -> int:
        """Clips this rank reads in an epoch (a whole number of batches)."""
        return self.batch_size * self.epochs.epoch_batches(self.epoch)

    # --- the StatefulDataLoader protocol (called in each worker on its copy) -----------------------
    def state_dict(self) -> dict:
        self._here()
        return {"position": self.loader.state_dict(), "worker_batches": self._made}

    def load_state_dict(self, state: dict) -> None:
        worker = self._here()
        saved = state["position"]["segments"][-1]
        if not self.epochs.same_layout(state["position"]):
            raise ValueError(f"a ClipDataset position saved with {saved['num_workers']} DataLoader "
                             f"worker(s), {saved['world_size']} rank(s) and batches of {saved['batch_size']} "
                             f"cannot continue with {self.epochs.workers}, {self.epochs.world_size} and "
                             f"{self.batch_size}: give the DataLoader as many workers, or resume with "
                             "ClipLoader, which splits the rest of the epoch anew")
        self.loader.load_state_dict(state["position"])
        self._epochs[worker] = self.epochs.epoch
        self._skip = self._made = state["worker_batches"]

    # --- reading --------------------------------------------------------------------------------
    def _here(self) -> int:
        """The planner at this worker's epoch, split among this DataLoader's workers; this worker's number."""
        info = get_worker_info()
        worker, self.epochs.workers = (info.id, info.num_workers) if info else (0, 1)
        if worker >= MAX_WORKERS:
            raise ValueError(f"a DataLoader of {info.num_workers} workers over a ClipDataset: "
                             f"at most {MAX_WORKERS}")
        epoch = int(self._epochs[worker])
        if epoch != self.epochs.epoch:
            self.loader.set_epoch(epoch)
            self._skip = self._made = 0
        return worker

    def _check_batches(self, caller) -> None:
        """``BatchSizeMismatch`` when the DataLoader asking (``caller``: ``collated_batch_size``) collates
        batches of another size, warned once, by its first worker."""
        size, info = collated_batch_size(caller), get_worker_info()
        if size is None or size == self.batch_size or bool(self._warned[0]) or (info is not None and info.id):
            return
        self._warned[0] = True
        warn(f"DataLoader(batch_size={size}) over ClipDataset(batch_size={self.batch_size}): each worker's "
             f"share is whole batches of {self.batch_size} clips, so batches of {size} are cut across them "
             "(the last of a worker's short, ranks yielding different counts); give the DataLoader "
             "batch_size=dataset.batch_size", BatchSizeMismatch)

    def __iter__(self):
        self._check_batches(sys._getframe(1))  # (the body runs at the first next(): the caller is who asks)
        worker, loader = self._here(), self.loader
        plan, epoch = loader.worker_plans({worker: self._skip})[worker], loader.epoch
        if plan.order:
            for i, sample in enumerate(ordered_samples(plan, {}, loader.cache, loader.lookahead,
                                                       self.skip_bad, loader.retry, loader.manifest.frames,
                                                       loader.manifest.motion)):
                row = self._sample(sample, plan, epoch)
                if (i + 1) % self.batch_size == 0:
                    self._made += 1  # before the batch's last row leaves: a state taken after it counts it
                yield row
        self._epochs[worker] = epoch + 1  # this worker's share is read: its next iteration moves on
        self._here()  # (and its state says so)

    def _sample(self, sample: dict, plan: WorkerPlan, epoch: int) -> dict:
        """One clip as a row of a batch (module docstring)."""
        loader, key = self.loader, sample["__key__"]
        bad = sample.get("__bad__")
        if bad is not None:
            log.warning("bad sample left out, a repeat of another clip in its place (valid False): %s",
                        {k: bad[k] for k in ("url", "key", "expected", "found") if k in bad})
        rng = partition.rng_for("augment", loader.seed, epoch, key)
        jpegs = loader.transform.members(sample)
        out = {"labels": sample["label"], "keys": key, "videos": video_of(key),
               "valid": sample["__local__"] < plan.valid_locals and bad is None}
        if self.geometry:
            g, d, _ = loader.transform.draw(jpegs[0], partition.rng_for("augment", loader.seed, epoch, key))
            out["boxes"] = torch.tensor(g.boxes, dtype=torch.float64) * d
            out["flip"] = g.flip
        if self.frames == "crops":
            out["clips"] = torch.from_numpy(loader.transform(jpegs, rng)).movedim(-1, -3)
        elif self.frames == "jpeg":
            out["clips"] = tuple(bytes(j) for j in jpegs)  # a memoryview does not pickle into a worker queue
        else:
            clip = torch.from_numpy(np.stack([np.asarray(Image.open(io.BytesIO(j)).convert("RGB"))
                                              for j in jpegs])).movedim(-1, -3)
            if self.user_transform is not None:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(rng.getrandbits(63))
                    clip = self.user_transform(clip)
            out["clips"] = clip
        return out

    @staticmethod
    def collate(samples: list[dict]) -> dict:
        """``default_collate``, except that JPEG bytes stay one tuple per clip (a list of B tuples of T)."""
        jpegs = [s["clips"] for s in samples] if isinstance(samples[0]["clips"], tuple) else None
        out = default_collate([{k: v for k, v in s.items() if k != "clips" or jpegs is None}
                               for s in samples])
        return out if jpegs is None else {**out, "clips": jpegs}


def normalise(clips: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 RGB clips (..., C, H, W) -> ``dtype``, scaled to [0, 1] and normalised with ImageNet's
    mean and standard deviation per channel (``MEAN``, ``STD``), as TSM's network does on the device."""
    shape = (3,) + (1,) * 2
    mean = torch.tensor(IMAGENET_MEAN, dtype=dtype, device=clips.device).view(shape)
    std = torch.tensor(IMAGENET_STD, dtype=dtype, device=clips.device).view(shape)
    return (clips.to(dtype) / 255 - mean) / std


MEAN, STD = IMAGENET_MEAN, IMAGENET_STD
