"""Builds asked for over HTTP: the request body checked, the dataset id computed, the id claimed
in the catalog, and the ingest run on Ray in a background thread of the server.

Identical requests share one plan while it is being computed and one claim in the catalog,
so any number of them at once make one build; requests for a set that is already ready are
answered with it. A build dies with the server; the next start finds its lease dead and marks
it failed, and asking again resumes it.
"""
from __future__ import annotations

import asyncio
import logging
import threading

from ingest import ray_runtime, registry
from ingest.clips import DECODERS, ClipConfig
from shards import storage
from shards.catalog import Catalog, canonical_json
from shards.packing import parse_size

log = logging.getLogger("service.builds")

# body key -> (type, where it goes); everything else in a body is refused
CLIP_KEYS = {"frames": int, "clips_per_video": int, "eval_clips": int, "short_side": int, "quality": int,
             "restart_interval": int, "seed": int, "decoder": str}
RUN_KEYS = {"workers": int, "videos_per_task": int, "ffmpeg_threads": int, "timeout": (int, float)}
OTHER_KEYS = {"src": str, "name": str, "shard_size": (int, str), "shard_samples": int, "splits": (list, str)}


class BadRequest(ValueError):
    pass


def parse_body(body) -> dict:
    """A build request's options, checked; raises BadRequest naming what is wrong."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    allowed = {**CLIP_KEYS, **RUN_KEYS, **OTHER_KEYS}
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise BadRequest(f"unknown keys: {', '.join(unknown)} (allowed: {', '.join(sorted(allowed))})")
    for key, value in body.items():
        if not isinstance(value, allowed[key]) or isinstance(value, bool):
            raise BadRequest(f"{key}: {value!r} has the wrong type")
    if "src" not in body:
        raise BadRequest("src is required")
    if body.get("decoder", "pyav") not in DECODERS:
        raise BadRequest(f"decoder must be one of {', '.join(DECODERS)}")
    splits = body.get("splits", ["train", "val", "test"])
    try:
        shard_size = parse_size(body.get("shard_size", "256MB"))
        cfg = ClipConfig(**{k: body[k] for k in CLIP_KEYS if k in body})
    except ValueError as e:
        raise BadRequest(str(e)) from None
    return {"src": body["src"], "name": body.get("name"), "cfg": cfg, "shard_size": shard_size,
            "shard_samples": body.get("shard_samples"),
            "splits": splits.split(",") if isinstance(splits, str) else splits,
            "run": {k: body[k] for k in RUN_KEYS if k in body}}


class Builds:
    """Starts builds for the server; ``request`` is awaited by the POST handler."""

    def __init__(self, catalog: Catalog, data_root: str, ray_address: str | None):
        self.catalog, self.data_root, self.ray_address = catalog, data_root, ray_address
        self._planning: dict[bytes, asyncio.Future] = {}

    async def request(self, body) -> tuple[int, dict]:
        """(HTTP status, JSON answer) for a build request."""
        req = parse_body(body)
        key = canonical_json({k: v for k, v in body.items() if k not in RUN_KEYS})
        if key not in self._planning:  # one plan for identical requests arriving together
            self._planning[key] = asyncio.ensure_future(asyncio.to_thread(
                registry.plan, req["src"], req["cfg"], shard_size=req["shard_size"],
                shard_samples=req["shard_samples"], splits=req["splits"]))
            self._planning[key].add_done_callback(lambda _: self._planning.pop(key, None))
        try:
            plan = await asyncio.shield(self._planning[key])
        except (FileNotFoundError, ValueError) as e:
            raise BadRequest(f"src {req['src']}: {e}") from None
        out = storage.join(self.data_root, plan.id[:16])
        claim = await asyncio.to_thread(registry.claim, self.catalog, plan, out, req["name"])
        answer = {"id": plan.id, "state": claim.record.state, "location": claim.record.location,
                  "status_url": f"/v1/builds/{plan.id}", "dataset_url": f"/v1/datasets/{plan.id}"}
        if claim.action == "reuse":
            return 200, answer
        if claim.action == "build":
            threading.Thread(target=self._run, args=(claim, plan, req["run"]), daemon=True,
                             name=f"build-{plan.id[:8]}").start()
            log.info("build %s of %s started into %s", plan.id, plan.src, claim.record.location)
        return 202, answer

    def _run(self, claim, plan, run: dict) -> None:
        try:
            ray_runtime.start(self.ray_address, None)  # all the cluster's CPUs, whatever this build's workers
            registry.run_claimed(self.catalog, claim, plan, address=self.ray_address, workers=run.get("workers"),
                                 videos_per_task=run.get("videos_per_task", 8),
                                 threads=run.get("ffmpeg_threads", 1), timeout=run.get("timeout", 600))
        except Exception:  # recorded as failed in the catalog by run_claimed
            log.exception("build %s failed", plan.id)
