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
import os

import torch
from torch import nn


def node_size(rank: int, size: int, local_size: int, nodes: int, node: int) -> int:
    """``local_size`` when the job looks like ``nodes`` nodes of ``local_size`` consecutive ranks from
    here (node n: ranks n x local_size ...), else 1 (every rank a node of its own, which every rank
    agrees on). Decided without a collective (a joining elastic rank could not meet the others in
    one); a job whose hosts run different rank counts that still add up to nodes x local_size on
    some host would disagree: give hosts equal slot counts."""
    return local_size if size == local_size * nodes and rank // local_size == node else 1


class Backend:
    """One process, no communication; the base the others override."""

    name = "none"
    rank, size, local_rank = 0, 1, 0
    local_size = 1  # ranks per node as the loader's node-affine epochs see them (``node_size``)
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


class Horovod(Backend):
    name = "horovod"

    def __init__(self):
        try:
            import horovod.torch as hvd
        except ImportError as e:
            raise SystemExit(f"--backend horovod: cannot import horovod.torch ({e}); "
                             "run scripts/setup.sh, or pass --backend none or torch") from None
        hvd.init()
        self.hvd = hvd
        self.peer_lost = (hvd.HorovodInternalError,)
        self.rank, self.size, self.local_rank = hvd.rank(), hvd.size(), hvd.local_rank()
        self.local_size = node_size(self.rank, self.size, hvd.local_size(), hvd.cross_size(), hvd.cross_rank())

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

    def __init__(self):
        import torch.distributed as dist
        self.dist = dist
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.local_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if torch.cuda.is_available():
            torch.cuda.set_device(self.local_rank)
        # Gloo for the CPU tensors (metrics, stop flags), NCCL for the GPU ones where there are GPUs
        dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        self.local_size = node_size(self.rank, self.size, local, self.size // local,
                                    int(os.environ.get("GROUP_RANK", 0)))

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


def init(name: str = "horovod") -> Backend:
    """``horovod`` | ``torch`` (falls back to one process outside torchrun) | ``none``."""
    if name == "horovod":
        return Horovod()
    if name == "torch":
        return TorchDistributed() if "WORLD_SIZE" in os.environ else Backend()
    if name == "none":
        return Backend()
    raise ValueError(f"unknown backend {name!r}")
