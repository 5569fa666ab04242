"""K-step model averaging (Zhou and Cong, IJCAI 2018; Cong et al., SBAC-PAD 2018): synchronise every K steps.

Synchronous data parallelism allreduces the gradients at every step. K-step averaging lets each
rank take local optimizer steps on its own batches and brings the ranks together every K steps,
so there are K times fewer synchronisations. The rule, for optimizer steps 0, 1, 2, ...:

1. Step s is a *synchronising* step when ``is_sync_step(s, every, local_after)``: every step
   before ``local_after`` (the post-local variant of Lin et al. 2020: synchronous during warm-up,
   K-step after), then the last step of each period of ``every`` steps. Other steps are local.
2. A local step is the rank's own optimizer step on its own gradient. The rank has now *drifted*.
3. A synchronising step averages, in one allreduce, the gradients and the BN running statistics
   and, if the rank has drifted, its parameters and optimizer state; then every rank takes the
   optimizer step from the same averaged state with the same averaged gradient, so all ranks
   hold identical parameters, BN statistics and optimizer state afterwards.

With ``every=1`` no rank ever drifts and step 3 is synchronous training: the same gradient
allreduce, hence the same parameters and optimizer state at every step (the BN statistics,
which never feed back into training, are the ranks' mean, as synchronous training makes them
before evaluating). For SGD, with or without momentum, Nesterov and weight decay, the update is
linear in (parameters, momentum, gradient), so averaging before the synchronising step equals
the usual K-step averaging ("step locally, then average the models").

What Adam averages, and why: parameters, BN buffers, both moment estimates (``exp_avg``,
``exp_avg_sq``; ``max_exp_avg_sq`` with AMSGrad), and on synchronising steps the gradient.
* Averaging the gradient and taking the step from the averaged state (rather than stepping
  locally and averaging the results, which is not the same for Adam's non-linear update) is what
  makes ``every=1`` equal synchronous Adam, and lets the synchronising step's moments see the
  lower-noise global gradient.
* The first moment is linear in the gradients: its average is the first moment of the averaged
  model's gradient stream. The second moment's average is the mean squared *local* gradient, which
  is what the next local steps divide by (their gradients come from one rank's batch, noisier
  than the global one); averaging sqrt(v) instead would underestimate it (Jensen), resetting it
  would restart Adam's bias correction on a state the model has moved past.
* Averaging all of the state makes every rank's state identical after a synchronising step, so
  the checkpoint rank 0 writes is every rank's state and a resumed run continues exactly.
The step counts are equal on every rank and are not averaged.

Communication: one allreduce per synchronising step (per dtype; everything in one flat buffer).
Its size is the gradients' (plus the small BN statistics) after a synchronous step and, after
drifting, also the parameters' and optimizer state's: 3x the gradients' for SGD with momentum,
4x for Adam, so the bytes sent per K steps fall less than the number of synchronisations.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Callable

import torch
from torch import nn

from ..errors import ConfigError


def is_sync_step(step: int, every: int, local_after: int = 0) -> bool:
    """Whether optimizer step ``step`` (0-based) synchronises: all before ``local_after``, then
    the last of each period of ``every`` steps counted from ``local_after``."""
    if step < local_after:
        return True
    return (step - local_after + 1) % every == 0


class KStepAveraging:
    """Synchronisation of one rank's model and optimizer (not wrapped for data parallelism) every
    ``every`` steps; ``all_sum`` sums a tensor over ranks (``Backend.all_sum``). Call
    :meth:`synchronize` between ``backward()`` and ``optimizer.step()`` of every step.

    Counts ``collectives`` and ``floats`` sent, for the benchmarks."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, all_sum: Callable, world_size: int,
                 every: int = 1, local_after: int = 0):
        if every < 1:
            raise ValueError(f"averaging period must be at least 1 step, not {every}")
        self.model, self.optimizer, self.all_sum, self.world_size = model, optimizer, all_sum, world_size
        self.every, self.local_after = every, local_after
        self.drifted = False
        self.collectives = self.floats = 0

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _state(self) -> list[torch.Tensor]:
        """Every floating-point optimizer state tensor but step counts, in a fixed order."""
        out = []
        for p in self._params():
            state = self.optimizer.state.get(p, {})
            out += [state[k] for k in sorted(state) if k != "step" and torch.is_tensor(state[k])
                    and state[k].is_floating_point()]
        return out

    def _average(self, tensors: list[torch.Tensor]) -> None:
        """Replace each tensor by its mean over ranks: one allreduce per dtype and device."""
        if self.world_size == 1 or not tensors:
            return
        groups = defaultdict(list)
        for t in tensors:
            groups[(t.dtype, t.device)].append(t)
        for same in groups.values():
            flat = self.all_sum(torch.cat([t.detach().reshape(-1) for t in same])) / self.world_size
            for t, mean in zip(same, flat.split([t.numel() for t in same])):
                t.detach().copy_(mean.view_as(t))
            self.collectives += 1
            self.floats += flat.numel()

    def synchronize(self, step: int) -> bool:
        """Average what step ``step`` needs (see the module docstring); returns whether it synchronised."""
        if not is_sync_step(step, self.every, self.local_after):
            self.drifted = True
            return False
        tensors = []
        for p in self._params():
            if p.grad is None:  # every rank must send the same tensors
                p.grad = torch.zeros_like(p)
            tensors.append(p.grad)
        tensors += self._buffers()
        if self.drifted:
            tensors += self._params() + self._state()
        self._average(tensors)
        self.drifted = False
        return True

    def average_now(self) -> None:
        """Bring drifted ranks together without a step (before evaluating or checkpointing)."""
        if self.drifted:
            self._average(self._params() + self._buffers() + self._state())
            self.drifted = False

    def _buffers(self) -> list[torch.Tensor]:
        """BN running statistics (other buffers are constants, equal everywhere)."""
        return [b for m in self.model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                and m.track_running_stats for b in (m.running_mean, m.running_var)]

    def state_dict(self) -> dict:
        return {"drifted": self.drifted, "collectives": self.collectives, "floats": self.floats}

    def load_state_dict(self, state: dict) -> None:
        self.drifted, self.collectives, self.floats = state["drifted"], state["collectives"], state["floats"]


class KStepBackend:
    """A data-parallel backend (``trainer.distributed.backends``) whose ranks train by K-step
    averaging instead of averaging gradients at every step: ``prepare`` leaves the optimizer
    unwrapped (no Horovod allreduce hooks, no DDP), ``synchronize`` is
    :meth:`KStepAveraging.synchronize` for the next optimizer step, and ``average_buffers`` (called
    before evaluation) first brings drifted ranks together. Everything else (broadcasts, metric
    allreduces, rank and size) is the wrapped backend's. ``local_after`` counts optimizer steps."""

    def __init__(self, backend, every: int, local_after: int = 0):
        self.inner, self.every, self.local_after = backend, every, local_after
        self.averaging: KStepAveraging | None = None
        self.step = 0  # optimizer steps taken: which of them synchronise is a function of it

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer, compression: bool):
        if compression:
            raise ConfigError("--fp16-allreduce compresses the per-step gradient allreduce, which "
                              "K-step averaging replaces; use one or the other")
        self.averaging = KStepAveraging(model, optimizer, self.inner.all_sum, self.inner.size, self.every,
                                        self.local_after)
        return model, optimizer

    def synchronize(self, optimizer) -> None:
        self.averaging.synchronize(self.step)
        self.step += 1

    def skip_synchronize(self, optimizer):
        return contextlib.nullcontext()

    def average_buffers(self, model: nn.Module) -> None:
        self.averaging.average_now()  # parameters too: evaluation must see one model on every rank

    @property
    def drifted(self) -> bool:
        """Whether ranks hold different models now (a checkpoint would keep rank 0's alone)."""
        return self.averaging.drifted

    @property
    def synchronisations(self) -> int:
        return self.averaging.collectives

    def state_dict(self) -> dict:
        return {"step": self.step, **self.averaging.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.averaging.load_state_dict({k: v for k, v in state.items() if k != "step"})
