"""One rank's training machinery: device, model, optimizer, schedule, mixed precision, the step.

Separate from the loop in ``train.py`` so that a step can be driven by any batches: the
Horovod test feeds fixed tensors to show that two ranks equal one.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from .config import Model, Recipe, System
from .distributed.backends import Backend
from .model import compiling
from .model.tsm import ModelConfig, build, load_pretrained
from .schedules.recipe import Schedule, build_optimizer, scaled_lr

log = logging.getLogger(__name__)

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# trainer.config.ARCHS
NAMES = {"tsm": "TSM", "tsn": "TSN", "i3d-3x3x3": "I3D 3x3x3", "i3d-3x1x1": "I3D 3x1x1"}


def pick_device(backend: Backend) -> torch.device:
    """The GPU of this rank's local rank when there is one, else the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(backend.local_rank)
        torch.backends.cudnn.benchmark = True
        return torch.device("cuda", backend.local_rank)
    return torch.device("cpu")


def amp_dtype(mode: str, device: torch.device) -> torch.dtype | None:
    """``auto`` is bf16 on GPU and full precision on CPU."""
    if mode == "auto":
        mode = "bf16" if device.type == "cuda" else "off"
    return AMP_DTYPES.get(mode)


def autocast(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


class Engine:
    """Builds the network and its optimizer for one rank from the model, recipe and system configs."""

    def __init__(self, backend: Backend, num_classes: int, epoch_clips: int, *, model: Model, recipe: Recipe,
                 system: System, batch_size: int, epochs: int | None = None, bn_group: int = 0,
                 modality: str = "rgb"):
        """``batch_size``: clips per rank per step; ``epochs``: the run's (default ``recipe.epochs``; a
        multigrid run's are its plan's); ``bn_group``: clips per BN statistics group in training (0: the
        whole batch); ``modality``: what the clips are (``trainer.config.CHANNELS``)."""
        self.backend, self.recipe, self.batch_size, self.bn_mode = backend, recipe, batch_size, model.bn
        self.device = pick_device(backend)
        self.amp = amp_dtype(system.amp, self.device)
        self.config = ModelConfig(num_classes=num_classes, segments=model.segments, depth=model.depth,
                                  width=model.width, arch=model.network, shift_div=model.shift_div,
                                  dropout=model.dropout, modality=modality)
        channels_last = self.device.type == "cuda" if system.channels_last is None else system.channels_last
        self.model = build(self.config, bn=model.bn, channels_last=channels_last, bn_group=bn_group)
        if model.pretrained and backend.rank == 0:
            load_pretrained(self.model, model.pretrained)
        self.model.to(self.device, memory_format=self.model.memory_format)
        self.global_batch = batch_size * backend.size
        peak_lr = scaled_lr(recipe.lr_per_8, self.global_batch)
        self.epochs = epochs or recipe.epochs
        total = self.epochs * epoch_clips
        self.schedule = Schedule(peak_lr, min(total, round(recipe.warmup_epochs * epoch_clips)), total)
        optimizer = build_optimizer(self.model, peak_lr, recipe.momentum, recipe.weight_decay,
                                    name=recipe.optimizer)
        self.fp16_allreduce = system.fp16_allreduce
        self.net, self.optimizer = backend.prepare(self.model, optimizer, system.fp16_allreduce)
        if system.compile:
            self.net = compiling.compile_network(self.net, self.optimizer, self.device, system.compile)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.amp == torch.float16)
        self.lr_factor = 1.0
        self.seek(0)

    def seek(self, clips_seen: int, lr_factor: float | None = None) -> None:
        """Stand at ``clips_seen`` real clips trained (global): the next step's rate is the schedule's
        there, times ``lr_factor`` (kept until changed) for a step whose batch is that many base batches."""
        self.clips_seen = clips_seen
        if lr_factor is not None:
            self.lr_factor = lr_factor
        self.schedule.apply(self.optimizer, clips_seen, self.lr_factor)

    def load_optimizer(self, state: dict) -> None:
        """A checkpoint's optimizer state (momentum buffers, moments, step counts) under this run's
        hyperparameters: the recipe's momentum and weight decay apply, not the ones saved with it."""
        own = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state)
        for group, hyper in zip(self.optimizer.param_groups, own):
            group.update(hyper)
            if group.get("momentum") == 0:
                # SGD without momentum neither reads nor keeps buffers; kept from the checkpoint, they would
                # be state the other ranks cannot match in Horovod's broadcast of it (a hang)
                for p in group["params"]:
                    self.optimizer.state.get(p, {}).pop("momentum_buffer", None)
        for p in [p for p, s in self.optimizer.state.items() if not s]:
            del self.optimizer.state[p]

    @property
    def peak_lr(self) -> float:
        return self.schedule.peak

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def train_step(self, clips: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor | None = None,
                   global_valid: int | None = None) -> torch.Tensor:
        """One optimizer step on this rank's share of the global batch; returns this rank's loss
        summed over its real clips.

        ``valid`` marks the real clips (False: a repeat that only pads the batch; default all) and
        ``global_valid`` counts them over every rank's share (the loader's count; default the whole
        global batch). The step minimises the mean loss over the real clips of the global batch:
        padding weighs nothing, however it is spread over the ranks. The clips seen, and with them
        the learning rate, move on by ``global_valid``."""
        n = self.global_batch if global_valid is None else global_valid
        clips, labels = clips.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
        with autocast(self.device, self.amp):
            logits = self.net(clips)
        losses = F.cross_entropy(logits.float(), labels, reduction="none")
        if valid is not None:
            losses = losses * valid.to(self.device, losses.dtype, non_blocking=True)
        # gradients are averaged over the ranks: each rank's sum over n / size clips averages to the
        # mean over n
        loss = losses.sum() / (n / self.backend.size)
        self.optimizer.zero_grad()  # sets grads to None (Horovod takes no argument)
        self.scaler.scale(loss).backward()
        self.backend.synchronize(self.optimizer)
        if self.recipe.clip_grad_norm:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.recipe.clip_grad_norm)
        with self.backend.skip_synchronize(self.optimizer):
            self.scaler.step(self.optimizer)
        self.scaler.update()
        self.seek(self.clips_seen + n)
        return losses.detach().sum()

    @torch.no_grad()
    def scores(self, clips: torch.Tensor, model: torch.nn.Module | None = None) -> torch.Tensor:
        """Class scores in float32 for evaluation, of ``model`` (default: the one trained; call
        ``model.eval()`` first)."""
        with autocast(self.device, self.amp):
            return (model or self.model)(clips.to(self.device, non_blocking=True)).float()

    def describe(self) -> str:
        c, r, b = self.config, self.recipe, self.backend
        params = sum(p.numel() for p in self.model.parameters())
        return "\n".join([
            f"backend {b.name}: {b.size} rank(s), device {self.device}, amp {self.amp}, "
            f"channels-last {self.model.channels_last}",
            f"model: {NAMES[c.arch]} ({c.modality}) ResNet-{c.depth} width {c.width}, {c.segments} frames, "
            f"{f'shift 1/{c.shift_div}, ' if c.shift else ''}dropout {c.dropout}, BN {self.bn_mode}, "
            f"{c.num_classes} classes, {params / 1e6:.2f} M parameters",
            f"recipe: global batch {self.global_batch} ({self.batch_size} x {b.size}), "
            f"peak lr {self.peak_lr:g} ({r.lr_per_8:g} per 8 clips), {self.epochs} epochs, "
            f"{self.schedule.total_clips} clips, "
            f"warm-up {self.schedule.warmup_clips} clips, cosine to 0 (both over clips seen), {r.optimizer}"
            f"{f' momentum {r.momentum}' if r.optimizer == 'sgd' else ''}, "
            f"weight decay {r.weight_decay:g} (not on BN or biases), grad clip {r.clip_grad_norm or 'off'}, "
            f"fp16 allreduce {self.fp16_allreduce}"])
