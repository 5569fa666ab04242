"""One build asked for over HTTP, in a process of its own: ``python -m service.build_process``.

``service.builds`` starts one per build, writes the job to its stdin (pickled: the claim the
server made, the plan, the run options) and keeps its stdin open. The process owns its Ray (an
embedded local Ray lives and dies with it; with ``--ray-address`` it joins that cluster) and its
memory, so neither outlives the build nor touches the server. It records the outcome in the
catalog under the server's claim: ready, or failed with the reason, including

  * Ray that cannot be started or joined (the reason as Ray gives it);
  * SIGTERM (the server shutting down stops its builds): ``stopped: ...``;
  * its stdin closing (the server is gone, killed or crashed): ``abandoned: the server ... is gone``;

each recorded, then the process ends at once (``os._exit``): staged work is whole whenever it stops.

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

log = logging.getLogger("service.build")


RAY_START_SECONDS = 120  # starting or joining Ray longer than this fails the build (Ray itself retries ~10 min)


def _stop(cat, dataset: str, owner: dict, reason: str) -> None:
    """Record why the build stops, and end the process at once. Not an exception raised in the
    main thread: raised inside Ray's compiled calls it comes out as a SystemError, its reason lost."""
    log.error("build %s: %s", dataset, reason)
    cat.fail(dataset, owner, reason)  # a no-op when the record is no longer this build's
    os._exit(1)


def _watch_parent(server_pid: int, stop) -> None:
    """Stop the build when the server's end of stdin closes: the server is gone. Reads the raw
    descriptor: a daemon thread blocked in a buffered read would hold its lock at interpreter exit."""
    while os.read(0, 4096):
        pass
    stop(f"abandoned: the server that started this build (pid {server_pid}) is gone")


def run(*, catalog: str, claim, plan, ray_address: str | None, workers: int | None, videos_per_task: int | None,
        ffmpeg_threads: int, timeout: float) -> int:
    """Build ``plan`` under ``claim`` (made by the server); 0 when the set is ready."""
    from ingest import ray_runtime, registry
    from shards.catalog import Catalog

    cat = Catalog(catalog)
    stop = functools.partial(_stop, cat, plan.id, claim.owner)
    threading.Thread(target=_watch_parent, args=(os.getppid(), stop), daemon=True, name="parent-watch").start()
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
    # After ray.init, which installs a SIGTERM handler of its own (sys.exit); recorded from a thread,
    # since the main thread may hold the catalog's write lock when the signal comes.
    reason = "stopped: the build process got SIGTERM (the server shutting down, or an operator)"
    signal.signal(signal.SIGTERM, lambda signum, frame: threading.Thread(target=stop, args=(reason,)).start())
    try:
        registry.run_claimed(cat, claim, plan, address=ray_address, workers=workers,
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
