"""The data room: shards -> uint8 clip batches (B, T, C, H, W) on every rank; the public reading API.

For a training loop of one's own (docs/library.md): ``ClipLoader`` (the ready loader: batches from a set's
path or URL, its own worker processes and shared-memory batch slots, ``state_dict`` for exact and elastic
resume; ``EpochOptions``, the planner's options as one object), ``ClipDataset`` (a torch
``IterableDataset`` of the same clips for a ``DataLoader`` one builds, as Lightning, mmaction2 or SlowFast
do; ``BatchSizeMismatch``, its warning for a DataLoader batching them otherwise), ``normalise`` with
``MEAN`` and ``STD``, and the built-in crops (``TrainTransform``, ``EvalTransform``, their ``Geometry``).
Importing this package loads none of them until asked for, and none of them needs the trainer, Ray,
aiohttp, OpenCV or Horovod.

``epochs`` (the one epoch planner under both loaders: the node-mix verdict, position, orders, lengths,
state and each worker's plan; pure), ``loader`` (the streaming ``ClipLoader``: the I/O glue), ``plan``
(each worker's reads and order, pure functions over frozen records), ``position`` (where a loader stands
in its epochs, and how a saved position continues), ``rotation`` (which of a video's stored clips an epoch
reads when rotating), ``stages`` (the pipeline's stages: plain functions
over their plans), ``dataset`` (``ClipDataset``), ``transforms`` (TSM's crops, JPEG
decoding), ``cropdecode`` (the C crop decoder, ``trainer/libcropjpeg.so``), ``device_decode`` (nvJPEG on
the GPU), ``slots`` (the shared-memory batch pool), ``shapes`` (a multigrid epoch's batches cut into
parts; ``EpochShapes``, what the loader needs of a schedule) and ``arguments`` (the reading API's argument
checks, its warnings at the caller's line, and for the trainer its configs' loader options and its
refusals in the flags' words). Imports nothing of the trainer outside this room but its base
(``trainer.config``).
"""
import importlib

PUBLIC = {"ClipLoader": "loader", "EpochOptions": "epochs", "placement": "placement",
          "Upsampling": "transforms",
          "ClipDataset": "dataset",
          "BatchSizeMismatch": "dataset", "normalise": "dataset", "MEAN": "dataset", "STD": "dataset",
          "TrainTransform": "transforms", "EvalTransform": "transforms", "Geometry": "transforms"}
__all__ = sorted(PUBLIC)


def __getattr__(name: str):
    if name not in PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{PUBLIC[name]}"), name)
