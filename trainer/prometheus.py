"""``--push-gateway URL``: the run's own figures pushed to a Prometheus Pushgateway, where the
operators who scrape the dataset service's ``GET /metrics`` watch its readers beside it.

A training run is a batch job: Prometheus cannot scrape it once it has ended, and its ranks come
and go with the job (horovodrun, Slurm). The Pushgateway is Prometheus's way in for such jobs
(prometheus_client's ``push_to_gateway``). Every rank pushes its own group, job ``JOB`` with the
grouping key ``run`` (the output directory's name) and ``rank``, replacing it each time (PUT):
every ``--print-freq`` steps, at each epoch's end and once more as the run closes, so the last push
holds the whole run's figures. Pushes go out from a thread of their own, so a slow or absent
gateway never holds a step; a push that fails is one warning line (the first of a run, and the
first after pushes went through again), and the run goes on. The final push, in ``close``, waits
for the gateway up to ``TIMEOUT`` seconds.

Series, each this rank's (``sum by (run)`` adds the ranks up):

    kf_trainer_steps_total                   optimizer steps taken
    kf_trainer_clips_total                   real clips trained (padding repeats and bad samples never count)
    kf_trainer_clips_per_second              those clips over the steps' time (data + compute) since the
                                             last push
    kf_trainer_data_wait_seconds             histogram: each step's wait for its batch (the data time)
    kf_trainer_step_seconds                  histogram: each step's compute time
    kf_trainer_bad_samples_total{split}      samples the loaders left out (``--max-bad-samples``)
    kf_trainer_source_outages_total          outages the reads met: a reader waiting for a source that is down
                                             (refusing, timing out, 502/503/504), counted once per outage
    kf_trainer_source_outage_seconds_total   seconds the reads waited in them
    kf_trainer_epoch                         the epoch in progress, from 1
    kf_trainer_loss                          the last step's mean loss over its real clips

The outages are counted where the reads are, in the loader's workers, and reach the rank with
each batch (``waits``: ``shards.io.http_range.take_waits``); the rank's own reads (the manifest) are
taken here.
"""
from __future__ import annotations

import logging
import os
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, push_to_gateway

from shards.io.http_range import take_waits

from .hooks import Hook

log = logging.getLogger(__name__)
JOB = "kinetics_fast_train"
TIMEOUT = 5.0  # seconds a push may take
SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def run_name(output_dir: str) -> str:
    """The ``run`` label of a run writing to ``output_dir`` (a path or URL): its last part."""
    return os.path.basename(output_dir.rstrip("/")) or output_dir


class PushGateway(Hook):
    """This rank's figures (module docstring), pushed to ``url`` every ``every`` steps."""

    def __init__(self, url: str, run: str, rank: int, every: int):
        self.url, self.every, self.group = url, every, {"run": run, "rank": str(rank)}
        r = self.registry = CollectorRegistry()
        self.steps = Counter("kf_trainer_steps", "optimizer steps taken", registry=r)
        self.clips = Counter("kf_trainer_clips", "real clips trained", registry=r)
        self.rate = Gauge("kf_trainer_clips_per_second",
                          "real clips over the steps' time since the last push", registry=r)
        self.data_wait = Histogram("kf_trainer_data_wait_seconds", "each step's wait for its batch",
                                   buckets=SECONDS, registry=r)
        self.step_time = Histogram("kf_trainer_step_seconds", "each step's compute time",
                                   buckets=SECONDS, registry=r)
        self.bad = Counter("kf_trainer_bad_samples", "samples the loaders left out (--max-bad-samples)",
                           ("split",), registry=r)
        self.outages = Counter("kf_trainer_source_outages",
                               "outages the reads met, once per reader and outage", registry=r)
        self.outage_seconds = Counter("kf_trainer_source_outage_seconds",
                                      "seconds the reads waited for a source that was down", registry=r)
        self.epoch = Gauge("kf_trainer_epoch", "the epoch in progress, from 1", registry=r)
        self.loss = Gauge("kf_trainer_loss", "the last step's mean loss over its real clips", registry=r)
        self.valid, self.window = 0, [0, 0.0]  # the step's real clips; clips and seconds since the last push
        self.failing, self.closing, self.wanted = False, False, threading.Event()
        self.thread = threading.Thread(target=self._pushing, name="push-gateway", daemon=True)
        self.thread.start()

    # --- the loop's points --------------------------------------------------------------------
    def before_step(self, t, batch: dict) -> None:
        self.epoch.set(t.epoch + 1)
        self.valid = int(batch["valid"].sum())
        # (a multigrid loader batch's parts all carry its lists)
        self._read(batch if batch["period_end"] else {})

    def after_step(self, t, step: dict) -> None:
        self.steps.inc()
        self.clips.inc(self.valid)
        self.data_wait.observe(step["data_time"])
        self.step_time.observe(step["compute_time"])
        self.loss.set(step["loss"] / max(self.valid, 1))
        self.window[0] += self.valid
        self.window[1] += step["data_time"] + step["compute_time"]
        if (t.step + 1) % self.every == 0:  # (t.step moves on after the hooks)
            self._push_soon()

    def validation_batch(self, t, batch: dict | None) -> None:
        self._read(batch or {})

    def at_epoch_end(self, t) -> dict:
        self._push_soon()
        return {}

    def close(self) -> None:
        self.closing = True
        self._push_soon()
        self.thread.join()
        self._read({})
        self._push()

    # --- the figures and their pushes ---------------------------------------------------------
    def _read(self, batch: dict) -> None:
        """What a batch's reads met (its bad samples, its worker's waits) and this process's own waits."""
        for record in batch.get("bad", []):
            self.bad.labels(record["split"]).inc()
        for outages, seconds in (batch.get("waits", (0, 0.0)), take_waits()):
            self.outages.inc(outages)
            self.outage_seconds.inc(seconds)

    def _push_soon(self) -> None:
        clips, seconds = self.window
        if seconds:
            self.rate.set(clips / seconds)
        self.window = [0, 0.0]
        self.wanted.set()

    def _pushing(self) -> None:
        while True:
            self.wanted.wait()
            self.wanted.clear()
            if self.closing:
                return
            self._push()

    def _push(self) -> None:
        try:
            push_to_gateway(self.url, job=JOB, registry=self.registry, grouping_key=self.group,
                            timeout=TIMEOUT)
        except OSError as e:  # refused, timed out, or an answer not 2xx (urllib's errors)
            if not self.failing:
                log.warning("--push-gateway %s: the figures could not be pushed (%s); the run goes on, "
                            "pushing again at the next push", self.url, e)
            self.failing = True
            return
        if self.failing:
            log.warning("--push-gateway %s: the figures are pushed again", self.url)
        self.failing = False
