"""The loader with node-affine epochs and the node cache, against a real HTTP server: ranks of a
node stream through one budget smaller than their shares, the first batch comes while later
shards still download, and each node downloads its pieces once in a run of several epochs."""
import multiprocessing
import multiprocessing.forkserver
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers.shardsets import clip_loader, make_shardset, serve

from shards.format.manifest import Manifest
from shards.plan import partition
from shards.read.cache import CacheFull
from trainer import clip_log

SMALL = dict(crop_size=32, scale_size=36, shuffle_buffer=1, batch_size=2)


@pytest.fixture(scope="module")
def forty(tmp_path_factory):
    """40 clips in 8 shards (as in the issue's reproduction)."""
    d = str(tmp_path_factory.mktemp("forty"))
    make_shardset(d, {"train": 40}, per_shard=5)
    return d


def keys(batches):
    return [k for b in batches for k, ok in zip(b["keys"], b["valid"].tolist()) if ok]


@pytest.fixture(scope="module")
def rank_processes():
    """A context for rank processes, forked from a fork server that has imported the loader once
    (not forked from this pytest worker, whose other threads may hold locks at the fork: torch's
    shared memory then hangs; nor spawned, which imports torch again for every rank). The server
    is stopped at the end (``_stop``: the standard library's own tests stop it so)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    yield ctx
    multiprocessing.forkserver._forkserver._stop()



def run_ranks(ranks: list, out) -> dict:
    """Start the rank processes together; -> what each put on ``out`` (rank -> its answer), once all ended."""
    for p in ranks:
        p.start()
    got = dict(out.get(timeout=300) for _ in ranks)
    for p in ranks:
        p.join()
    return got

def _rank(url, rank, cache, budget, epochs, out, world_size=2, num_workers=1, lookahead=2):
    """One rank of a job of two-rank nodes: its clips of each epoch, or what went wrong."""
    try:
        loader = clip_loader(url, "train", rank=rank, world_size=world_size, local_size=2, shuffle="node",
                             seed=0, num_workers=num_workers, cache_dir=cache, cache_budget=budget,
                             lookahead=lookahead, **SMALL)
        out.put((rank, [keys(loader) for _ in range(epochs)]))
    except Exception as e:  # reported to the test
        out.put((rank, repr(e)))


def test_two_ranks_of_a_node_stream_through_one_budget_smaller_than_their_shares(
        forty, tmp_path, rank_processes):
    """Budget 0.7x the split (each rank's share fits, both together do not): both ranks finish two
    epochs, every clip once per epoch, no CacheFull."""
    split = Manifest.load(forty).splits["train"]
    budget = int(0.7 * sum(s.bytes for s in split.shards))
    ctx = rank_processes
    out = ctx.Queue()
    with serve(forty) as (url, _):
        ranks = [ctx.Process(target=_rank, args=(url, r, str(tmp_path / "cache"), budget, 2, out))
                 for r in (0, 1)]
        got = run_ranks(ranks, out)
    assert all(isinstance(v, list) for v in got.values()), got
    for epoch in range(2):
        clips = Counter(k for r in (0, 1) for k in got[r][epoch])
        assert len(clips) == 40 and set(clips.values()) == {1}


def test_a_budget_below_the_nodes_lookahead_is_refused_before_any_download(forty, tmp_path):
    with serve(forty) as (url, requests):
        loader = clip_loader(url, "train", rank=1, world_size=4, local_size=2, shuffle="node", num_workers=2,
                            cache_dir=str(tmp_path), cache_budget="100kB", lookahead=3, **SMALL)
        with pytest.raises(CacheFull, match=r"a cache budget of 100,000 bytes cannot hold the lookahead of "
                                            r"this node's 2 ranks x 2 loader workers x 3 shards of up to "
                                            r"[\d,]+ bytes \([\d,]+ bytes\)"):
            next(iter(loader))
        assert not [p for _, p in requests if p.endswith(".tar")]


def test_a_refusal_in_a_loader_worker_comes_to_the_rank_as_its_one_line(forty, tmp_path):
    """The up-front check switched off on this loader's cache, the budget is first met in a loader
    worker: the rank raises the cache's own one-line CacheFull, not PyTorch's re-raise of it with
    the worker's traceback for its message."""
    with serve(forty) as (url, _):
        loader = clip_loader(url, "train", num_workers=1, cache_dir=str(tmp_path), cache_budget=1000, **SMALL)
        # the worker inherits it: the budget itself refuses there
        loader.cache.reserve = lambda nbytes, what: None
        with pytest.raises(CacheFull) as refused:
            next(iter(loader))
    assert re.fullmatch(rf"{tmp_path}: this process pins 0 of the 1,000-byte budget; no room for [\d,]+ more",
                        str(refused.value)), str(refused.value)


def wait_for(condition, what, seconds=60):
    """Hold the test until ``condition()`` (a hang fails it, naming what never happened)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("cached", [True, False])
def test_the_first_batch_comes_while_later_shards_still_download(forty, tmp_path, cached):
    """The server answers the first shard asked for and holds every other until the test has the
    first batch: the batch (of one clip) must come out of the first shard alone, and while the
    test holds the loader there, the next shard must be asked for (through the node cache, or read
    ahead without one)."""
    first, held, release = [], [], threading.Event()

    def gate(path, start, end):
        if not path.endswith(".tar"):
            return
        first.append(first[0] if first else path)
        if path != first[0]:
            held.append(path)
            release.wait(120)
    waiter = ThreadPoolExecutor(1)
    with serve(forty, gate) as (url, _):
        loader = clip_loader(url, "train", num_workers=0, cache_dir=str(tmp_path) if cached else None,
                             lookahead=2, **(SMALL | {"batch_size": 1}))
        batches = iter(loader)
        try:
            batch = waiter.submit(next, batches).result(timeout=120)  # a hang fails
            wait_for(lambda: held, "the next shard asked for while the loader stands at its first batch")
        finally:
            release.set()
        rest = list(batches)
        waiter.shutdown()
    assert sorted(keys([batch] + rest)) == sorted(k for s in Manifest.load(forty).splits["train"].shards
                                                  for k in s.keys)


def test_each_node_downloads_its_pieces_once_in_a_run(tmp_path, rank_processes):
    """Two nodes of two ranks, the four ranks running at once for two epochs; nine shards, one of
    them split between the nodes; each node's cache budget exactly the bytes it owns (its whole
    shards and its piece of the split one, ``shards.plan.partition.assign``), and each node reading
    through a server of its own: every clip once per epoch, and each node asks for each byte range
    it owns exactly once in the run, and for nothing else."""
    d = str(tmp_path / "set")
    make_shardset(d, {"train": 45}, per_shard=5)
    shards = Manifest.load(d).splits["train"].shards
    def copy(run):  # a whole shard, or the bytes of its samples the node owns
        shard = shards[run.shard]
        if run.size == shard.num_samples:
            return f"/{shard.name}", 0, shard.bytes
        return (f"/{shard.name}", shard.offsets[run.start],
                shard.offsets[run.stop - 1] + shard.lengths[run.stop - 1])
    owned = [{copy(run) for run in runs} for runs in partition.assign([s.num_samples for s in shards], 2, 0)]
    assert sorted(len({p for p, _, _ in o}) for o in owned) == [5, 5]  # 4 whole shards each and a shared one
    asked = [[], []]
    ctx = rank_processes
    out = ctx.Queue()
    with serve(d, lambda path, start, end: asked[0].append((path, start, end))) as (url0, _), \
            serve(d, lambda path, start, end: asked[1].append((path, start, end))) as (url1, _):
        ranks = [ctx.Process(target=_rank, args=(url, rank, str(tmp_path / f"node{node}"),
                                                 sum(b - a for _, a, b in owned[node]), 2, out),
                             kwargs=dict(world_size=4, num_workers=0, lookahead=1))
                 for node, url in ((0, url0), (1, url1)) for rank in (2 * node, 2 * node + 1)]
        got = run_ranks(ranks, out)
    assert all(isinstance(v, list) for v in got.values()), got
    for epoch in range(2):
        clips = Counter(k for r in range(4) for k in got[r][epoch])
        assert len(clips) == 45 and set(clips.values()) == {1}, epoch
    for node in (0, 1):
        assert sorted(asked[node]) == sorted(owned[node]), node  # each once, nothing else


@pytest.mark.parametrize("before,after", [((2, 2), (3, 1)), ((2, 2), (1, 3)), ((1, 4), (2, 1))])
def test_node_affine_resume_with_other_nodes_covers_the_epoch_once(forty, before, after):
    """Two batches per rank on (nodes, ranks per node) ``before``, then the rest of the epoch from
    rank 0's state on ``after``: every clip once (node counts change: the rest is split anew)."""
    def loaders(nodes, per_node, mode="node"):
        return [clip_loader(forty, "train", rank=r, world_size=nodes * per_node, local_size=per_node,
                            shuffle=mode, seed=3, num_workers=1, **SMALL) for r in range(nodes * per_node)]
    first, got = loaders(*before), Counter()
    for loader in first:
        batches = iter(loader)
        got.update(keys([next(batches), next(batches)]))
        batches.close()
    state = first[0].state_dict()
    for loader in loaders(*after, mode="global" if after[0] == 1 else "node"):
        loader.load_state_dict(state)
        got.update(keys(loader))
    assert len(got) == 40 and set(got.values()) == {1}


@pytest.mark.parametrize("hosts,expect", [
    ("aaabbb", 3),  # 2 hosts x 3 slots: nodes of 3
    ("ab", 1),  # test_cluster_horovod's two single-slot "hosts"
    ("aabbc", 1),  # hosts of 2, 2 and 1: every rank its own node
    ("abbccc", 1),  # 1, 2 and 3 ranks (the old per-rank guess gave host c's middle rank 3)
    ("aab", 1),  # -H localhost:2,127.0.0.1:1
    ("abab", 1),  # ranks not placed host by host
    ("aaaa", 4),
    ("a", 1),
])
def test_every_rank_derives_the_same_node_size_from_the_gathered_hosts(hosts, expect):
    from trainer.distributed.backends import node_size
    assert node_size(list(hosts)) == expect


HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")


def test_hosts_of_unequal_rank_counts_agree_and_cover_the_epoch_once(forty, tmp_path):
    """horovodrun -np 3 -H localhost:2,127.0.0.1:1: node-affine epochs over hosts of 2 and 1 ranks.
    Every rank takes the one layout the gathered hosts give (every rank a node of its own), rank 0
    says so once, and the epoch's steps (the clip log) train on every clip exactly once."""
    out = tmp_path / "run"
    p = subprocess.run([HOROVODRUN, "-np", "3", "-H", "localhost:2,127.0.0.1:1", "--gloo", sys.executable,
                        "-m", "trainer", "train", "--data", forty, "--output-dir", str(out),
                        "--shuffle", "node", "--val-split", "", "--epochs", "1", "--depth", "10",
                        "--width", "4", "--crop-size", "32", "--scale-size", "36", "--batch-size", "2",
                        "--workers", "0", "--no-tensorboard", "--clip-log"],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    said = [line for line in p.stderr.splitlines() if "node-affine epochs take every rank as a node" in line]
    assert len(said) == 1 and said[0].startswith("[0]") and "(localhost 2, 127.0.0.1 1)" in said[0], said
    records = clip_log.read(str(out))
    assert sorted(r["rank"] for r in records if r["batch"] == 0) == [0, 1, 2]
    trained = Counter(k for r in records for k in r["keys"])
    assert trained == Counter(k for s in Manifest.load(forty).splits["train"].shards for k in s.keys)


def test_the_loaders_line_says_how_many_nodes_and_what_each_reads(forty):
    """The line the trainer logs on rank 0 (``describe``) against what the ranks read in an epoch:
    node-affine on 2 nodes of 2 ranks names the shards each node's ranks really read; one node of
    every rank is said to be the global mode."""
    shard_of = {k: i for i, s in enumerate(Manifest.load(forty).splits["train"].shards) for k in s.keys}
    ranks = [clip_loader(forty, "train", rank=r, world_size=4, local_size=2, shuffle="node", num_workers=0,
                         **SMALL)
             for r in range(4)]
    read = [{shard_of[k] for r in (2 * n, 2 * n + 1) for k in keys(ranks[r])} for n in (0, 1)]
    assert not read[0] & read[1]
    counts = sorted(map(len, read))
    assert ranks[0].describe() == (f"train: 40 clips in 8 shards, shuffle node: 2 nodes of 2 rank(s), each "
                                   f"reading only its own shards for the whole run ({counts[0]}-{counts[1]} "
                                   "shards, 20-20 clips a node)")
    one = clip_loader(forty, "train", world_size=2, local_size=2, shuffle="node", num_workers=0, **SMALL)
    assert one.describe() == ("train: 40 clips in 8 shards, shuffle node (one node: the same as global): one "
                              "order of every shard for the 2 rank(s)")


@pytest.mark.parametrize("cache, average_every, growth, given, expect", [
    # node-affine not shown equivalent (node-affine-equivalence.md)
    ("/cache", None, "off", "auto", "global"),
    (None, None, "off", "auto", "global"),
    ("/cache", 4, "off", "auto", "global"),  # K-step averaging and batch growth by the same rule
    ("/cache", None, "noise", "auto", "global"),
    ("/cache", 4, "off", "node", "node"),  # as asked
    ("/cache", None, "noise", "node", "node"),
    ("/cache", None, "off", "global", "global"),
])
def test_auto_shuffle_is_global_for_every_schedule_and_node_affine_only_when_asked(
        cache, average_every, growth,
                                                                                   given, expect):
    from trainer import config
    from trainer.train import shuffle_mode
    cfg = config.TrainConfig(data=config.Data(data="set", cache_dir=cache, shuffle=given),
                             schedules=config.Schedules(average_every=average_every, batch_growth=growth))
    assert shuffle_mode(cfg) == expect
