"""Test a checkpoint with the multi-view protocol: every clip of a video x 1 or 3 crops, averaged.

Each clip the shard set holds for a video (``ingest build --eval-clips K``) is one temporal view;
``--crops 3`` adds TSM's three full-resolution spatial crops per clip. The softmax scores of
all views of a video are averaged and the video is scored once, however its clips were
spread over ranks; clips repeated only to pad the last batch are skipped. Also reports
single-view clip accuracy, and writes per-video top-5 predictions (for unlabeled test splits).
"""
from __future__ import annotations

import argparse
import json
import logging

import torch

from shards.errors import UsageError

from . import checkpoint, config, metrics
from .data.device_decode import clip_source
from .data.loader import ClipLoader, shared_manifest
from .distributed import backends as distributed
from .distributed import cores
from .errors import ConfigError
from .engine import amp_dtype, autocast, pick_device
from .model.tsm import build

log = logging.getLogger("trainer.test")


class VideoScores:
    """Per-video sums of view-averaged softmax scores, mergeable across ranks."""

    def __init__(self):
        self.videos: dict[str, list] = {}  # video -> [score sum, clips, label]
        self.clips = self.clips_correct = 0

    def add(self, video: str, probs: torch.Tensor, label: int) -> None:
        entry = self.videos.setdefault(video, [torch.zeros_like(probs), 0, label])
        entry[0] += probs
        entry[1] += 1
        if label >= 0:
            self.clips += 1
            self.clips_correct += int(probs.argmax()) == label

    @classmethod
    def merged(cls, parts: list["VideoScores"]) -> "VideoScores":
        out = cls()
        for o in parts:
            out.clips += o.clips
            out.clips_correct += o.clips_correct
            for video, (scores, n, label) in o.videos.items():
                entry = out.videos.setdefault(video, [torch.zeros_like(scores), 0, label])
                entry[0] += scores
                entry[1] += n
        return out

    def summary(self) -> dict:
        labeled = [(s / n, label) for s, n, label in self.videos.values() if label >= 0]
        out = {"videos": len(self.videos), "labeled_videos": len(labeled),
               "views_per_video": sum(n for _, n, _ in self.videos.values()) / max(len(self.videos), 1)}
        if labeled:
            scores = torch.stack([s for s, _ in labeled])
            labels = torch.tensor([label for _, label in labeled])
            top1, top5 = metrics.topk_correct(scores, labels, (1, 5), torch.ones_like(labels, dtype=torch.bool))
            out.update(video_top1=100 * top1.item() / len(labeled), video_top5=100 * top5.item() / len(labeled),
                       clip_top1=100 * self.clips_correct / max(self.clips, 1))
        return out

    def predictions(self, classes: list[str]) -> dict:
        out = {}
        for video, (scores, n, label) in sorted(self.videos.items()):
            top = (scores / n).topk(min(5, len(classes)))
            out[video] = {"label": label, "top5": [classes[i] for i in top.indices.tolist()],
                          "scores": [round(v, 5) for v in top.values.tolist()]}
        return out


@torch.no_grad()
def score_split(model, loader: ClipLoader, device, amp, clips_of) -> VideoScores:
    """This rank's share of the split, views averaged per clip, clips summed per video.
    ``clips_of``: batch -> clips (``trainer.data.device_decode.clip_source``)."""
    model.eval()
    acc = VideoScores()
    for batch in loader:
        clips = clips_of(batch).to(device, non_blocking=True)
        views = clips.shape[1] if clips.dim() == 6 else 1
        with autocast(device, amp):
            logits = model(clips.flatten(0, 1) if views > 1 else clips).float()
        probs = logits.softmax(dim=1).view(len(batch["keys"]), views, -1).mean(dim=1).cpu()
        for i, (video, label) in enumerate(zip(batch["videos"], batch["labels"].tolist())):
            if batch["valid"][i]:
                acc.add(video, probs[i], label)
    return acc


def main(ev: config.Evaluation) -> int:
    """Score ``ev.checkpoint`` on ``ev.split`` of ``ev.data``; rank 0 prints the summary."""
    backend = distributed.init(ev.backend)
    cores.cap_threads(backend.local_ranks)
    device = pick_device(backend)
    state = checkpoint.load(ev.checkpoint) if backend.rank == 0 else None
    if backend.rank == 0 and state is None:
        raise ConfigError(f"{ev.checkpoint}: no checkpoint")
    state = backend.broadcast_object(None if state is None else {
        "model": state["model"], "model_config": state["model_config"], "classes": state["classes"],
        "data": config.of_checkpoint(state).data})
    trained = state["data"]  # the training run's data config: its crop and scale
    model = build(state["model_config"]).to(device)
    model.load_state_dict(state["model"])
    manifest = shared_manifest(ev.data, backend.rank, lambda obj, root: backend.broadcast_object(obj))
    if manifest.classes != state["classes"]:
        raise ConfigError(f"{ev.data}: classes differ from the checkpoint's")
    if ev.split not in manifest.splits:  # every rank has the manifest: all refuse alike
        raise UsageError(f"{ev.data}: no split {ev.split!r} (--split); the set has {', '.join(manifest.splits)}")
    workers = ev.workers if ev.workers is not None else cores.default_workers(backend.local_ranks)
    loader = ClipLoader(manifest, ev.split, batch_size=ev.batch_size, rank=backend.rank,
                        world_size=backend.size, train=False, num_workers=workers,
                        crop_size=ev.crop_size or trained.crop_size, scale_size=ev.scale_size or trained.scale_size,
                        eval_crops=ev.crops, decode_on_device=ev.decode_on_device, modality=model.config.modality)
    local = score_split(model, loader, device, amp_dtype(ev.amp, device), clip_source(ev.decode_on_device, device))
    merged = VideoScores.merged(backend.all_gather_object(local))
    if backend.rank == 0:
        summary = {"split": ev.split, "crops": ev.crops, **merged.summary()}
        print(json.dumps(summary))
        if ev.output:
            with open(ev.output, "w", encoding="utf-8") as f:
                json.dump({"summary": summary, "videos": merged.predictions(manifest.classes)}, f, indent=1)
    backend.shutdown()
    return 0


def run(args: argparse.Namespace) -> int:
    return main(config.evaluation_config(args))
