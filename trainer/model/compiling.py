"""``--compile``: the training step's network through ``torch.compile``, temporal shift included.

The shift (``trainer.model.temporal_shift``) is a custom autograd function of slices and copies;
Dynamo traces it, forward and backward, into the same graph as the convolutions around it
(``tests/test_compile.py`` checks that there is no graph break), so Inductor can fuse the
shift's copies with its neighbours instead of running them as separate memory passes.

Modes (``--compile MODE``): ``default`` (Inductor), ``max-autotune-no-cudagraphs``,
``reduce-overhead`` (adds CUDA graphs: they remove per-kernel launch cost, which matters for
small per-GPU batches, not for a ResNet-50 step of hundreds of milliseconds) and
``max-autotune``. ``auto`` is ``default``. Compilation happens at the first step and again
for every new input shape (e.g. the last, smaller validation batch is not compiled: only the
training network is). On CUDA the SGD update also becomes one fused kernel per parameter
group (``fused=True``) instead of PyTorch's default multi-tensor (foreach) path.

Tested on the CPU only (tiny model, compiled vs eager); the GPU figures are still to be taken
(``BENCHMARKS.md`` lists the commands).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from ..config import COMPILE_MODES

log = logging.getLogger(__name__)


def compile_network(net: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                    mode: str = "auto", backend: str = "inductor") -> nn.Module:
    """``net`` compiled for training in ``mode``; on CUDA, ``optimizer``'s update fused.
    ``backend="aot_eager"`` stops after capturing the forward and backward graphs (tests)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r} not one of {COMPILE_MODES}")
    if device.type == "cuda" and isinstance(optimizer, torch.optim.SGD):
        for group in optimizer.param_groups:
            group["fused"], group["foreach"] = True, False
    log.info("torch.compile mode %s on %s (compiles at the first step of each input shape)", mode, device)
    return torch.compile(net, backend=backend, mode=None if mode in ("auto", "default") else mode)
