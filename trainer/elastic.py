"""Train under Horovod Elastic: a rank that dies does not end the job; ranks may come and go.

The same training as ``trainer train`` (every flag of it) with Horovod Elastic around the loop:
the state is committed in memory every ``--commit-every`` steps and at each epoch end; when a
rank dies the others roll back to the last commit, re-form without it and continue the epoch
with the clips left (each exactly once, the loader's elastic resume) at the learning rate of
the new global batch; a rank that comes back joins at the next commit with rank 0's state.
Launch it with a host discovery script and rank bounds, one host name per slot on one machine:

    horovodrun -np 4 --min-np 2 --max-np 4 --host-discovery-script "scripts/discover-hosts.sh hosts.txt" \\
        --blacklist-cooldown-range 10 60 --gloo-timeout-seconds 60 trainer elastic --data shards/k400 ...

Details, commit frequency against work lost, and caveats: docs/elastic.md.
"""
from __future__ import annotations

import logging

from . import config, train
from .clip_log import ClipLog, weights_digest
from .errors import ConfigError

log = logging.getLogger("trainer.elastic")


def elastic_train(t: train.Trainer, stop: train.StopFlag, commit_every: int) -> int:
    """``trainer.train.train`` under ``hvd.elastic.run``, committing after steps and epochs;
    returns its signal (0: finished)."""
    from .elastic_state import ElasticState

    hvd = t.backend.hvd
    state = ElasticState(t, hvd, commit_every)
    if t.cfg.system.clip_log:
        t.hooks.append(ClipLog(t.cfg.system.output_dir, generation=lambda: state.generation))
    t.hooks.append(state)  # commits at the step boundaries and epoch ends (after any periodic checkpoint)

    @hvd.elastic.run
    def train_in_ring(state: ElasticState) -> int:
        if not state.started:  # the first ring, all together (a joining rank gets started=True from rank 0)
            t.start()
            state.started = True
            state.commit()
        return train.train(t, stop)

    signum = train_in_ring(state)
    log.info("rank %d of %d: finished with %d commits (%.1f ms each), %d re-formations, %d steps lost; "
             "weights sha256 %s", t.backend.rank, t.backend.size, state.commits,
             1e3 * state.commit_seconds / max(state.commits, 1), state.resets, state.steps_lost,
             weights_digest(t.engine.model.named_parameters()))
    return signum


def main(cfg: config.TrainConfig, elastic: config.Elastic) -> int:
    if cfg.system.backend != "horovod":
        raise ConfigError("Horovod Elastic needs --backend horovod")
    return train.main(cfg, elastic=lambda t, stop: elastic_train(t, stop, elastic.commit_every))

