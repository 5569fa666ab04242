"""A pool of shared-memory batch slots: loader workers write pixels straight into a slot, only
the slot number and small metadata cross the worker queue, and a slot is written again only
after the trainer has let go of its batch.

Why: PyTorch's DataLoader moves every batch from a worker to the trainer in a fresh
shared-memory segment, so each batch (9.6 MB for 8 clips of 8 x 224 x 224) costs the worker
page faults on new memory and the trainer a new mapping. The pool is allocated once per
``ClipLoader``, before its workers fork, and reused for every batch of every epoch.

Ownership of a slot, the whole contract:

1. Slots are partitioned among the loader's workers (``per_worker`` each), so two workers never
   race for one and no lock is needed. A worker takes one of its slots whose state is free
   (``acquire``), marks it taken and writes the batch into it. Only the worker sets a slot
   taken, only the trainer's process sets it free again.
2. The trainer's process turns the slot number into a tensor (``lease``): a view of the slot
   whose memory is owned by a numpy array with a finalizer. Every tensor, view or ``.numpy()``
   array derived from the batch's clips keeps that array alive, so the slot is freed exactly
   when the last of them is gone (CPython frees it the moment the last reference drops: in a
   loop ``for batch in loader``, when ``batch`` and the tensors taken from it are rebound).
   A held batch is therefore never overwritten, however long it is held.
3. A worker whose slots are all held (a caller keeping many batches, e.g. ``list(loader)``)
   does not wait: it puts that batch in a fresh shared-memory block as DataLoader would, and
   the trainer's process counts it in ``misses``. ``per_worker = prefetch + 2`` covers a
   training loop: the batches in flight from one worker (at most the DataLoader's prefetch
   factor) plus the two the loop holds while it asks for the next.
4. When an iteration ends (its workers are gone), ``reclaim`` frees the slots that workers had
   taken but never delivered; slots of batches still held stay taken.
"""
from __future__ import annotations

import math
import weakref

import numpy as np
import torch

FREE, TAKEN = 0, 1


class SlotPool:
    """``workers`` x ``per_worker`` slots of ``slot_bytes`` bytes each, in shared memory."""

    def __init__(self, workers: int, per_worker: int, slot_bytes: int):
        self.workers, self.per_worker, self.slot_bytes = workers, per_worker, slot_bytes
        self.memory = torch.empty(workers * per_worker * slot_bytes, dtype=torch.uint8).share_memory_()
        self._state = torch.zeros(workers * per_worker, dtype=torch.uint8).share_memory_()
        self._bytes, self.state = self.memory.numpy(), self._state.numpy()
        self.leased: set[int] = set()  # slots whose batch the trainer's process holds
        self.misses = 0  # batches that found no free slot and came in their own memory
        # page-locked once, so copies to the GPU are asynchronous (untested on GPU)
        if torch.cuda.is_available():
            cudart = torch.cuda.cudart()
            cudart.cudaHostRegister(self.memory.data_ptr(), self.memory.numel(), 0)
            weakref.finalize(self, cudart.cudaHostUnregister, self.memory.data_ptr())

    def fits(self, shape) -> bool:
        return math.prod(shape) <= self.slot_bytes

    # --- in a worker ------------------------------------------------------------------------
    def acquire(self, worker: int) -> int | None:
        """One of ``worker``'s free slots, now taken; None when all of them are held."""
        first = worker * self.per_worker
        free = np.flatnonzero(self.state[first:first + self.per_worker] == FREE)
        if not len(free):
            return None
        slot = first + int(free[0])
        self.state[slot] = TAKEN
        return slot

    def array(self, slot: int, shape) -> np.ndarray:
        """The slot's memory as a uint8 array of ``shape``, to write the batch into."""
        return np.ndarray(shape, np.uint8, buffer=self._bytes, offset=slot * self.slot_bytes)

    # --- in the trainer's process -----------------------------------------------------------
    def lease(self, slot: int, shape) -> torch.Tensor:
        """The batch in ``slot`` as a tensor; the slot is freed when the last view of it dies."""
        owner = self.array(slot, shape)
        self.leased.add(slot)
        weakref.finalize(owner, self._release, slot)
        return torch.from_numpy(owner)

    def _release(self, slot: int) -> None:
        self.leased.discard(slot)
        self.state[slot] = FREE

    def reclaim(self) -> None:
        """Free every taken slot the trainer does not hold; call only when no worker runs."""
        held = np.zeros(len(self.state), dtype=bool)
        held[list(self.leased)] = True
        self.state[~held] = FREE
