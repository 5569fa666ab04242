"""Train TSM (or TSN with --no-shift) on a shard set, on one process or many (Horovod by default).

The defaults are the recipe of "Training Kinetics in 15 Minutes" (Lin, Gan and Han, 2019) for a
TSM ResNet-50 on 8-frame clips: SGD momentum 0.9, 0.00125 learning rate per 8 clips of
global batch, 5 warm-up epochs, cosine decay to zero, weight decay 1e-4 on weights only,
no dropout. Every epoch ends with single-clip centre-crop validation and a checkpoint;
SIGTERM or SIGINT stops every rank at the same step and checkpoints first, and --resume
continues from that checkpoint as if nothing had happened.
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

from . import checkpoint, compiling, distributed, metrics, recipe, regime
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
    r.add_argument("--print-freq", type=int, default=10, help="steps between metric records")
    r.add_argument("--no-tensorboard", dest="tensorboard", action="store_false")
    regime.add_arguments(p)


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(p)
    return p


class StopFlag:
    """Set by SIGTERM/SIGINT; a second signal interrupts at once."""

    def __init__(self):
        self.signum = 0
        self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame):
        if self.signum:
            raise KeyboardInterrupt
        self.signum = signum

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


class Trainer:
    """A run: backend, loaders, engine (model, optimizer, schedule), position, metrics log."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.backend = distributed.init(args.backend)
        self.rank0 = self.backend.rank == 0
        torch.manual_seed(args.seed + self.backend.rank)
        manifest = shared_manifest(args.data, self.backend.rank, lambda obj, root: self.backend.broadcast_object(obj))
        samples = manifest.splits[args.train_split].num_samples
        self.regime = regime.Regime(args, self.backend.size, samples)
        self.train_loader = self._loader(manifest, args.train_split, train=True)
        self.val_loader = self._loader(manifest, args.val_split, train=False) if args.val_split else None
        self.engine = Engine(args, self.regime.backend(self.backend), len(manifest.classes), samples,
                             epochs=self.regime.epochs, bn_group=self.regime.bn_group)
        self.regime.attach(self.engine)
        self.trace = regime.StepTrace(args.output_dir, self.backend.rank, args.trace_steps)
        self.clips = clip_source(args.decode_on_device, self.engine.device)
        self.epoch, self.batch, self.step = 0, 0, 0
        self._resume()
        self.backend.broadcast_state(self.engine.model, self.engine.optimizer)
        self.log = metrics.MetricsLog(args.output_dir, enabled=self.rank0, tensorboard=args.tensorboard)

    def _loader(self, manifest, split: str, train: bool) -> ClipLoader:
        a = self.args
        return ClipLoader(manifest, split, batch_size=a.batch_size, rank=self.backend.rank,
                          world_size=self.backend.size, train=train, seed=a.seed, num_workers=a.workers,
                          crop_size=a.crop_size, scale_size=a.scale_size, flip=train and a.flip,
                          shuffle_buffer=a.shuffle_buffer, remainder="pad", cache_dir=a.cache_dir,
                          decode_on_device=a.decode_on_device, shapes=self.regime.shapes)

    @property
    def checkpoint_url(self) -> str:
        return os.path.join(self.args.output_dir, checkpoint.NAME)

    def _resume(self) -> None:
        """Rank 0 reads the checkpoint; model and optimizer state reach the others by broadcast."""
        e = self.engine
        state = checkpoint.load(self.checkpoint_url) if self.args.resume and self.rank0 else None
        if state is not None:
            e.model.load_state_dict(state["model"])
            e.optimizer.load_state_dict(state["optimizer"])
        small = None if state is None else {k: state[k] for k in
                                            ("clips_seen", "scaler", "loader", "epoch", "batch", "step", "rng")}
        if state is not None:
            small["regime"] = state.get("regime")
        small = self.backend.broadcast_object(small)
        if small is None:
            return
        e.seek(small["clips_seen"])
        e.scaler.load_state_dict(small["scaler"])
        self.regime.load_state_dict(small["regime"], self.train_loader)
        self.train_loader.load_state_dict(small["loader"])
        self.epoch, self.batch, self.step = small["epoch"], small["batch"], small["step"]
        if len(small["rng"]) == self.backend.size:
            checkpoint.set_rng_state(small["rng"][self.backend.rank])
        else:
            log.warning("resuming on %d ranks from %d: fresh random streams", self.backend.size, len(small["rng"]))
        if self.rank0:
            log.info("resumed from %s at epoch %d, batch %d (step %d, %d clips seen)", self.checkpoint_url,
                     self.epoch, self.batch, self.step, e.clips_seen)

    def save(self) -> None:
        self.regime.settle()  # K-step averaging: rank 0's model is every rank's
        rng = self.backend.all_gather_object(checkpoint.rng_state())
        if self.rank0:
            checkpoint.save(self.checkpoint_url, {
                **self.engine.state_dict(), "regime": self.regime.state_dict(),
                "loader": self.train_loader.state_dict(), "epoch": self.epoch,
                "batch": self.batch, "step": self.step, "rng": rng, "model_config": asdict(self.engine.config),
                "classes": list(self.train_loader.classes), "args": vars(self.args)})

    def agreed_stop(self, stop: StopFlag) -> bool:
        """True on every rank as soon as any rank has been signalled, so all stop at the same step."""
        if self.backend.size == 1:
            return bool(stop.signum)
        return self.backend.all_sum(torch.tensor([float(stop.signum > 0)])).item() > 0

    def mean_over_ranks(self, values: list[float]) -> list[float]:
        return (self.backend.all_sum(torch.tensor(values, dtype=torch.float64)) / self.backend.size).tolist()


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


def train_one_epoch(t: Trainer, stop: StopFlag) -> tuple[bool, dict]:
    """Train to the end of the epoch or until a signal reaches every rank.

    Returns (whether the epoch completed, epoch averages).
    """
    args, loader, e = t.args, t.train_loader, t.engine
    loader.set_epoch(t.epoch)
    t.engine.model.train()
    loss_avg, data_avg, compute_avg = metrics.Average(), metrics.Average(), metrics.Average()
    window = [metrics.Average() for _ in range(4)]
    clips_before = e.clips_seen
    bar = tqdm(total=t.batch + len(loader), initial=t.batch, desc=f"epoch {t.epoch}", unit="step",
               disable=not t.rank0, dynamic_ncols=True, leave=False)
    completed = True
    epoch_start = tick = time.perf_counter()
    # one batch per optimizer step: a multigrid loader batch holds several (t.batch counts loader batches)
    for batch in t.regime.batches(loader, isolated, t.step):
        clips = t.clips(batch)  # with --decode-on-device the GPU decode counts as data time
        e.seek(e.clips_seen, t.regime.lr_factor(t.step))
        lr, step_clips = e.lr, clips.shape[0] * t.backend.size
        started = time.perf_counter()
        loss = e.train_step(clips, batch["labels"], batch["global_valid"]).item()  # .item() waits for the GPU
        done = time.perf_counter()
        data_time, compute_time = started - tick, done - started
        for avg, value in zip(window, (loss, data_time, compute_time, step_clips)):
            avg.update(value)
        loss_avg.update(loss)
        data_avg.update(data_time)
        compute_avg.update(compute_time)
        t.trace.log(t.step, t.epoch, clips, lr, e.model, loss=loss, drifted=t.regime.drifted)
        t.batch += batch["period_end"]
        t.step += 1
        t.regime.after_step()
        bar.update(batch["period_end"])
        bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", clips_s=f"{step_clips / (done - tick):.1f}",
                        data_ms=f"{1e3 * data_time:.0f}", compute_ms=f"{1e3 * compute_time:.0f}", refresh=False)
        if t.step % args.print_freq == 0:
            w_loss, w_data, w_compute, w_clips = t.mean_over_ranks([a.avg for a in window])
            t.log.log("train", t.step, epoch=t.epoch, clips=e.clips_seen, loss=w_loss, lr=lr,
                      clips_per_s=w_clips / (w_data + w_compute), data_time=w_data, compute_time=w_compute)
            window = [metrics.Average() for _ in range(4)]
        tick = time.perf_counter()
        # a run stops only where the loader's position and every rank's model say where it is
        if batch["period_end"] and not t.regime.drifted and t.agreed_stop(stop):
            completed = False
            break
    bar.close()
    elapsed = time.perf_counter() - epoch_start
    train_loss, = t.mean_over_ranks([loss_avg.avg])
    return completed, {"train_loss": train_loss, "epoch_time": elapsed, "data_time": data_avg.avg,
                       "compute_time": compute_avg.avg,
                       "clips_per_s": (e.clips_seen - clips_before) / max(elapsed, 1e-9),
                       "synchronisations": t.regime.synchronisations(t.step)}


@torch.no_grad()
def evaluate(t: Trainer) -> dict:
    """Single-clip centre-crop loss, top-1 and top-5 on the validation split; padding never counts."""
    e = t.engine
    e.backend.average_buffers(e.model)  # ranks saw different batches (or models): agree on BN statistics first
    e.model.eval()
    sums = torch.zeros(4, dtype=torch.float64)  # samples, loss, top-1, top-5
    for batch in isolated(t.val_loader):
        logits = e.scores(t.clips(batch)).cpu()
        labels = batch["labels"]
        valid = batch["valid"] & (labels >= 0)
        loss = F.cross_entropy(logits, labels.clamp(min=0), reduction="none")
        top1, top5 = metrics.topk_correct(logits, labels, (1, 5), valid)
        sums += torch.stack([valid.sum(), (loss * valid).sum(), top1, top5]).double()
    n, loss, top1, top5 = t.backend.all_sum(sums).tolist()
    n = max(n, 1)
    return {"val_loss": loss / n, "val_top1": 100 * top1 / n, "val_top5": 100 * top5 / n, "val_samples": n}


def main(args: argparse.Namespace) -> int:
    t = Trainer(args)
    if t.rank0:
        log.info("%s", t.engine.describe())
        if t.regime.describe():
            log.info("%s", t.regime.describe())
        log.info("arguments: %s", json.dumps(vars(args), sort_keys=True))
    stop = StopFlag()
    try:
        while t.epoch < t.regime.epochs:
            completed, summary = train_one_epoch(t, stop)
            if not completed:
                t.save()
                if t.rank0:
                    log.info("stopped by a signal at epoch %d, batch %d: checkpoint saved", t.epoch, t.batch)
                return 128 + (stop.signum or signal.SIGTERM)
            if t.val_loader is not None:
                summary.update(evaluate(t))
            t.epoch, t.batch = t.epoch + 1, 0
            t.save()
            t.log.log("epoch", t.step, epoch=t.epoch, clips=t.engine.clips_seen, lr=t.engine.lr, **summary)
            if t.rank0:
                log.info("epoch %d/%d: %s", t.epoch, t.regime.epochs,
                         ", ".join(f"{k} {v:.4g}" for k, v in summary.items()))
            if t.agreed_stop(stop):
                return 128 + (stop.signum or signal.SIGTERM)
        return 0
    finally:
        stop.restore()
        t.log.close()
        t.trace.close()
        t.backend.shutdown()


def run(args: argparse.Namespace) -> int:
    return main(args)
