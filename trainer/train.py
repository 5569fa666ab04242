"""Train TSM (or TSN with --no-shift) on a shard set, on one process or many (Horovod by default).

The defaults are the recipe of "Training Kinetics in 15 Minutes" (Lin, Gan and Han, 2019) for a
TSM ResNet-50 on 8-frame clips: SGD momentum 0.9, 0.00125 learning rate per 8 clips of
global batch, 5 warm-up epochs, cosine decay to zero, weight decay 1e-4 on weights only,
no dropout; the learning rate follows the clips seen, not the steps (``recipe.Schedule``).
Every epoch ends with single-clip centre-crop validation and a checkpoint.

Stopping (docs/faults.md): SIGTERM or SIGINT to any process of the job (one rank, every rank,
the loader workers: they ignore it and leave it to their rank) stops every rank after the same
step, or abandons validation; rank 0 writes the checkpoint, every rank waits for it and exits
with 128 + the signal (143 for SIGTERM, 130 for SIGINT). A second SIGINT interrupts at once.
``--resume`` continues from that checkpoint as if nothing had happened: stopped after an
epoch's last step, it validates that epoch and goes on with the next.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F
from tqdm import tqdm

from shards.direct import load_manifest
from shards.manifest import Manifest

from . import checkpoint, compiling, distributed, metrics, precise_bn, recipe, regime
from .clip_log import ClipLog
from .device_decode import clip_source
from .engine import Engine
from .loader import ClipLoader, shared_manifest
from .model import BN_MODES

log = logging.getLogger("trainer.train")


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("data")
    d.add_argument("--data", required=True, help="shard-set directory or manifest.json URL")
    d.add_argument("--train-split", default="train")
    d.add_argument("--val-split", default="val", help="'' to skip validation")
    d.add_argument("--batch-size", type=int, default=8, help="clips per rank per step")
    d.add_argument("--workers", type=int, default=4, help="loader worker processes per rank")
    d.add_argument("--crop-size", type=int, default=224)
    d.add_argument("--scale-size", type=int, default=256, help="short side before cropping")
    d.add_argument("--no-flip", dest="flip", action="store_false",
                   help="no horizontal flips (for classes that tell left from right)")
    d.add_argument("--shuffle-buffer", type=int, default=256)
    d.add_argument("--cache-dir", help="local shard cache for remote shard sets")
    d.add_argument("--direct-reads", choices=("auto", "never", "always"), default="never",
                   help="a set of the dataset service (--data http://HOST/v1/datasets/REF) whose files are visible "
                        "here with the same manifest: read its shards from there (auto), never, or fail if not "
                        "possible (always)")
    d.add_argument("--decode-on-device", action="store_true",
                   help="decode JPEGs on the GPU with nvJPEG (needs torchvision): loader workers only read "
                        "bytes and parse headers")
    m = p.add_argument_group("model")
    m.add_argument("--segments", type=int, default=8, help="frames per clip (T)")
    m.add_argument("--depth", type=int, default=50, help="ResNet depth: 10, 18, 34, 50, 101, 152")
    m.add_argument("--width", type=int, default=64, help="ResNet base width (64 standard)")
    m.add_argument("--no-shift", dest="shift", action="store_false", help="TSN: no temporal shift")
    m.add_argument("--shift-div", type=int, default=8, help="shift 1/div of channels each way")
    m.add_argument("--dropout", type=float, default=0.0, help="before the head (0 for the large-batch recipe)")
    m.add_argument("--pretrained", help="torchvision-format ResNet state dict to start from")
    m.add_argument("--bn", choices=BN_MODES, default="train",
                   help="partial: freeze every BN layer but the first (TSM's partial BN, for fine-tuning "
                        "on small datasets); frozen: freeze all, normalising with running statistics")
    o = p.add_argument_group("recipe")
    o.add_argument("--epochs", type=int, default=100)
    o.add_argument("--lr-per-8", type=float, default=0.00125, help="learning rate per 8 clips of global batch")
    o.add_argument("--warmup-epochs", type=float, default=5.0)
    o.add_argument("--optimizer", choices=recipe.OPTIMIZERS, default="sgd",
                   help="adam: weight decay as L2 in the gradient; adamw: decoupled; none decays BN or biases")
    o.add_argument("--momentum", type=float, default=0.9, help="SGD's")
    o.add_argument("--weight-decay", type=float, default=1e-4, help="on conv/linear weights only")
    o.add_argument("--clip-grad-norm", type=float, default=0.0, help="max gradient norm (0: off)")
    r = p.add_argument_group("system")
    r.add_argument("--backend", choices=["horovod", "torch", "none"], default="horovod")
    r.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to fp16 for the allreduce")
    r.add_argument("--amp", choices=["auto", "bf16", "fp16", "off"], default="auto",
                   help="mixed precision; auto = bf16 on GPU, off on CPU")
    r.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                   help="NHWC activations (default: on GPU only)")
    r.add_argument("--compile", nargs="?", const="auto", choices=compiling.MODES,
                   help="torch.compile the training network, temporal shift inside the graph (mode: see "
                        "trainer/compiling.py; reduce-overhead adds CUDA graphs); on CUDA also a fused SGD")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--output-dir", default="out/train", help="checkpoint, metrics.jsonl, tensorboard/")
    r.add_argument("--resume", action="store_true", help="continue from OUTPUT_DIR/checkpoint.pt if present")
    r.add_argument("--checkpoint-steps", type=int, default=0,
                   help="also checkpoint every N steps (0: only at epoch ends and stops); bounds what a "
                        "SIGKILL, an OOM kill or a lost node costs to N steps")
    r.add_argument("--print-freq", type=int, default=10, help="steps between metric records")
    r.add_argument("--clip-log", action="store_true",
                   help="log every trained clip's key, and the weights' digest, by step in OUTPUT_DIR/clips/ "
                        "(trainer.clip_log): the audit that each epoch trained on every clip once")
    r.add_argument("--no-tensorboard", dest="tensorboard", action="store_false")
    regime.add_arguments(p)
    precise_bn.add_arguments(p)


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(p)
    return p


class StopFlag:
    """Records SIGTERM or SIGINT for the training loop to act on at the next step boundary.

    Repeated SIGTERMs are one request (Slurm signals every process of a job, horovodrun then
    signals its ranks again); a SIGINT after any stop signal interrupts at once (Ctrl-C twice).
    """

    def __init__(self):
        self.signum = 0
        self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame):
        if self.signum and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = self.signum or signum

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


# what every rank takes from a checkpoint besides weights and optimizer (older checkpoints have no "regime")
RESUMED = ("epoch", "batch", "step", "clips_seen", "scaler", "loader", "epoch_totals", "rng", "regime")


class Trainer:
    """A run: backend, loaders, engine (model, optimizer, schedule), position, metrics log."""

    def __init__(self, args: argparse.Namespace, elastic: bool = False):
        """``elastic``: no collective here, since a rank joining a running Horovod Elastic job meets the
        others first in the elastic state's sync: every rank reads the manifest, and ``start`` is
        left to ``trainer.elastic``."""
        self.args = args
        self.backend = distributed.init(args.backend)
        self.rank0 = self.backend.rank == 0
        torch.manual_seed(args.seed + self.backend.rank)
        manifest = load_manifest(args.data, args.direct_reads) if elastic else shared_manifest(
            args.data, self.backend.rank, lambda obj, root: self.backend.broadcast_object(obj), args.direct_reads)
        check_splits(manifest, args)
        samples = manifest.splits[args.train_split].num_samples
        self.regime = regime.Regime(args, self.backend.size, samples, elastic)
        self.make_loaders(manifest)
        self.engine = Engine(args, self.regime.backend(self.backend), len(manifest.classes), samples,
                             epochs=self.regime.epochs, bn_group=self.regime.bn_group)
        self.regime.attach(self.engine)
        self.trace = regime.StepTrace(args.output_dir, self.backend.rank, args.trace_steps)
        self.clips = clip_source(args.decode_on_device, self.engine.device)
        if args.clip_log and not elastic:  # trainer.elastic's log adds the ring's generation
            self.clips = ClipLog(self, self.clips)
        self.epoch, self.batch, self.step = 0, 0, 0
        self.saved_step = 0  # the step of the last checkpoint this process wrote or started from
        self.epoch_totals = metrics.StepTotals()  # of the current epoch's training, over a resume too
        self.epoch_cpu = 0.0  # CPU seconds this process (and its loader workers) spent on the epoch's training
        self.log = metrics.MetricsLog(None)  # nothing logged before start
        if not elastic:
            self.start()

    def make_loaders(self, manifest: Manifest) -> None:
        """The training and validation loaders of this rank in this world size."""
        a = self.args
        self.train_loader = self.new_loader(manifest, a.train_split, train=True)
        self.val_loader = self.new_loader(manifest, a.val_split, train=False) if a.val_split else None

    def new_loader(self, manifest: Manifest, split: str, train: bool, full_shape: bool = False) -> ClipLoader:
        """A loader of this rank's share of ``split`` in this world size, with the run's flags; its
        batches have the regime's shapes unless ``full_shape``."""
        a = self.args
        return ClipLoader(manifest, split, batch_size=a.batch_size, rank=self.backend.rank,
                          world_size=self.backend.size, train=train, seed=a.seed, num_workers=a.workers,
                          crop_size=a.crop_size, scale_size=a.scale_size, flip=train and a.flip,
                          shuffle_buffer=a.shuffle_buffer, remainder="pad", cache_dir=a.cache_dir,
                          decode_on_device=a.decode_on_device,
                          shapes=None if full_shape else self.regime.shapes)

    def start(self) -> None:
        """Every rank at rank 0's place (the checkpoint's with --resume, else rank 0's initial
        weights), and rank 0's metrics log opened there."""
        self._resume()
        self.backend.broadcast_state(self.engine.model, self.engine.optimizer)
        # records past the checkpoint's step came from a run killed after it: those steps are trained again
        self.open_log(after_step=self.step if self.args.resume else None)

    def open_log(self, after_step: int | None = None) -> None:
        """The metrics log, written by rank 0 (``after_step``: ``metrics.MetricsLog``'s)."""
        a = self.args
        self.log.close()
        self.log = metrics.MetricsLog(a.output_dir, enabled=self.rank0, tensorboard=a.tensorboard,
                                      after_step=after_step)

    @property
    def checkpoint_url(self) -> str:
        return os.path.join(self.args.output_dir, checkpoint.NAME)

    def _resume(self) -> None:
        """Rank 0 reads and checks the checkpoint; the weights and optimizer reach the others in
        ``start``'s broadcast, the rest of it (or the refusal) here."""
        e = self.engine
        state = checkpoint.load(self.checkpoint_url) if self.args.resume and self.rank0 else None
        refused = state is not None and checkpoint.differences(
            state, asdict(e.config), self.args.bn, self.train_loader.manifest.fingerprint, self.args.train_split)
        if state is not None and not refused:
            e.model.load_state_dict(state["model"])
            e.optimizer.load_state_dict(state["optimizer"])
        small = None
        if state is not None:
            small = {"refused": refused, **({} if refused else {k: state.get(k) for k in RESUMED})}
        small = self.backend.broadcast_object(small)
        if small is None:
            return
        if small["refused"]:
            raise SystemExit(f"--resume refused: {self.checkpoint_url} is another run's: {'; '.join(small['refused'])}")
        self.regime.load_state_dict(small["regime"], self.train_loader)
        self.load_position(small)
        self.saved_step = self.step
        if len(small["rng"]) == self.backend.size:
            checkpoint.set_rng_state(small["rng"][self.backend.rank])
        else:
            log.warning("resuming on %d ranks from %d: fresh random streams", self.backend.size, len(small["rng"]))
        if self.rank0:
            log.info("resumed from %s at epoch %d, batch %d (step %d, %d clips seen)", self.checkpoint_url,
                     self.epoch, self.batch, self.step, e.clips_seen)

    def position(self) -> dict:
        """Where the run stands, besides weights, optimizer and the epoch's sums."""
        e = self.engine
        return {"epoch": self.epoch, "batch": self.batch, "step": self.step, "clips_seen": e.clips_seen,
                "scaler": e.scaler.state_dict(), "loader": self.train_loader.state_dict()}

    def load_position(self, state: dict) -> None:
        """Stand where ``state`` (a checkpoint's or an elastic commit's) says, its ``epoch_totals`` too."""
        e = self.engine
        self.epoch, self.batch, self.step = state["epoch"], state["batch"], state["step"]
        e.seek(state["clips_seen"])
        e.scaler.load_state_dict(state["scaler"])
        self.train_loader.load_state_dict(state["loader"])
        self.carry_totals(state["epoch_totals"])

    def carry_totals(self, values: dict) -> None:
        """Rank 0 goes on from the epoch's sums over every rank (``values``), the others from zero:
        their sum stays the epoch's."""
        self.epoch_totals = metrics.StepTotals(values if self.rank0 else None)

    def save(self) -> None:
        """Rank 0 writes the checkpoint; every rank returns once it is in place (a rank that
        exits earlier would make horovodrun end the others)."""
        rng = self.backend.all_gather_object(checkpoint.rng_state())
        totals = self.epoch_totals.reduce(self.backend.all_sum)
        if self.rank0:
            checkpoint.save(self.checkpoint_url, {
                "model": self.engine.model.state_dict(), "optimizer": self.engine.optimizer.state_dict(),
                **self.position(), "regime": self.regime.state_dict(), "rng": rng,
                "epoch_totals": totals.values, "model_config": asdict(self.engine.config),
                "classes": list(self.train_loader.classes), "args": vars(self.args)})
        self.saved_step = self.step
        self.backend.all_sum(torch.zeros(1))

    def agreed_stop(self, stop: StopFlag) -> int:
        """The stop signal (0: none) on every rank as soon as any rank has one, so all stop at the
        same step and exit alike; SIGTERM wins where ranks got different signals."""
        flags = torch.tensor([stop.signum == signal.SIGTERM, stop.signum == signal.SIGINT], dtype=torch.float32)
        term, interrupt = (self.backend.all_sum(flags) if self.backend.size > 1 else flags).tolist()
        return signal.SIGTERM if term else signal.SIGINT if interrupt else 0

    def close(self) -> None:
        self.log.close()
        self.trace.close()
        self.backend.shutdown()


def check_splits(manifest: Manifest, args: argparse.Namespace) -> None:
    """The splits the flags name are in the shard set, or the run ends in one line saying which."""
    for flag, split in (("--train-split", args.train_split), ("--val-split", args.val_split)):
        if split and split not in manifest.splits:
            raise SystemExit(f"{args.data}: no split {split!r} ({flag}); the set has {', '.join(manifest.splits)}"
                             + ("; --val-split '' trains without validation" if flag == "--val-split" else ""))


def isolated(batches):
    """Iterate without letting the iteration draw from the global torch RNG.

    PyTorch's DataLoader takes its workers' base seed from the global generator whenever an
    iterator starts, and a resumed run starts one at a different point of that stream: left
    alone, the dropout masks after a resume would differ from those of an unbroken run.
    """
    it = iter(batches)
    while True:
        with torch.random.fork_rng(devices=[]):
            batch = next(it, None)
        if batch is None:
            return
        yield batch


def train_step(t: Trainer, batch: dict, tick: float) -> dict:
    """One optimizer step on ``batch``, the previous one having ended at ``tick``; returns its
    loss and real clips on this rank, and its data, compute and wall time."""
    e = t.engine
    clips = t.clips(batch)  # with --decode-on-device the GPU decode counts as data time
    e.seek(e.clips_seen, t.regime.lr_factor(t.step))
    lr, seen = e.lr, e.clips_seen
    started = time.perf_counter()
    loss = e.train_step(clips, batch["labels"], batch["valid"], batch["global_valid"]).item()  # waits for the GPU
    done = time.perf_counter()
    t.trace.log(t.step, t.epoch, clips, lr, e.model, seen=seen, loss=loss, drifted=t.regime.drifted)
    t.batch += batch["period_end"]
    t.step += 1
    t.regime.after_step()
    if t.train_loader.epoch_finished and batch["period_end"]:
        # ranks saw different batches (K-step averaging: trained different models): agree before anything is saved
        e.backend.average_buffers(e.model)
    return {"loss": loss, "clips": int(batch["valid"].sum()), "data_time": started - tick,
            "compute_time": done - started, "wall_time": (done - tick) if t.rank0 else 0.0}


class Progress:
    """An epoch's progress bar (rank 0's) and its ``train`` records, the steps' totals over every
    rank every ``--print-freq`` steps."""

    def __init__(self, t: Trainer):
        self.t, self.window = t, metrics.StepTotals()
        self.bar = tqdm(total=t.batch + len(t.train_loader), initial=t.batch, desc=f"epoch {t.epoch}", unit="step",
                        disable=not t.rank0, dynamic_ncols=True, leave=False)

    def update(self, step: dict, batch: dict) -> None:
        t, e = self.t, self.t.engine
        self.window.add(**step)
        seconds = step["data_time"] + step["compute_time"]
        self.bar.update(batch["period_end"])
        self.bar.set_postfix(loss=f"{step['loss'] / max(step['clips'], 1):.3f}", lr=f"{e.lr:.2e}",
                             clips_s=f"{batch['global_valid'] / seconds:.1f}", data_ms=f"{1e3 * step['data_time']:.0f}",
                             compute_ms=f"{1e3 * step['compute_time']:.0f}", refresh=False)
        if t.step % t.args.print_freq == 0:
            w = self.window.reduce(t.backend.all_sum).summary()
            t.log.log("train", t.step, epoch=t.epoch, clips=e.clips_seen, loss=w["loss"], lr=e.lr,
                      clips_per_s=w["clips_per_s"], data_time=w["data_time"], compute_time=w["compute_time"])
            self.window = metrics.StepTotals()

    def close(self) -> None:
        self.bar.close()


def at_boundary(t: Trainer, stop: StopFlag, commit=None) -> int:
    """Where a run may stop (the end of a loader batch, one model on every rank): the periodic
    checkpoint when due, ``commit()``, then the signal every rank agrees on (0: none)."""
    every = t.args.checkpoint_steps
    if every and t.step // every > t.saved_step // every:
        t.save()
    if commit:
        commit()
    return t.agreed_stop(stop)


def train_one_epoch(t: Trainer, stop: StopFlag, commit=None) -> int:
    """Train to the end of the epoch or until a signal reaches every rank; returns the signal
    (0: the epoch's training is done). ``commit()`` after every step (Horovod Elastic's)."""
    loader = t.train_loader
    loader.set_epoch(t.epoch)
    if loader.epoch_finished:  # resumed after the epoch's last step: validation is what is left
        return 0
    t.engine.model.train()
    progress = Progress(t)
    signum = 0
    tick, cpu = time.perf_counter(), metrics.cpu_seconds()
    # one batch per optimizer step: a multigrid loader batch holds several (t.batch counts loader batches)
    for batch in t.regime.batches(loader, isolated, t.step):
        step = train_step(t, batch, tick)
        t.epoch_totals.add(**step)
        progress.update(step, batch)
        tick = time.perf_counter()
        # the loader's position counts whole loader batches; a checkpoint holds one model
        if batch["period_end"] and not t.regime.drifted:
            signum = at_boundary(t, stop, commit)
            if signum:
                break
    progress.close()
    t.epoch_cpu += metrics.cpu_seconds() - cpu  # (the loader's workers have ended with the epoch's iteration)
    return signum


@torch.no_grad()
def evaluate(t: Trainer, stop: StopFlag) -> dict | int:
    """Single-clip centre-crop loss, top-1 and top-5 on the validation split; padding never
    counts. Abandoned when a signal reaches every rank: then the signal is returned."""
    e = t.engine
    e.model.eval()
    sums = torch.zeros(4, dtype=torch.float64)  # samples, loss, top-1, top-5
    for batch in isolated(t.val_loader):
        logits = e.scores(t.clips(batch)).cpu()
        labels = batch["labels"]
        valid = batch["valid"] & (labels >= 0)
        loss = F.cross_entropy(logits, labels.clamp(min=0), reduction="none")
        top1, top5 = metrics.topk_correct(logits, labels, (1, 5), valid)
        sums += torch.stack([valid.sum(), (loss * valid).sum(), top1, top5]).double()
        signum = t.agreed_stop(stop)
        if signum:
            return signum
    n, loss, top1, top5 = t.backend.all_sum(sums).tolist()
    n = max(n, 1)
    return {"val_loss": loss / n, "val_top1": 100 * top1 / n, "val_top5": 100 * top5 / n, "val_samples": n}


def epoch_summary(t: Trainer) -> dict:
    """The epoch's training over every rank: loss, times, throughput, synchronisations, CPU seconds."""
    totals = t.epoch_totals.reduce(t.backend.all_sum).summary()
    return {"train_loss": totals["loss"], "epoch_time": totals["time"], "data_time": totals["data_time"],
            "compute_time": totals["compute_time"], "clips_per_s": totals["clips_per_s"],
            "synchronisations": t.regime.synchronisations(t.step),
            "allreduced_floats": t.regime.allreduced_floats(t.step),
            "cpu_time": t.backend.all_sum(torch.tensor([t.epoch_cpu], dtype=torch.float64)).item()}


def train(t: Trainer, stop: StopFlag, commit=None) -> int:
    """Epochs until the last, or until a signal reaches every rank: then the checkpoint is
    saved and the signal returned (0: finished). ``commit()`` after every step and epoch
    (Horovod Elastic's, see ``trainer.elastic``)."""
    while t.epoch < t.regime.epochs:
        signum = train_one_epoch(t, stop, commit)
        if not signum:
            summary = epoch_summary(t)
            if t.args.precise_bn:
                summary |= precise_bn.update(t)
            val = evaluate(t, stop) if t.val_loader is not None else {}
            signum = val if isinstance(val, int) else 0
        if signum:
            t.save()
            return signum
        t.epoch, t.batch, t.epoch_totals, t.epoch_cpu = t.epoch + 1, 0, metrics.StepTotals(), 0.0
        t.save()
        summary.update(val)
        t.log.log("epoch", t.step, epoch=t.epoch, clips=t.engine.clips_seen, lr=t.engine.lr, **summary)
        if t.rank0:
            log.info("epoch %d/%d: %s", t.epoch, t.regime.epochs, ", ".join(f"{k} {v:.4g}" for k, v in summary.items()))
        signum = at_boundary(t, stop, commit)
        if signum:
            return signum
    return 0


def main(args: argparse.Namespace, elastic=None) -> int:
    """``elastic(trainer, stop)``: Horovod Elastic's loop around ``train`` (``trainer.elastic``)."""
    stop = StopFlag()  # first: a signal during start-up stops the run after its first step
    t = None
    try:
        t = Trainer(args, elastic=elastic is not None)
        if t.rank0:
            log.info("%s", t.engine.describe())
            if t.regime.describe():
                log.info("%s", t.regime.describe())
            log.info("arguments: %s", json.dumps(vars(args), sort_keys=True))
        signum = (elastic or train)(t, stop)
        if signum and t.rank0:
            log.info("stopped by signal %d at epoch %d, batch %d (step %d, %d clips seen): checkpoint saved",
                     signum, t.epoch, t.batch, t.step, t.engine.clips_seen)
        return 128 + signum if signum else 0
    finally:
        stop.restore()
        if t is not None:
            t.close()


def run(args: argparse.Namespace) -> int:
    return main(args)
