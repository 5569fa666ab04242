"""Test a checkpoint with the multi-view protocol: every clip of a video x 1 or 3 crops, averaged.

Each clip the shard set holds for a video (``ingest build --eval-clips K``) is one temporal view;
``--crops 3`` adds TSM's three full-resolution spatial crops per clip. The softmax scores of
all views of a video are averaged and the video is scored once, however its clips were
spread over ranks; clips repeated only to pad the last batch are skipped. Also reports
single-view clip accuracy, and writes per-video top-5 predictions (for unlabeled test splits).

``--ema`` scores the weight average a run trained with ``--ema-decay`` checkpoints beside its
weights (``trainer.ema``) instead of the weights.

``--fuse RUN_A RUN_B [--weights 1 1.5]`` is TSN's late fusion of two streams (appearance and
motion): each run scores the split as above with its own network, crop and modality, and each
video's fused score is the weighted mean of the runs' view-averaged softmax scores. It reports each
stream's and the fused video accuracy; the runs must score the same videos with the same classes.
"""
from __future__ import annotations

import dataclasses
import json
import logging

import torch

from shards.base.errors import UsageError
from shards.io import storage

from . import checkpoint, config, metrics
from .data import (  # the public reading API (docs/library.md), as any training loop reads
    ClipLoader,
    EpochOptions,
)
from .data.arguments import loader_kwargs, worded_as_flags
from .data.device_decode import clip_source
from .data.placement import shared_manifest
from .distributed import backends as distributed
from .distributed import cores
from .engine import amp_dtype, autocast, pick_device
from .errors import ConfigError
from .model.tsm import ModelConfig, build

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
            top1, top5 = metrics.topk_correct(scores, labels, (1, 5),
                                              torch.ones_like(labels, dtype=torch.bool))
            out.update(video_top1=100 * top1.item() / len(labeled),
                       video_top5=100 * top5.item() / len(labeled))
        if self.clips:  # none in a fusion, whose videos are scored as a whole
            out["clip_top1"] = 100 * self.clips_correct / self.clips
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


def resolve_run(run: str) -> str:
    """The checkpoint of ``run``: a ``trainer train`` output directory's checkpoint.pt, or ``run`` itself."""
    inside = storage.join(run, "checkpoint.pt")
    return inside if storage.exists(inside) else run


def load_network(url: str, backend, ema: bool = False) -> dict:
    """Rank 0 reads the checkpoint at ``url`` and every rank gets what testing needs of it: the weights
    (``ema``: the weight average instead), the network's config and architecture
    (``trainer.config.ARCHS``: the checkpoint decides which network is tested), the classes and the
    training run's data config (its crop, scale and modality)."""
    state = checkpoint.load(url) if backend.rank == 0 else None
    if backend.rank == 0 and state is None:
        raise ConfigError(f"{url}: no checkpoint")
    network = None
    if state is not None:
        weights = (checkpoint.hook_states(state).get("ema") or {}).get("weights") if ema else state["model"]
        network = {"url": url, "model": weights, "model_config": state["model_config"],
                   "classes": state["classes"],
                   "data": config.of_checkpoint(state).data,
                   "arch": ModelConfig(**state["model_config"]).arch}
    network = backend.broadcast_object(network)
    if network["model"] is None:  # every rank refuses alike
        raise ConfigError(f"{url}: --ema: the checkpoint keeps no weight average "
                          "(its run had no --ema-decay)")
    return network


def score_checkpoint(network: dict, data: str, ev: config.Evaluation, backend, device) -> VideoScores:
    """Score ``network`` (``load_network``'s) on ``ev.split`` of ``data`` with the views ``ev`` asks
    for, every rank its share; the scores of all ranks, merged."""
    trained = network["data"]
    model = build(network["model_config"]).to(device)
    model.load_state_dict(network["model"])
    manifest = shared_manifest(data, backend.rank, lambda obj, root: backend.broadcast_object(obj))
    if manifest.classes != network["classes"]:
        raise ConfigError(f"{data}: classes differ from the checkpoint's ({network['url']})")
    if ev.split not in manifest.splits:  # every rank has the manifest: all refuse alike
        raise UsageError(f"{data}: no split {ev.split!r} (--split); the set has {', '.join(manifest.splits)}")
    crop, scale = ev.crop_size or trained.crop_size, ev.scale_size or trained.scale_size
    if ev.crops == 1 and scale < crop:  # the loader's ValueError, as the flags
        whose = "" if ev.crop_size else " (the run's)"
        raise UsageError(f"--scale-size {scale}: smaller than --crop-size {crop}{whose}: the short side "
                         f"is scaled to --scale-size, then the centre crop cut: give --scale-size {crop} "
                         "or more")
    workers = ev.workers if ev.workers is not None else cores.default_workers(backend.local_ranks)
    ev = dataclasses.replace(ev, workers=workers, crop_size=crop, scale_size=scale)
    with worded_as_flags(ev):
        planning, reading = loader_kwargs(ev)
        epochs = EpochOptions(**planning, rank=backend.rank, world_size=backend.size, train=False)
        loader = ClipLoader(manifest, ev.split, epochs, **reading, modality=model.config.modality)
    local = score_split(model, loader, device, amp_dtype(ev.amp, device),
                        clip_source(ev.decode_on_device, device))
    return VideoScores.merged(backend.all_gather_object(local))


def fused(runs: list[str], scores: list[VideoScores], weights: tuple[float, ...]) -> VideoScores:
    """TSN's late fusion: each video's view-averaged softmax scores, averaged over the runs with
    ``weights`` (normalised to sum 1, so the fused scores are probabilities too). Every run must
    have scored the same videos with the same labels."""
    first = scores[0].videos
    for run, other in zip(runs[1:], scores[1:]):
        differ = sorted(set(first) ^ set(other.videos))
        if differ:
            raise ConfigError(f"--fuse: {run} scores {len(other.videos)} videos, {runs[0]} {len(first)}; "
                              f"{len(differ)} are scored by only one of them (e.g. {differ[0]})")
        relabeled = [v for v in first if first[v][2] != other.videos[v][2]]
        if relabeled:
            raise ConfigError(f"--fuse: {run} and {runs[0]} label {len(relabeled)} videos differently "
                              f"(e.g. {relabeled[0]})")
    out = VideoScores()
    total = sum(weights)
    for video, (_, _, label) in first.items():
        mean = sum(w * s.videos[video][0] / s.videos[video][1] for w, s in zip(weights, scores)) / total
        out.videos[video] = [mean, 1, label]
    return out


def main(ev: config.Evaluation) -> int:
    """Score ``ev.checkpoint``, or each of the ``ev.fuse`` runs and their fusion, on ``ev.split``
    of ``ev.data``; rank 0 prints the summary."""
    runs, weights = ev.runs, ev.fusion_weights
    backend = distributed.init(ev.backend)
    cores.cap_threads(backend.local_ranks)
    device = pick_device(backend)
    networks = [load_network(resolve_run(run), backend, ev.ema) for run in runs]
    for run, network in zip(runs[1:], networks[1:]):
        if network["classes"] != networks[0]["classes"]:
            raise ConfigError(f"--fuse: {run} was trained on other classes than {runs[0]}")
    sets = ev.data * len(runs) if len(ev.data) == 1 else ev.data
    scores = [score_checkpoint(network, data, ev, backend, device) for network, data in zip(networks, sets)]
    if backend.rank == 0:
        classes = networks[0]["classes"]
        head = {"split": ev.split, "crops": ev.crops, **({"ema": True} if ev.ema else {})}
        if ev.fuse is None:
            summary = {**head, "arch": networks[0]["arch"], **scores[0].summary()}
            report = {"summary": summary, "videos": scores[0].predictions(classes)}
        else:
            together = fused(runs, scores, weights)
            summary = {**head, "runs": list(runs), "weights": list(weights),
                       **{k: v for k, v in together.summary().items() if k != "views_per_video"},
                       "streams": [{"run": run, "arch": network["arch"], **s.summary()}
                                   for run, network, s in zip(runs, networks, scores)]}
            report = {"summary": summary, "videos": together.predictions(classes),
                      "streams": [{"run": run, "videos": s.predictions(classes)} for run,
                                  s in zip(runs, scores)]}
        print(json.dumps(summary))
        if ev.output:
            storage.atomic_write(ev.output, json.dumps(report, indent=1).encode())
    backend.shutdown()
    return 0

