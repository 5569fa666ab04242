"""Sub-batch batch norm: training statistics over groups of a fixed number of clips, whatever the batch.

BatchNorm's regularising noise and its statistics depend on how many samples it normalises
together. Multigrid (Wu et al. 2020) multiplies the batch by up to 16 for small shapes, and batch
growth doubles it; both would change BN's behaviour along with the batch. The paper's fix, kept
here, is to normalise each group of ``clips_per_group`` clips (all frames of a clip stay in one
group, since the network sees a clip as T images) by its own mean and variance.

The layer is ``nn.BatchNorm2d`` with the same parameters and buffers: state dicts, pretrained
weights, Horovod's parameter list and DDP's buckets see exactly what they saw before. Only its
training-mode forward differs, and only when a batch holds more than one group:

* groups: the batch's N clips cut into max(1, N // clips_per_group) groups of consecutive clips,
  as equal as possible (the first N mod groups take one clip more);
* each group is normalised by ``F.batch_norm`` on its own slice (a contiguous slice of the frames,
  in NCHW and channels-last memory alike), with the shared weight and bias;
* the running statistics get one update per batch, with the mean and unbiased variance of the
  *whole* batch, assembled exactly from the groups' (law of total variance): the same update a
  plain BatchNorm2d would make, so evaluation is unchanged.

Evaluation and frozen layers use the running statistics as always.

``SubBatchNorm3d`` is the same layer for an I3D's clips (N, C, T, H, W), whose clips are its first
dimension; per channel it normalises over N, T, H and W, as ``nn.BatchNorm3d`` does. It stays an
``nn.BatchNorm2d`` by class, so everything that finds a network's BN layers by that class (partial
BN, precise BN, model averaging, ``set_clips_per_group``) finds an I3D's too.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def group_sizes(clips: int, clips_per_group: int) -> list[int]:
    """Clips per group: max(1, clips // clips_per_group) groups, as equal as possible, larger first."""
    groups = max(1, clips // clips_per_group)
    small, extra = clips // groups, clips % groups  # (divmod does not trace under torch.compile)
    return [small + 1] * extra + [small] * (groups - extra)


class SubBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` normalising groups of ``clips_per_group`` clips separately in training
    (0: the whole batch). Called with the activations (N*T, C, H, W) and T."""

    clips_per_group = 0

    def rows_per_clip(self, segments: int) -> int:
        """Entries of the first dimension one clip takes: its ``segments`` frames."""
        return segments

    def forward(self, x: torch.Tensor, segments: int) -> torch.Tensor:
        rows = self.rows_per_clip(segments)
        clips = x.shape[0] // rows
        if not (self.training and self.clips_per_group and clips >= 2 * self.clips_per_group):
            return super().forward(x)
        sizes = group_sizes(clips, self.clips_per_group)
        parts, means, variances = [], [], []
        for part in x.split([n * rows for n in sizes]):
            # momentum 1 turns the scratch buffers into the group's mean and unbiased variance
            mean, var = ((torch.zeros_like(self.running_mean), torch.ones_like(self.running_var))
                         if self.track_running_stats else (None, None))
            parts.append(F.batch_norm(part, mean, var, self.weight, self.bias, True, 1.0, self.eps))
            means.append(mean)
            variances.append(var)
        if self.track_running_stats:
            self._update_running_stats(means, variances, [n * rows * x[0, 0].numel() for n in sizes])
        return torch.cat(parts)

    @torch.no_grad()
    def _update_running_stats(self, means, variances, counts) -> None:
        n = torch.tensor(counts, dtype=self.running_mean.dtype, device=self.running_mean.device).unsqueeze(1)
        means, variances = torch.stack(means), torch.stack(variances)
        total = n.sum()
        mean = (n * means).sum(0) / total
        spread = (n - 1) * variances + n * (means - mean) ** 2  # each group's sum of squared deviations
        var = spread.sum(0) / (total - 1)
        self.num_batches_tracked.add_(1)
        momentum = 1.0 / self.num_batches_tracked.item() if self.momentum is None else self.momentum
        self.running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
        self.running_var.mul_(1 - momentum).add_(var, alpha=momentum)


class SubBatchNorm3d(SubBatchNorm2d):
    """``SubBatchNorm2d`` for clips (N, C, T, H, W): one clip per entry of the first dimension."""

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() != 5:
            raise ValueError(f"expected 5D input (N, C, T, H, W), got {x.dim()}D")

    def rows_per_clip(self, segments: int) -> int:
        return 1


def set_clips_per_group(model: nn.Module, clips: int) -> None:
    """Normalise groups of ``clips`` clips in every sub-batch BN layer of ``model`` (0: whole batches)."""
    for m in model.modules():
        if isinstance(m, SubBatchNorm2d):
            m.clips_per_group = clips
