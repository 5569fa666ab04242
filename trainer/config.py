"""Every flag of ``trainer train``, ``trainer elastic``, ``trainer test`` and ``trainer plot``, defined once.

Imports nothing but the standard library, so ``trainer ... --help`` answers without loading PyTorch
(``trainer.cli``). A run is described by frozen dataclasses, one per concern: ``Data``, ``Model``, ``Recipe``,
``System`` and ``Schedules``, together a ``TrainConfig``. Each field is also its command-line flag:
``flag(...)`` holds the help text and whatever argparse needs besides the type and default (a ``--no-``
spelling, choices, ``nargs``), and ``add_arguments`` builds the parser's groups from the fields, so an option
is written once. So is its range: a range checker given as the flag's ``type`` (``positive_int``,
``number_in_range``) refuses the flag's text in argparse and, in ``__post_init__``, the value of a
config built in Python (``OutOfRange``: ``--batch-size: 0 is out of range: give 1 or more``). The parsed
namespace stops here: ``train_config``, ``elastic_config`` and ``evaluation_config`` turn it into the configs
that ``trainer.cli`` hands to the ``main`` of ``trainer.train``, ``trainer.elastic`` and ``trainer.evaluate``
(before importing them, so a refusal here comes before PyTorch loads); below them the code takes the
configs it needs, and tests build configs directly.

A checkpoint stores ``TrainConfig.to_dict()`` (plain data with a ``version``); ``of_checkpoint``
reads it back, and reads the flat ``args`` dict of checkpoints written before the configs
(version 0: the parsed flags, whose names are the fields' names).

Plain argparse, not tyro, jsonargparse or simple-parsing: measured for this module (docs/architecture.md),
tyro added about 120 ms of imports to a start-up whose budget is the import of torch, and it would
rename every flag (``--recipe.lr-per-8``) or need its own annotations to keep today's names, boxed
help and errors; the 40 lines below give one definition per option with the help users read today.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, fields
from typing import ClassVar

from shards.base.commands import HelpFormatter, count_or_share, int_in_range, number_in_range, positive_int
from shards.base.errors import UsageError

from .errors import OutOfRange

VERSION = 1  # of the config as a checkpoint stores it; 0: the flat ``args`` dict of older checkpoints

BACKENDS = ("horovod", "torch", "none")
AMP = ("auto", "bf16", "fp16", "off")
# train: every BN layer learns; partial: TSM's partial BN, all but the first frozen (for
# fine-tuning on small datasets such as UCF101); frozen: all use their running statistics
BN_MODES = ("train", "partial", "frozen")
OPTIMIZERS = ("sgd", "adam", "adamw")
COMPILE_MODES = ("auto", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
MULTIGRID = ("off", "long", "short", "both")
SHUFFLES = ("auto", "global", "node")
STORED_CLIPS = ("each", "rotate")  # the loader's (trainer.data.rotation)
GROWTH = ("off", "points", "decay", "noise")  # trainer.schedules.batch_growth's modes, or none
DEPTHS = (10, 18, 34, 50, 101, 152)
# the networks (trainer.model): TSM, its 2D baseline TSN (the same without the shift: --no-shift), and
# the 3D baselines of the paper's comparison, I3D ResNets inflating a bottleneck's 3x3 or first 1x1
# convolution (trainer/model/i3d.py), which only the bottleneck depths have
ARCHS = ("tsm", "tsn", "i3d-3x3x3", "i3d-3x1x1")
BOTTLENECK_DEPTHS = (50, 101, 152)
# what a clip's frames are to the network, and its input channels per frame: RGB pixels, or the
# motion field stored beside each frame (``ingest build --motion``; u and v, trainer.data.motion)
CHANNELS = {"rgb": 3, "motion": 2}
MODALITIES = tuple(CHANNELS)
# RGB clips are normalised with ImageNet's statistics (of pixels scaled to [0, 1]), as TSM's weights
# expect: the model does it on the device (trainer.model.tsm); library users with trainer.data.normalise
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def architecture(arch: str | None, shift: bool | None = None) -> str:
    """The network ``arch`` (``--arch``) and ``shift`` (False: ``--no-shift``) name together. ``--no-shift``
    removes TSM's temporal shift: alone it makes TSN (as before ``--arch``, and in checkpoints written
    then, which name their network by ``shift`` alone); with ``--arch tsn`` or an I3D, which have no
    shift, it changes nothing; with ``--arch tsm`` it contradicts it (ValueError)."""
    if arch is None:
        return "tsn" if shift is False else "tsm"
    if arch not in ARCHS:
        raise ValueError(f"--arch {arch}: not one of {', '.join(ARCHS)}")
    if shift is False and arch == "tsm":
        raise ValueError("--no-shift removes TSM's temporal shift: not with --arch tsm (TSM without it is "
                         "--arch tsn)")
    return arch


def flag(default=dataclasses.MISSING, help: str | None = None, *, spelling: str | None = None,
         **argparse_options):
    """A config field that is also a flag: ``--field-name`` unless ``spelling`` (``--no-flip``)."""
    return dataclasses.field(default=default, metadata={"help": help, "spelling": spelling,
                                                        "options": argparse_options})


def http_url(text: str) -> str:
    """An http:// or https:// URL with a host (``--push-gateway``)."""
    scheme, _, rest = text.partition("://")
    if scheme not in ("http", "https") or not rest.split("/")[0] or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// URL with a host "
                                         "(such as http://pushgateway:9091)")
    return text


NON_NEGATIVE = number_in_range(float, 0)
UNIT = number_in_range(float, 0, 1)


class Flags:
    """A concern's fields, each within its flag's range (checked as the config is made)."""

    def __post_init__(self):
        for f in fields(self):
            in_range = getattr(f.metadata["options"].get("type"), "in_range", None)
            value = getattr(self, f.name)
            if in_range is None or value is None:
                continue
            for v in value if isinstance(value, tuple) else (value,):
                try:
                    in_range(v)
                except ValueError as e:
                    raise OutOfRange(f"{f.metadata['spelling'] or '--' + f.name.replace('_', '-')}: "
                                     f"{e}") from None


@dataclass(frozen=True)
class Data(Flags):
    GROUP: ClassVar[str] = "data"
    data: str = flag(help="shard-set directory or manifest.json URL", required=True)
    train_split: str = flag("train", "split to train on")
    val_split: str = flag("val", "split validated on after every epoch; '' to skip validation")
    batch_size: int = flag(8, "clips per rank per step", type=positive_int)
    workers: int | None = flag(None, "loader worker processes per rank (default: the CPU cores each local "
                                     "rank has, less the one the rank runs on, at most 4)",
                               type=int_in_range(0))
    crop_size: int = flag(224, "side of the square training crops, in pixels", type=positive_int)
    scale_size: int = flag(256, "short side before cropping", type=positive_int)
    flip: bool = flag(True, "no horizontal flips (for classes that tell left from right)",
                      spelling="--no-flip")
    shuffle_buffer: int = flag(256, "clips each loader worker reorders at a time", type=int_in_range(0))
    cache_dir: str | None = flag(None, "node-local shard cache for remote shard sets, shared by the node's "
                                       "ranks (budget: $SHARD_CACHE_BUDGET, e.g. 500GB)")
    shuffle: str = flag("auto",
                        "global: one order of all shards for all ranks each epoch; node: node-affine epochs, "
                                "each node reads only the shards (or pieces) it owns for the run, reordered "
                                "every epoch, so a --cache-dir downloads each once per run (refused on a set "
                                "whose stored order would give nodes different classes); auto: global "
                                "(node-affine not shown to cost under 2 top-1 points: "
                                "docs/benchmarks/node-affine-equivalence.md)",
                         choices=SHUFFLES)
    stored_clips: str = flag("each",
                             "a set built with --clips-per-video K > 1: each: every stored clip is a sample "
                                     "of every epoch (an epoch is K views of each video, K times the steps); "
                                     "rotate: one of each video's K clips an epoch, the next one the next "
                                     "epoch (an epoch is one view of each video, each stored clip read once "
                                     "every K epochs; on the synthetic task of "
                                     "docs/benchmarks/presampling.md, not worse than resampling every epoch, "
                                     "where each was 9 top-1 points lower at equal steps)",
                             choices=STORED_CLIPS)
    lookahead: int = flag(2, "shards each loader worker fetches ahead through --cache-dir (or 32 MB ranges "
                             "it reads ahead from a remote set without one)", type=int_in_range(0))
    source_deadline: float | None = flag(
        None, "seconds a remote shard source (HTTP, the dataset service, an object store) may stay "
              "unreachable (refusing connections, timing out, answering 502/503/504) while the ranks wait "
              "for it, pausing; past it the run stops as on SIGTERM, its position saved, with exit status 75 "
              "for a --resume once the source is back (default: $SHARD_SOURCE_DEADLINE, else 600)",
        type=number_in_range(float, 0),
        metavar="SECONDS")
    direct_reads: str = flag("never",
                             "a set of the dataset service (--data http://HOST/v1/datasets/REF) whose "
                                      "files are visible here with the same manifest: read its shards from "
                                      "there (auto), never, or fail if not possible (always)",
                             choices=("auto", "never", "always"))
    decode_on_device: bool = flag(False,
                                  "decode JPEGs on the GPU with nvJPEG (needs torchvision): loader workers "
                                         "only read bytes and parse headers")
    modality: str = flag("rgb",
                         "what the network sees of each frame: its RGB pixels, or (two-stream's motion "
                                "stream) the motion field stored beside it by ingest build --motion mv|flow, "
                                "cropped, flipped and resized as the frame would be", choices=MODALITIES)
    max_bad_samples: str = flag("0", "bad samples (bytes that differ from the manifest's digests, members "
                                      "the format refuses, frames that do not decode) an epoch may go on "
                                      "without, in each split it reads: a count (3) or a share of the "
                                      "split's clips (0.1%%); each is left out on its rank (a repeat of a "
                                      "good clip that weighs nothing takes its place), logged once, counted "
                                      "in metrics.jsonl and listed in OUTPUT_DIR/bad-samples.jsonl; one "
                                      "more, or the first with 0, stops the run",
                                type=count_or_share, metavar="N|P%")

    def __post_init__(self):
        super().__post_init__()
        if self.val_split and self.scale_size < self.crop_size:  # the loader's ValueError, as the flags
            raise OutOfRange(f"--scale-size {self.scale_size}: smaller than --crop-size {self.crop_size} "
                             "(validation scales the short side to --scale-size, then cuts the centre "
                             f"crop): give --scale-size {self.crop_size} or more, or --val-split '' to train "
                             "without validation")


@dataclass(frozen=True)
class Model(Flags):
    GROUP: ClassVar[str] = "model"
    segments: int | None = flag(None, "frames per clip (T) (default: the shard set's, from its manifest)",
                                type=positive_int)
    arch: str | None = flag(None, "the network: tsm (default), tsn (the same without the shift: --no-shift), "
                                  "or the 3D baselines i3d-3x3x3 and i3d-3x1x1 (trainer/model/i3d.py; "
                                  "--depth 50, 101 or 152)",
                            choices=ARCHS)
    depth: int = flag(50, "ResNet depth", choices=DEPTHS)
    width: int = flag(64, "ResNet base width (64 standard)", type=positive_int)
    shift: bool = flag(True, "no temporal shift: TSN (--arch tsn); nothing to remove from TSN or an I3D; "
                             "refused with --arch tsm", spelling="--no-shift")
    shift_div: int = flag(8, "shift 1/div of channels each way", type=int_in_range(2))
    dropout: float = flag(0.0, "before the head (0 for the large-batch recipe)", type=UNIT)
    pretrained: str | None = flag(None, "torchvision-format ResNet state dict, or a checkpoint.pt of trainer "
                                        "train, to start the backbone from (RGB weights for --modality "
                                        "motion: the first layer averaged over its channels, TSN's "
                                        "cross-modality initialisation)")
    bn: str = flag("train",
                   "partial: freeze every BN layer but the first (TSM's partial BN, for fine-tuning on small "
                            "datasets); frozen: freeze all, normalising with running statistics",
                   choices=BN_MODES)

    @property
    def network(self) -> str:
        """The network ``--arch`` and ``--no-shift`` name (``architecture``), refused in one line when they
        contradict each other (``--arch tsm --no-shift``) or an I3D is asked of a ResNet without
        bottlenecks."""
        try:
            arch = architecture(self.arch, self.shift)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if arch.startswith("i3d") and self.depth not in BOTTLENECK_DEPTHS:
            raise UsageError(f"--arch {arch} inflates bottleneck convolutions: --depth 50, 101 or 152, "
                             f"not {self.depth}")
        return arch


@dataclass(frozen=True)
class Recipe(Flags):
    GROUP: ClassVar[str] = "recipe"
    epochs: int = flag(100, "passes over the training split", type=positive_int)
    lr_per_8: float = flag(0.00125, "learning rate per 8 clips of global batch",
                           type=number_in_range(float, 0, above=True))
    warmup_epochs: float = flag(5.0, "epochs of linear warm-up of the learning rate from 0",
                                type=NON_NEGATIVE)
    optimizer: str = flag("sgd", "adam: weight decay as L2 in the gradient; adamw: decoupled; "
                                 "none decays BN or biases", choices=OPTIMIZERS)
    momentum: float = flag(0.9, "SGD's", type=UNIT)
    weight_decay: float = flag(1e-4, "on conv/linear weights only", type=NON_NEGATIVE)
    clip_grad_norm: float = flag(0.0, "max gradient norm (0: off)", type=NON_NEGATIVE)
    ema_decay: float = flag(0.0, "keep an exponential moving average of the weights with this decay per step "
                                 "(e.g. 0.9998), validated (ema_val_*) and checkpointed beside them "
                                 "(trainer/ema.py); 0: off")


@dataclass(frozen=True)
class System(Flags):
    GROUP: ClassVar[str] = "system"
    backend: str = flag("horovod",
                        "how ranks talk: horovod (horovodrun, mpirun, srun), torch (torchrun), none "
                                   "(one process)", choices=BACKENDS)
    fp16_allreduce: bool = flag(False, "compress gradients to fp16 for the allreduce")
    amp: str = flag("auto", "mixed precision; auto = bf16 on GPU, off on CPU", choices=AMP)
    channels_last: bool | None = flag(None, "NHWC activations (default: on GPU only)",
                                      action=argparse.BooleanOptionalAction)
    compile: str | None = flag(None, "torch.compile the training network, temporal shift inside the graph "
                                     "(mode: see trainer/model/compiling.py; reduce-overhead adds CUDA "
                                     "graphs); on CUDA also a fused SGD (default: off; the flag alone: auto)",
                               nargs="?", const="auto", choices=COMPILE_MODES)
    seed: int = flag(0, "seeds the weights, the clip order and the augmentations")
    output_dir: str = flag("out/train", "checkpoint, metrics.jsonl, tensorboard/")
    resume: bool = flag(False, "continue from OUTPUT_DIR/checkpoint.pt if present")
    overwrite: bool = flag(False,
                           "start afresh in an OUTPUT_DIR that holds an earlier run (its checkpoint, metrics "
                                  "and logs are deleted); without it or --resume such a directory is refused")
    checkpoint_steps: int = flag(0, "also checkpoint every N steps (0: only at epoch ends and stops); bounds "
                                    "what a SIGKILL, an OOM kill or a lost node costs to N steps",
                                 type=int_in_range(0))
    print_freq: int = flag(10, "steps between metric records", type=positive_int)
    clip_log: bool = flag(False, "log every trained clip's key, and the weights' digest, by step in "
                                 "OUTPUT_DIR/clips/ (trainer.clip_log): the audit that each epoch trained on "
                                 "every clip once")
    tensorboard: bool = flag(True, "no TensorBoard event files in OUTPUT_DIR/tensorboard/",
                             spelling="--no-tensorboard")
    push_gateway: str | None = flag(None,
                                    "push each rank's figures (clips/s, data wait, step time, bad samples, "
                                    "outage waits) to this Prometheus Pushgateway every --print-freq "
                                    "steps, at epoch ends and at the end (trainer/prometheus.py)",
                                    metavar="URL", type=http_url)


@dataclass(frozen=True)
class Schedules(Flags):
    GROUP: ClassVar[str] = "schedules (docs/schedules.md)"
    multigrid: str = flag("off", "multigrid batch shapes: the long cycle (T, S and B over each stage), the "
                                 "short cycle (crops over successive iterations), or both; "
                                 "runs the plan's 1.5x --epochs", choices=MULTIGRID)
    multigrid_stages: tuple[int, ...] | None = flag(
        None,
        "epochs of the baseline (--epochs) where the long cycle restarts (default: the reference config's "
              "learning-rate steps, 94, 154 and 196 of 239, scaled to --epochs)", nargs="+")
    batch_growth: str = flag("off", "double the batch at --growth-points epochs, in place of the rate's "
                                    "decay, or when the gradient noise scale exceeds the global batch (needs "
                                    "2+ ranks)", choices=GROWTH)
    growth_points: tuple[float, ...] = flag((), "epochs where the batch doubles", nargs="+")
    max_batch_size: int | None = flag(None, "clips per rank the batch grows to at most "
                                            "(default 8x --batch-size)", type=positive_int)
    average_every: int | None = flag(None, "K-step model averaging: each rank steps alone, ranks average "
                                           "every K steps (default: gradients averaged at every step "
                                           "by the backend)", type=positive_int)
    local_after_epochs: float = flag(0.0,
                                     "post-local averaging: synchronous for these first epochs, K-step after",
                                     type=NON_NEGATIVE)
    bn_group: int | None = flag(None, "clips per BN statistics group (0: the whole batch; default: "
                                      "--batch-size when the batch varies)", type=int_in_range(0))
    trace_steps: bool = flag(False,
                             "every rank writes each step's shape, batch, rate and a weight checksum to "
                                    "OUTPUT_DIR/steps-rank<R>.jsonl")
    precise_bn: int = flag(0, "before every validation, set BN statistics to those of N full-shape training "
                              "batches per rank (for multigrid, whose training shapes differ from "
                              "validation's); 0: off", metavar="N", type=int_in_range(0))


@dataclass(frozen=True)
class Elastic(Flags):
    GROUP: ClassVar[str] = "elastic"
    commit_every: int = flag(20,
                             "steps between in-memory commits, the most steps a failure costs (also at every "
                                 "epoch end)", type=positive_int)


@dataclass(frozen=True)
class Evaluation(Flags):
    """``trainer test``'s flags (one group, no title)."""
    GROUP: ClassVar[str | None] = None
    data: tuple[str, ...] = flag(help="shard-set directory or manifest.json URL; with --fuse, one for every "
                                      "run or one per run (runs trained on sets with different motion kinds)",
                                 required=True, nargs="+", metavar="SET")
    checkpoint: str | None = flag(None, "checkpoint.pt written by trainer train, or the run's --output-dir")
    ema: bool = flag(False,
                     "score the weight average a run trained with --ema-decay keeps (trainer/ema.py) instead "
                            "of its weights (with --fuse: every run's)")
    fuse: tuple[str, ...] | None = flag(None, "late fusion instead of --checkpoint (TSN's): score the split "
                                              "with each run's own network, crop and modality (a run's "
                                              "--output-dir or its checkpoint.pt) and average each video's "
                                              "softmax scores over the runs with --weights; every run must "
                                              "score the same videos and classes",
                                        nargs="+", metavar="RUN")
    weights: tuple[float, ...] | None = flag(None,
                                             "one per --fuse run, e.g. 1 1.5 (TSN's RGB and flow) (default: "
                                                   "equal)", nargs="+", metavar="W",
                                             type=number_in_range(float, 0))
    split: str = flag("val", "split to test on")
    crops: int = flag(1, "1: centre crop_size crop; 3: three full-height scale_size crops", choices=[1, 3])
    crop_size: int | None = flag(None, "default: the training run's", type=positive_int)
    scale_size: int | None = flag(None, "default: the training run's", type=positive_int)
    batch_size: int = flag(8, "clips per rank per step", type=positive_int)
    workers: int | None = flag(None, "loader worker processes per rank (default: the CPU cores each local "
                                     "rank has, less one, at most 4)", type=int_in_range(0))
    decode_on_device: bool = flag(False, "decode JPEGs on the GPU (needs torchvision)")
    backend: str = flag("horovod", "how ranks talk: horovod, torch (torchrun), none (one process)",
                        choices=BACKENDS)
    amp: str = flag("auto", "mixed precision; auto = bf16 on GPU, off on CPU", choices=AMP)
    output: str | None = flag(None, "write the summary and per-video predictions to this JSON file")

    @property
    def runs(self) -> tuple[str, ...]:
        """The runs scored: ``--checkpoint``'s, or the ``--fuse`` runs, each with a shard set of
        ``--data``; refused in one line (UsageError) otherwise."""
        if (self.checkpoint is None) == (self.fuse is None):
            raise UsageError("give either --checkpoint or --fuse RUN_A RUN_B")
        runs = self.fuse or (self.checkpoint,)
        if self.fuse is not None and len(runs) < 2:
            raise UsageError(f"--fuse: needs two runs or more, got {len(runs)}")
        if len(self.data) not in (1, len(runs)):
            raise UsageError(f"--data: one shard set for every run or one per run ({len(runs)}), got "
                             f"{len(self.data)}")
        return runs

    @property
    def fusion_weights(self) -> tuple[float, ...]:
        """Each run's weight in the fusion (``--weights``; default: equal), refused in one line
        unless there is one per ``--fuse`` run and they are not all zero."""
        runs = self.runs
        weights = self.weights or (1.0,) * len(runs)
        fits = self.fuse is not None and len(weights) == len(runs) and sum(weights) > 0
        if self.weights is not None and not fits:
            raise UsageError(f"--weights: one per --fuse run ({len(runs) if self.fuse else 0}), not all "
                             f"zero; got {' '.join(map(str, weights))}")
        return weights


@dataclass(frozen=True)
class TrainConfig:
    """One training run: what it reads, the network, the recipe, where and how it runs, its schedules."""
    data: Data
    model: Model = Model()
    recipe: Recipe = Recipe()
    system: System = System()
    schedules: Schedules = Schedules()

    def to_dict(self) -> dict:
        """Plain data for a checkpoint: ``{"version": VERSION, "data": {...}, "model": {...}, ...}``."""
        return {"version": VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, state: dict) -> "TrainConfig":
        """``to_dict``'s output, or (version 0) an older checkpoint's flat ``args``; fields a version
        did not have take their defaults."""
        nested = state.get("version", 0) >= 1
        return cls(**{f.name: _build(CONCERNS[f.name], state[f.name] if nested else state)
                      for f in fields(cls)})

    def replace(self, **concerns) -> "TrainConfig":
        return dataclasses.replace(self, **concerns)


CONCERNS = {"data": Data, "model": Model, "recipe": Recipe, "system": System, "schedules": Schedules}


def _build(cls, values: dict):
    """``cls`` from the values it has fields for (argparse's lists as tuples)."""
    out = {}
    for f in fields(cls):
        if f.name in values:
            value = values[f.name]
            out[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**out)


def _add_group(p: argparse.ArgumentParser, cls) -> None:
    group = p.add_argument_group(cls.GROUP) if cls.GROUP else p
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        meta, options = f.metadata, dict(f.metadata["options"])
        kind = hints[f.name]
        if meta["spelling"]:  # a --no- flag: stores False into the field
            group.add_argument(meta["spelling"], dest=f.name, action="store_false", help=meta["help"])
            continue
        if f.default is not dataclasses.MISSING:
            options.setdefault("default", list(f.default) if isinstance(f.default, tuple) else f.default)
        if kind is bool and "action" not in options:
            options["action"] = "store_true"
        elif "action" not in options:
            base = [a for a in typing.get_args(kind) if a is not type(None)] or [kind]
            base = base[0]
            if typing.get_origin(base) is tuple:
                base = typing.get_args(base)[0]
            options.setdefault("type", base)
        group.add_argument("--" + f.name.replace("_", "-"), help=meta["help"], **options)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    for cls in CONCERNS.values():
        _add_group(p, cls)


def add_elastic_arguments(p: argparse.ArgumentParser) -> None:
    add_train_arguments(p)
    _add_group(p, Elastic)


def add_evaluation_arguments(p: argparse.ArgumentParser) -> None:
    _add_group(p, Evaluation)


def add_plot_arguments(p: argparse.ArgumentParser) -> None:
    """``trainer plot``'s (a reader of finished runs: no config object below its entry point)."""
    p.add_argument("runs", nargs="+", help="output directories of trainer train (or their metrics.jsonl)")
    p.add_argument("--labels", nargs="+", help="legend labels, one per run (default: directory names)")
    p.add_argument("--out", default="curves.png", help="PNG to write")


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The parsed flags of ``trainer train`` (or ``elastic``) as a config, whose network they name
    (``Model.network``: ``--arch`` against ``--no-shift`` or ``--depth``) refused here in one line."""
    cfg = TrainConfig.from_dict(vars(args))
    cfg.model.network  # the property refuses (UsageError) what names no network
    return cfg


def elastic_config(args: argparse.Namespace) -> Elastic:
    return _build(Elastic, vars(args))


def evaluation_config(args: argparse.Namespace) -> Evaluation:
    """The parsed flags of ``trainer test`` as its config, the runs and weights they give refused here
    in one line when they do not fit together (``Evaluation.fusion_weights``)."""
    ev = _build(Evaluation, vars(args))
    ev.fusion_weights  # checks the runs too
    return ev


def parser(add=add_train_arguments, description: str | None = None) -> argparse.ArgumentParser:
    """A stand-alone parser (benchmarks take a trainer command line this way)."""
    p = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    add(p)
    return p


def of_checkpoint(state: dict) -> TrainConfig:
    """The config a checkpoint was written under: its ``config``, or its flat ``args`` (version 0)."""
    return TrainConfig.from_dict(state["config"] if "config" in state else state["args"])
