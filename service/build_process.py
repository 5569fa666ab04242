"""One build asked for over HTTP, in a process of its own: ``python -m service.build_process``.

``service.builds`` starts one per build, hands it the lease of the claim (so the lease ends with
this process), writes the job to its stdin (pickled: the claim, the plan, the run options) and
keeps its stdin open. The process owns its Ray (an embedded local Ray lives and dies with it; with
``--ray-address`` it joins that cluster) and its memory, so neither outlives the build nor touches
the server. It heartbeats the lease from its start (starting Ray may take minutes) and records the
outcome in the catalog: ready, or failed with the reason, including

  * Ray that cannot be started or joined (the reason as Ray gives it);
  * SIGTERM (the server shutting down stops its builds): ``stopped: ...``;

each recorded, then the process ends at once (``os._exit``): staged work is whole whenever it stops.

When its stdin closes (the server is gone, killed or crashed), or another process has taken the
record over, it ends at once recording nothing: the record stays building under a lease that dies
with this process, and a server on the catalog takes the build over (``service.builds``).

Whatever it cannot record itself (killed by a signal, out of memory) the server records from
its exit status.
"""
from __future__ import annotations

import functools
import logging
import os
import pickle
import signal
import sys
import threading

from shards.catalog import CatalogUnavailable

log = logging.getLogger("service.build")


# starting or joining Ray longer than this fails the build (Ray itself retries ~10 min)
RAY_START_SECONDS = 120


def _stop(cat, dataset: str, owner: dict, reason: str) -> None:
    """Record why the build stops, and end the process at once. Not an exception raised in the
    main thread: raised inside Ray's compiled calls it comes out as a SystemError, its reason lost."""
    log.error("build %s: %s", dataset, reason)
    try:
        cat.fail(dataset, owner, reason)  # a no-op when the record is no longer this build's
    except CatalogUnavailable as e:  # the lease dies with this process: a server takes the build over
        log.error("build %s: not recorded: %s", dataset, e)
    os._exit(1)


def _leave(dataset: str, why: str) -> None:
    """End the process at once recording nothing: the lease dies with it (module docstring)."""
    log.error("build %s: %s; stopping, the build left for a server to take over", dataset, why)
    os._exit(1)


def _watch_parent(server_pid: int, dataset: str) -> None:
    """Stop the build when the server's end of stdin closes: the server is gone. Reads the raw
    descriptor: a daemon thread blocked in a buffered read would hold its lock at interpreter exit."""
    while os.read(0, 4096):
        pass
    _leave(dataset, f"the server that started this build (pid {server_pid}) is gone")


def run(*, catalog: str, claim, plan, ray_address: str | None, workers: int | None,
        videos_per_task: int | None, ffmpeg_threads: int, timeout: float) -> int:
    """Build ``plan`` under ``claim`` (made by the server); 0 when the set is ready."""
    from ingest import registry
    from ingest.tasks import ray_runtime
    from shards.catalog import Catalog

    cat = Catalog(catalog)
    stop = functools.partial(_stop, cat, plan.id, claim.owner)
    lost = functools.partial(_leave, plan.id, "another process has taken the build over")
    threading.Thread(target=_watch_parent, args=(os.getppid(), plan.id), daemon=True,
                     name="parent-watch").start()
    starting = registry.keep_alive(cat, plan.id, claim.owner, lost)
    where = f"join the Ray cluster at {ray_address}" if ray_address else "start an embedded Ray"
    started = threading.Event()

    def watchdog():
        if not started.wait(RAY_START_SECONDS):
            stop(f"could not {where}: no answer in {RAY_START_SECONDS} s")

    threading.Thread(target=watchdog, daemon=True, name="ray-watchdog").start()
    try:
        ray_runtime.start(ray_address, workers)
    except Exception as e:  # noqa: BLE001 -- any failure to start or join Ray is the build's outcome
        cat.fail(plan.id, claim.owner, f"could not {where}: {type(e).__name__}: {e}")
        log.error("build %s: could not %s: %s", plan.id, where, e)
        return 1
    started.set()
    starting.set()  # run_claimed heartbeats from here on
    # After ray.init, which installs a SIGTERM handler of its own (sys.exit); recorded from a thread,
    # since the main thread may hold the catalog's write lock when the signal comes.
    reason = "stopped: the build process got SIGTERM (the server shutting down, or an operator)"
    signal.signal(signal.SIGTERM, lambda signum, frame: threading.Thread(target=stop, args=(reason,)).start())
    try:
        registry.run_claimed(cat, claim, plan, address=ray_address, workers=workers, lost=lost,
                             videos_per_task=videos_per_task, threads=ffmpeg_threads, timeout=timeout)
    except Exception as e:  # recorded as failed in the catalog by run_claimed
        log.error("build %s failed: %s: %s", plan.id, type(e).__name__, e)
        return 1
    return 0


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    return run(**pickle.load(sys.stdin.buffer))


if __name__ == "__main__":
    sys.exit(main())
