"""Builds asked for over HTTP: the request body checked, the dataset id computed, the id claimed
in the catalog, and the ingest run in a build process of its own (``service.build_process``).

Identical requests share one plan while it is being computed and one claim in the catalog,
so any number of them at once make one build; requests for a set that is already ready are
answered with it. At most ``max_running`` build processes run at once (each starts its own
embedded Ray, or joins ``--ray-address``); the others wait their turn, their claims kept alive
by the server's heartbeat. A build process that dies without recording why is recorded failed
from its exit status at once; on shutdown the server stops its builds (SIGTERM, then SIGKILL to
the build's process group) and records them failed; if the server itself is killed, its build
processes see their stdin close and stop, recording why.
"""
from __future__ import annotations

import asyncio
import logging
import os
import pickle
import re
import signal
import sys

from ingest import registry
from ingest.clips import DECODERS, ClipConfig
from ingest.sources import SPLITS
from shards import storage
from shards.catalog import HEARTBEAT_SECONDS, Catalog, Claim, canonical_json
from shards.packing import parse_size

from .roots import SourceRoots

log = logging.getLogger("service.builds")

# body key -> (type, where it goes); everything else in a body is refused
CLIP_KEYS = {"frames": int, "clips_per_video": int, "eval_clips": int, "short_side": int, "quality": int,
             "restart_interval": int, "seed": int, "decoder": str}
RUN_KEYS = {"workers": int, "videos_per_task": int, "ffmpeg_threads": int, "timeout": (int, float)}
OTHER_KEYS = {"src": str, "name": str, "shard_size": (int, str), "shard_samples": int, "splits": (list, str)}
# the range of every number a request may give (anything outside is refused); workers: 1 to --max-build-workers
BOUNDS = {"frames": (1, 64), "clips_per_video": (1, 64), "eval_clips": (1, 64), "short_side": (16, 2048),
          "quality": (1, 100), "restart_interval": (0, 1024), "seed": (0, 2**63 - 1), "videos_per_task": (1, 1024),
          "ffmpeg_threads": (1, 16), "timeout": (1, 3600), "shard_samples": (1, 10**6), "shard_size": (10**6, 2**36)}


class BadRequest(ValueError):
    pass


def _bounded(key: str, value, low, high, rule: str = "") -> None:
    if not low <= value <= high:  # NaN is in no range
        raise BadRequest(f"{key}: {value!r} is outside {low}..{high}{rule}")


def parse_body(body, max_workers: int) -> dict:
    """A build request's options, checked (``max_workers``: the operator's --max-build-workers);
    raises BadRequest naming what is wrong and the rule."""
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
    splits = body.get("splits", list(SPLITS))
    splits = splits.split(",") if isinstance(splits, str) else splits
    if not splits or len(set(splits)) != len(splits) or not set(splits) <= set(SPLITS):
        raise BadRequest(f"splits: {splits!r}: give some of {', '.join(SPLITS)}, each once")
    try:
        shard_size = parse_size(body.get("shard_size", "256MB"))
        cfg = ClipConfig(**{k: body[k] for k in CLIP_KEYS if k in body})
    except ValueError as e:
        raise BadRequest(str(e)) from None
    for key, (low, high) in BOUNDS.items():
        if key in body:
            _bounded(key, shard_size if key == "shard_size" else body[key], low, high)
    if "workers" in body:
        _bounded("workers", body["workers"], 1, max_workers, " (the server's --max-build-workers)")
    return {"src": body["src"], "name": body.get("name"), "cfg": cfg, "shard_size": shard_size,
            "shard_samples": body.get("shard_samples"), "splits": splits,
            "run": {k: body[k] for k in RUN_KEYS if k in body}}


class Builds:
    """Starts builds for the server; ``request`` is awaited by the POST handler, ``stop`` at shutdown."""

    def __init__(self, catalog: Catalog, data_root: str, ray_address: str | None, *, roots: SourceRoots,
                 max_workers: int, max_running: int = 1, stop_grace: float = 20.0):
        self.catalog, self.data_root, self.ray_address = catalog, data_root, ray_address
        self.roots, self.max_workers, self.stop_grace = roots, max_workers, stop_grace
        self._planning: dict[bytes, asyncio.Future] = {}
        self._slots = asyncio.Semaphore(max_running)
        self._tasks: set[asyncio.Task] = set()

    async def request(self, body) -> tuple[int, dict]:
        """(HTTP status, JSON answer) for a build request; raises BadRequest (400) or SourceRefused (403)."""
        req = parse_body(body, self.max_workers)
        src = self.roots.check(req["src"])
        key = canonical_json({k: v for k, v in body.items() if k not in RUN_KEYS})
        if key not in self._planning:  # one plan for identical requests arriving together
            self._planning[key] = asyncio.ensure_future(asyncio.to_thread(self._plan, src, req))
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
            task = asyncio.create_task(self._run(claim, plan, req["run"]), name=f"build-{plan.id[:8]}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            log.info("build %s of %s asked for, into %s", plan.id, plan.src, claim.record.location)
        return 202, answer

    def _plan(self, src: str, req: dict) -> registry.Plan:
        if "://" not in src:
            self.roots.check_tree(src)
        return registry.plan(src, req["cfg"], shard_size=req["shard_size"], shard_samples=req["shard_samples"],
                             splits=req["splits"])

    async def _run(self, claim: Claim, plan: registry.Plan, run: dict) -> None:
        dataset, owner = plan.id, claim.owner
        started = False
        try:
            await self._wait_for_a_slot(dataset, owner)
            started = True
            try:
                reason = await self._build_process(claim, plan, run)
            except OSError as e:
                reason = f"the build process could not be started: {e}"
            finally:
                self._slots.release()
        except asyncio.CancelledError:  # the server is stopping
            reason = "stopped: the server shut down" + ("" if started else " before the build started")
            await asyncio.to_thread(self.catalog.fail, dataset, owner, reason)
            raise
        if reason:  # a no-op when the build process recorded its own outcome (the record is no longer ours)
            await asyncio.to_thread(self.catalog.fail, dataset, owner, reason)

    async def _wait_for_a_slot(self, dataset: str, owner: dict) -> None:
        """Wait for a free build slot, heartbeating the claim meanwhile so it is not taken for abandoned."""
        while True:
            try:
                await asyncio.wait_for(self._slots.acquire(), HEARTBEAT_SECONDS)
                return
            except TimeoutError:
                await asyncio.to_thread(self.catalog.heartbeat, dataset, owner)

    async def _build_process(self, claim: Claim, plan: registry.Plan, run: dict) -> str | None:
        """Run the build in its own process; None if it exited 0, else what it died of. Cancelled
        (the server stopping), it stops the process: SIGTERM, then after ``stop_grace`` SIGKILL."""
        job = {"catalog": self.catalog.path, "claim": claim, "plan": plan, "ray_address": self.ray_address,
               "workers": run.get("workers"), "videos_per_task": run.get("videos_per_task"),
               "ffmpeg_threads": run.get("ffmpeg_threads", 1), "timeout": run.get("timeout", 600)}
        spawn = asyncio.ensure_future(asyncio.create_subprocess_exec(
            sys.executable, "-m", "service.build_process", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "TQDM_DISABLE": "1"}))  # progress goes to the catalog, not bars in the log
        try:
            proc = await asyncio.shield(spawn)
        except asyncio.CancelledError:  # stopped while starting: stop what was started
            await self._terminate(await spawn, plan.id)
            raise
        log.info("build %s: build process %d started", plan.id, proc.pid)
        try:
            proc.stdin.write(pickle.dumps(job))  # stdin stays open: its end tells the process the server is gone
            await proc.stdin.drain()
            tail = await _relay(proc.stdout, f"build {plan.id[:8]}")
            code = await proc.wait()
        except asyncio.CancelledError:
            await self._terminate(proc, plan.id)
            raise
        finally:
            _kill_group(proc.pid)  # whatever the build left: Ray's daemons and workers share its process group
        if code == 0:
            return None
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        return f"the build process (pid {proc.pid}) {how}" + (f"; its last output: {tail}" if tail else "")

    async def _terminate(self, proc: asyncio.subprocess.Process, dataset: str) -> None:
        """SIGTERM (the build process records why it stops); its group gets SIGKILL after ``stop_grace``."""
        log.info("build %s: stopping build process %d", dataset, proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), self.stop_grace)
        except TimeoutError:
            log.warning("build %s: build process %d did not stop in %.0f s: killed", dataset, proc.pid,
                        self.stop_grace)

    async def stop(self) -> None:
        """Stop every build: queued ones are recorded failed, running ones stopped (``_build_process``)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def _relay(stream: asyncio.StreamReader, prefix: str) -> str:
    """Log a build process's output line by line until it ends; returns its last non-empty line."""
    last, pending = "", b""
    while chunk := await stream.read(1 << 16):
        *lines, pending = re.split(rb"[\r\n]", pending + chunk)
        for line in lines:
            if text := line.decode(errors="replace").strip():
                log.info("%s: %s", prefix, text)
                last = text
        pending = pending[-(1 << 16):]  # a line without an end is cut, not kept growing
    if text := pending.decode(errors="replace").strip():
        log.info("%s: %s", prefix, text)
        last = text
    return last[:500]
