"""Data-parallel backends behind one small interface: Horovod (the default), torch.distributed, none.

Horovod averages gradients inside a wrapped optimizer (ring-allreduce as each gradient
becomes ready during the backward pass); torch.distributed does the same inside a DDP
wrapper around the model. The training loop only calls the methods below, so it reads the
same for both. Launching:

* one process: ``trainer train ...`` (Horovod initialises itself with size 1);
* Horovod on one machine: ``horovodrun -np 4 -H localhost:4 [--gloo] trainer train ...``;
* Horovod on several: ``horovodrun -np 16 -H node1:4,node2:4,node3:4,node4:4 trainer train ...``,
  or ``mpirun -np 16 -H node1:4,... -bind-to none -map-by slot -x NCCL_DEBUG=INFO -x LD_LIBRARY_PATH
  -x PATH -mca pml ob1 -mca btl ^openib trainer train ...`` (Horovod built with MPI), or under
  Slurm ``srun --ntasks-per-node=4 --gpus-per-task=1 trainer train ...`` (Horovod reads
  Slurm's rank variables through MPI/PMI);
* torch.distributed: ``torchrun --nproc-per-node 4 [--nnodes N --rdzv-endpoint HOST:PORT]
  trainer train --backend torch ...``.
"""
from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import os
import socket

import torch
from torch import nn

from shards.base.errors import UsageError

log = logging.getLogger(__name__)


def node_size(hosts: list) -> int:
    """Ranks per node for the loader's node-affine epochs, from every rank's host in rank order (one
    allgather: the same list, so the same answer, on every rank): the count of each host's ranks when
    every host runs that many in one consecutive block of ranks (Horovod's and torchrun's placement),
    else 1, every rank a node of its own (``shards.plan.partition`` cuts an epoch into equal nodes)."""
    blocks = [len(list(ranks)) for _, ranks in itertools.groupby(hosts)]
    return blocks[0] if len(set(blocks)) == 1 and len(blocks) == len(set(hosts)) else 1


class Backend:
    """One process, no communication; the base the others override."""

    name = "none"
    rank, size, local_rank = 0, 1, 0
    local_size = 1  # ranks per node as the loader's node-affine epochs see them (``agree_on_nodes``)
    local_ranks = 1  # ranks on this host: they share its cores
    host = ""  # this rank's host as the launcher names it
    peer_lost: tuple[type[BaseException], ...] = ()  # what a collective raises once another rank has left

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer, compression: bool):
        """-> (module to call forward on, optimizer to step); gradients are averaged over ranks."""
        return model, optimizer

    def synchronize(self, optimizer) -> None:
        """Wait until averaged gradients are in ``.grad`` (before unscaling or clipping them)."""

    def skip_synchronize(self, optimizer):
        """Context for ``optimizer.step()`` after an explicit :meth:`synchronize`."""
        return contextlib.nullcontext()

    def broadcast_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """Make every rank's parameters, buffers and (non-empty) optimizer state rank 0's."""

    def broadcast_object(self, obj):
        return obj

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather_object(self, obj) -> list:
        return [obj]

    def average_buffers(self, model: nn.Module) -> None:
        """Average floating-point buffers (BN running statistics), which gradients never sync."""
        if self.size == 1:
            return
        for buf in model.buffers():
            if buf.is_floating_point():
                buf.copy_(self.all_sum(buf.detach().clone()) / self.size)

    def shutdown(self) -> None:
        """Nothing to release in one process."""

    def agree_on_nodes(self) -> None:
        """Every rank's host, gathered: every rank derives the same ``local_size`` (``node_size``);
        rank 0 says so when hosts run different rank counts. A collective: at start, and after every
        elastic re-formation (in its sync, where a joining rank meets the others)."""
        hosts = self.all_gather_object(self.host)
        self.local_size = node_size(hosts)
        if self.local_size == 1 and self.rank == 0 and len(set(hosts)) < len(hosts):
            counts = ", ".join(f"{host} {len(list(ranks))}" for host, ranks in itertools.groupby(hosts))
            log.info("ranks per host differ or are not in blocks (%s): node-affine epochs take every rank "
                     "as a node of its own (give every host the same slot count to share pieces per host)",
                     counts)


class Horovod(Backend):
    name = "horovod"

    def __init__(self):
        try:
            import horovod.torch as hvd
        except ImportError as e:
            raise UsageError(f"--backend horovod: cannot import horovod.torch ({e}); "
                             "run scripts/setup.sh, or pass --backend none or torch") from None
        hvd.init()
        self.hvd = hvd
        self.peer_lost = (hvd.HorovodInternalError,)
        self.rank, self.size, self.local_rank = hvd.rank(), hvd.size(), hvd.local_rank()
        self.local_ranks = self.local_size = hvd.local_size()  # local_size until agree_on_nodes
        # horovodrun's name for the slot
        self.host = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()

    def prepare(self, model, optimizer, compression):
        hvd = self.hvd
        optimizer = hvd.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(),
            compression=hvd.Compression.fp16 if compression else hvd.Compression.none)
        return model, optimizer

    def synchronize(self, optimizer):
        optimizer.synchronize()

    def skip_synchronize(self, optimizer):
        return optimizer.skip_synchronize()

    def broadcast_state(self, model, optimizer):
        hvd = self.hvd
        if optimizer is not None and self.broadcast_object(bool(optimizer.state_dict()["state"])):
            # Horovod fills an empty optimizer state with a zero-gradient step, which moves
            # weights under weight decay; the parameter broadcast below undoes that move.
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def broadcast_object(self, obj):
        # Horovod matches collectives by name, by default the object's type name: None on the
        # receiving ranks would never meet rank 0's object, so every call names itself the same
        return self.hvd.broadcast_object(obj, root_rank=0, name="trainer.broadcast_object")

    def all_sum(self, tensor):
        return self.hvd.allreduce(tensor, op=self.hvd.Sum)

    def all_gather_object(self, obj):
        return self.hvd.allgather_object(obj, name="trainer.allgather_object")

    def shutdown(self):
        self.hvd.shutdown()


class TorchDistributed(Backend):
    """torch.distributed under torchrun: DDP on the model, NCCL on GPUs, Gloo on CPUs."""

    name = "torch"

    def __init__(self, pause: float | None = None):
        """``pause``: the longest a rank may wait in a collective for another that waits out its data
        source (``--source-deadline``); Gloo's and NCCL's own timeouts are set well above it."""
        import torch.distributed as dist
        self.dist = dist
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.local_ranks = self.local_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        self.host = os.environ.get("GROUP_RANK") or socket.gethostname()  # torchrun's node number
        if torch.cuda.is_available():
            torch.cuda.set_device(self.local_rank)
        # Gloo for the CPU tensors (metrics, stop flags), NCCL for the GPU ones where there are GPUs
        timeout = {} if pause is None else {"timeout": datetime.timedelta(seconds=max(1800.0, pause + 300.0))}
        dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo", **timeout)
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def prepare(self, model, optimizer, compression):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel
        ids = [self.local_rank] if next(model.parameters()).is_cuda else None
        ddp = DistributedDataParallel(model, device_ids=ids)
        if compression:
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return ddp, optimizer

    def broadcast_state(self, model, optimizer):
        if optimizer is not None and self.broadcast_object(bool(optimizer.state_dict()["state"])):
            optimizer.load_state_dict(self.broadcast_object(optimizer.state_dict()))
        for tensor in model.state_dict().values():
            self.dist.broadcast(tensor, src=0)

    def broadcast_object(self, obj):
        box = [obj]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_sum(self, tensor):
        tensor = tensor.clone()
        self.dist.all_reduce(tensor)
        return tensor

    def all_gather_object(self, obj):
        out = [None] * self.size
        self.dist.all_gather_object(out, obj)
        return out

    def shutdown(self):
        self.dist.destroy_process_group()


def init(name: str = "horovod", pause: float | None = None) -> Backend:
    """``horovod`` | ``torch`` (falls back to one process outside torchrun) | ``none``. ``pause``: the
    longest a rank may wait in a collective for another (Horovod's Gloo waits without limit:
    measured in docs/runbooks/training.md; torch.distributed's timeouts are set above it)."""
    if name == "horovod":
        return Horovod()
    if name == "torch":
        return TorchDistributed(pause) if "WORLD_SIZE" in os.environ else Backend()
    if name == "none":
        return Backend()
    raise ValueError(f"unknown backend {name!r}")
