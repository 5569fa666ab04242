"""One build asked for over HTTP, in a process of its own: ``python -m service.build_process``.

``service.builds`` starts one per build, writes the job to its stdin (pickled: the claim the
server made, the plan, the run options) and keeps its stdin open. The process owns its Ray (an
embedded local Ray lives and dies with it; with ``--ray-address`` it joins that cluster) and its
memory, so neither outlives the build nor touches the server. It records the outcome in the
catalog under the server's claim: ready, or failed with the reason, including

  * Ray that cannot be started or joined (the reason as Ray gives it);
  * SIGTERM (the server shutting down stops its builds): ``stopped: ...``;
  * its stdin closing (the server is gone, killed or crashed): ``abandoned: ...``.

Whatever it cannot record itself (killed by a signal, out of memory) the server records from
its exit status.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading

log = logging.getLogger("service.build")


class Stopped(Exception):
    """The build was asked to stop; the message says by whom."""


_why = ["stopped: the build process got SIGTERM (the server shutting down, or an operator)"]


def _stop_on_sigterm() -> None:
    # Installed after Ray has started: ray.init replaces the SIGTERM handler with its own sys.exit.
    def stop(signum, frame):
        raise Stopped(_why[0])

    signal.signal(signal.SIGTERM, stop)


RAY_START_SECONDS = 120  # starting or joining Ray longer than this fails the build (Ray itself retries ~10 min)


def _watch_parent(server_pid: int) -> None:
    """Stop the build when the server's end of stdin closes: the server is gone. Reads the raw
    descriptor: a daemon thread blocked in a buffered read would hold its lock at interpreter exit."""
    while os.read(0, 4096):
        pass
    _why[0] = f"abandoned: the server that started this build (pid {server_pid}) is gone"
    os.kill(os.getpid(), signal.SIGTERM)


def run(*, catalog: str, claim, plan, ray_address: str | None, workers: int | None, videos_per_task: int,
        ffmpeg_threads: int, timeout: float) -> int:
    """Build ``plan`` under ``claim`` (made by the server); 0 when the set is ready."""
    from ingest import ray_runtime, registry
    from shards.catalog import Catalog

    cat = Catalog(catalog)
    where = f"join the Ray cluster at {ray_address}" if ray_address else "start an embedded Ray"

    def failed(reason: str) -> None:
        cat.fail(plan.id, claim.owner, f"could not {where}: {reason}")
        log.error("build %s: could not %s: %s", plan.id, where, reason)

    started = threading.Event()

    def watchdog():
        if not started.wait(RAY_START_SECONDS):
            failed(f"no answer in {RAY_START_SECONDS} s")
            os._exit(1)

    threading.Thread(target=watchdog, daemon=True, name="ray-watchdog").start()
    try:
        ray_runtime.start(ray_address, workers)
    except Exception as e:  # noqa: BLE001 -- any failure to start or join Ray is the build's outcome
        failed(f"{type(e).__name__}: {e}")
        return 1
    started.set()
    _stop_on_sigterm()
    try:
        registry.run_claimed(cat, claim, plan, address=ray_address, workers=workers,
                             videos_per_task=videos_per_task, threads=ffmpeg_threads, timeout=timeout)
    except Exception as e:  # recorded as failed in the catalog by run_claimed
        log.error("build %s failed: %s: %s", plan.id, type(e).__name__, e)
        return 1
    return 0


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    job = pickle.load(sys.stdin.buffer)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="parent-watch").start()
    return run(**job)


if __name__ == "__main__":
    sys.exit(main())
