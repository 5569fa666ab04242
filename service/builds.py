"""Builds asked for over HTTP: the request body checked, the dataset id computed, the id claimed
in the catalog, and the ingest run in a build process of its own (``service.build_process``).

Identical requests share one plan while it is being computed and one claim in the catalog,
so any number of them at once make one build; requests for a set that is already ready are
answered with it. At most ``max_running`` build processes run at once (each starts its own
embedded Ray, or joins ``--ray-address``); the others wait their turn, their claims kept alive
by the server's heartbeat. Once started, the build process holds the lease itself
(``Catalog.transfer``). A build process that dies without recording why is recorded failed
from its exit status at once; on shutdown the server stops its builds (SIGTERM, then SIGKILL to
the build's process group) and records them failed.

If the server itself dies (killed, or its host gone), its build processes see their stdin close
and end without recording anything, so their leases die with them (on the same host at once, from
another host when the heartbeats stop: ``shards.catalog.store``). The claim keeps the build's
request, and any server on the catalog (a replica, or this one restarted) takes the build over
(``take_over``: periodically, and whenever a status request finds it orphaned): it plans the
request again and claims the id, which resumes the staged work where the dead builder left it.
The claim decides in one write transaction, so of several replicas trying at once one builds and
the others find it being built: no build runs twice.
"""
from __future__ import annotations

import asyncio
import logging
import os
import pickle
import re
import signal
import sys

from ingest import bounds, registry
from ingest.bounds import BOUNDS
from ingest.clips import ClipConfig
from ingest.decode import DECODERS
from ingest.sources import SPLITS
from shards.base.units import parse_size
from shards.catalog import (
    HEARTBEAT_SECONDS,
    Catalog,
    CatalogUnavailable,
    Claim,
    Record,
    canonical_json,
    new_owner,
)
from shards.io import storage

from .roots import SourceRefused, SourceRoots

log = logging.getLogger("service.builds")

# body key -> (type, where it goes); everything else in a body is refused
CLIP_KEYS = {"frames": int, "clips_per_video": int, "eval_clips": int, "short_side": int, "quality": int,
             "restart_interval": int, "seed": int, "decoder": str}
RUN_KEYS = {"workers": int, "videos_per_task": int, "ffmpeg_threads": int, "timeout": (int, float)}
OTHER_KEYS = {"src": str, "name": str, "shard_size": (int, str), "shard_samples": int, "splits": (list, str)}
# the range of every number a request may give is ingest's (ingest.bounds: the command line's too; anything
# outside is refused); workers: 1 to --max-build-workers


MAX_ATTEMPTS = 5  # a build whose builders died this many times is not taken over again


class BadRequest(ValueError):
    pass


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
        for key in BOUNDS:
            if key in body:
                bounds.check(key, shard_size if key == "shard_size" else body[key])
        cfg = ClipConfig(**{k: body[k] for k in CLIP_KEYS if k in body})
    except ValueError as e:
        raise BadRequest(str(e)) from None
    if "workers" in body and not 1 <= body["workers"] <= max_workers:
        raise BadRequest(f"workers: {body['workers']!r} is outside 1..{max_workers} "
                         "(the server's --max-build-workers)")
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
        self._taking: set[str] = set()  # ids this server is trying to take over
        self._running: set[str] = set()  # ids whose build this server runs: their end is its to record

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
        claim = await asyncio.to_thread(registry.claim, self.catalog, plan, out, req["name"], request=body)
        answer = {"id": plan.id, "state": claim.record.state, "location": claim.record.location,
                  "status_url": f"/v1/builds/{plan.id}", "dataset_url": f"/v1/datasets/{plan.id}"}
        if claim.action == "reuse":
            return 200, answer
        if claim.action == "build":
            self._start(claim, plan, req["run"])
            log.info("build %s of %s asked for, into %s", plan.id, plan.src, claim.record.location)
        return 202, answer

    def _start(self, claim: Claim, plan: registry.Plan, run: dict) -> None:
        task = asyncio.create_task(self._run(claim, plan, run), name=f"build-{plan.id[:8]}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def take_over(self, orphans: list[Record] | None = None) -> list[str]:
        """Take over the builds asked for over HTTP whose builder is gone (``orphans``: those found,
        default: the catalog's): each planned again from its request and claimed; returns the ids
        this server now builds. One whose request no longer plans to its id (its sources changed) or
        is no longer allowed here is recorded failed, saying why. A server that runs no builds (no
        --source-root) leaves them to those that do."""
        if not self.roots:
            return []
        taken = []
        for rec in orphans if orphans is not None else await asyncio.to_thread(self.catalog.orphans):
            if rec.id in self._taking or rec.id in self._running:
                continue
            self._taking.add(rec.id)
            try:
                if await self._take_over(rec):
                    taken.append(rec.id)
            finally:
                self._taking.discard(rec.id)
        return taken

    def take_over_soon(self, rec: Record) -> None:
        """``take_over`` of one orphan in the background (a status request found it)."""
        async def attempt():
            try:
                await self.take_over([rec])
            except CatalogUnavailable as e:
                log.warning("build %s: not taken over: %s", rec.id, e)

        if rec.id not in self._taking:
            task = asyncio.create_task(attempt(), name=f"take-over-{rec.id[:8]}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _take_over(self, rec: Record) -> bool:
        who = f"{rec.owner.get('host')} pid {rec.owner.get('pid')}" if rec.owner else "its builder"
        if rec.attempts >= MAX_ATTEMPTS:  # whatever kills its builders may be the build itself
            await asyncio.to_thread(self.catalog.fail_orphan, rec.id,
                                    f"abandoned: its builder ({who}) is gone, "
                                    f"after {rec.attempts} attempts; not taken over again: ask for it again")
            return False
        try:
            req = parse_body(rec.request, self.max_workers)
            src = self.roots.check(req["src"])
            plan = await asyncio.to_thread(self._plan, src, req)
        except (BadRequest, SourceRefused, FileNotFoundError, ValueError) as e:
            reason = f"abandoned: its builder ({who}) is gone, and it cannot be taken over here: {e}"
            await asyncio.to_thread(self.catalog.fail_orphan, rec.id, reason)
            return False
        if plan.id != rec.id:
            reason = (f"abandoned: its builder ({who}) is gone, and its sources changed since it was asked "
                      f"for (they now make dataset {plan.id}); ask for it again")
            await asyncio.to_thread(self.catalog.fail_orphan, rec.id, reason)
            return False
        claim = await asyncio.to_thread(registry.claim, self.catalog, plan, rec.location, None,
                                        request=rec.request)
        if claim.action != "build":
            return False  # another replica was first, or it was finished meanwhile
        log.warning("build %s: its builder (%s) is gone; taken over (attempt %d), resuming in %s", rec.id,
                    who, claim.record.attempts, claim.record.location)
        self._start(claim, plan, req["run"])
        return True

    def _plan(self, src: str, req: dict) -> registry.Plan:
        if "://" not in src:
            self.roots.check_tree(src)
        return registry.plan(src, req["cfg"], shard_size=req["shard_size"],
                             shard_samples=req["shard_samples"], splits=req["splits"])

    async def _run(self, claim: Claim, plan: registry.Plan, run: dict) -> None:
        dataset, holder = plan.id, [claim.owner]  # the lease's owner: this server, then its build process
        self._running.add(dataset)
        try:
            await self._run_claimed(dataset, holder, claim, plan, run)
        finally:
            self._running.discard(dataset)

    async def _run_claimed(self, dataset: str, holder: list, claim: Claim, plan: registry.Plan,
                           run: dict) -> None:
        started = False
        try:
            await self._wait_for_a_slot(dataset, claim.owner)
            started = True
            try:
                reason = await self._build_process(claim, plan, run, holder)
            except OSError as e:
                reason = f"the build process could not be started: {e}"
            finally:
                self._slots.release()
        except asyncio.CancelledError:  # the server is stopping
            reason = "stopped: the server shut down" + ("" if started else " before the build started")
            await self._record_failed(dataset, holder[0], reason)
            raise
        if reason:  # a no-op when the build process recorded its own outcome (the record is no longer ours)
            await self._record_failed(dataset, holder[0], reason)

    async def _record_failed(self, dataset: str, owner: dict, reason: str) -> None:
        """Record the build failed; with the catalog unreachable, its lease is left to lapse (and a
        replica to take the build over)."""
        try:
            await asyncio.to_thread(self.catalog.fail, dataset, owner, reason)
        except CatalogUnavailable as e:
            log.error("build %s: %s; not recorded: %s", dataset, reason, e)

    async def _wait_for_a_slot(self, dataset: str, owner: dict) -> None:
        """Wait for a free build slot, heartbeating the claim meanwhile so it is not taken for abandoned."""
        while True:
            try:
                await asyncio.wait_for(self._slots.acquire(), HEARTBEAT_SECONDS)
                return
            except TimeoutError:
                try:
                    await asyncio.to_thread(self.catalog.heartbeat, dataset, owner)
                except CatalogUnavailable as e:
                    log.warning("build %s: heartbeat not recorded: %s", dataset, e)

    async def _build_process(self, claim: Claim, plan: registry.Plan, run: dict, holder: list) -> str | None:
        """Run the build in its own process, which holds the lease from its start (``holder[0]``
        becomes its owner); None if it exited 0, else what it died of. Cancelled (the server
        stopping), it stops the process: SIGTERM, then after ``stop_grace`` SIGKILL."""
        spawn = asyncio.ensure_future(asyncio.create_subprocess_exec(
            sys.executable, "-m", "service.build_process", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "TQDM_DISABLE": "1"}))  # progress goes to the catalog, not bars in the log
        try:
            proc = await asyncio.shield(spawn)
        except asyncio.CancelledError:  # stopped while starting: stop what was started
            await self._terminate(await spawn, plan.id)
            raise
        try:
            owner = {**new_owner(), "pid": proc.pid}
            if not await asyncio.to_thread(self.catalog.transfer, plan.id, claim.owner, owner):
                proc.kill()  # the record is no longer this server's: nothing to build
                await proc.wait()
                return None
            holder[0] = owner
            log.info("build %s: build process %d started, holding the lease", plan.id, proc.pid)
            job = {"catalog": self.catalog.path, "claim": Claim(claim.action, claim.record, owner),
                   "plan": plan, "ray_address": self.ray_address, "workers": run.get("workers"),
                   "videos_per_task": run.get("videos_per_task"),
                   "ffmpeg_threads": run.get("ffmpeg_threads", 1), "timeout": run.get("timeout", 600)}
            # stdin stays open: its end tells the process the server is gone
            proc.stdin.write(pickle.dumps(job))
            await proc.stdin.drain()
            tail = await _relay(proc.stdout, f"build {plan.id[:8]}")
            code = await proc.wait()
        except asyncio.CancelledError:
            await self._terminate(proc, plan.id)
            raise
        finally:
            # whatever the build left: Ray's daemons and workers share its process group
            _kill_group(proc.pid)
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
