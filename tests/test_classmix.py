"""The class-mix guard of node-affine epochs (``shards.plan.classmix``): node shares of a set stored in
hashed order pass at every size tried, sets whose order gives nodes their own classes are refused,
and the loader and a real two-node training start refuse (``--shuffle node``) or fall back to
global epochs, said in one line (``--shuffle auto``)."""
from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from helpers.shardsets import clip_loader, make_shardset

from shards.base.errors import UsageError
from shards.format.manifest import Manifest
from shards.plan import classmix, partition

SMALL = dict(crop_size=32, scale_size=36, shuffle_buffer=1, batch_size=2, num_workers=0)


def judged(labels: np.ndarray, per_shard: int, nodes: int, seed: int = 0) -> classmix.Mix | None:
    shards = [labels[i:i + per_shard] for i in range(0, len(labels), per_shard)]
    return classmix.class_mix(shards, partition.assign([len(s) for s in shards], nodes, seed), seed)


def balanced(n: int, classes: int) -> np.ndarray:
    return np.arange(n) % classes


# --- the pure function -------------------------------------------------------------------------
def test_the_divergence_is_the_total_variation_of_each_share_from_the_whole():
    """Worked by hand: shares [0,0,0,1] and [1,1,1,0] of a half-and-half set are each 1/4 away
    (a quarter of a share's clips would have to change class); [0,0] and [1,1] a half; equal
    mixes 0. Unlabelled samples (-1) count in no mix."""
    parts = [np.array([0, 0, 0, 1]), np.array([1, 1, 1, 0])]
    assert classmix.worst_divergence(parts, 2) == (0.25, 0)
    assert classmix.worst_divergence([np.array([0, 0]), np.array([1, 1, -1])], 2) == (0.5, 0)
    assert classmix.worst_divergence([np.array([0, 1, 2]), np.array([2, 1, 0, -1, -1])], 3) == (0.0, 0)
    # the worst node is named: three shares of a 0/1 set, the last all of one class
    tv, node = classmix.worst_divergence([np.array([0, 1]), np.array([1, 0]), np.array([1, 1])], 2)
    assert node == 2 and tv == pytest.approx(1 / 3)


@pytest.mark.parametrize("nodes", [2, 3, 4, 8])
@pytest.mark.parametrize("classes", [2, 4, 10, 50])
def test_shares_of_a_set_in_hashed_order_hold_its_class_mix_at_every_size(nodes, classes):
    """ingest's hashed order is a random one: over 3 set sizes x 2 shard sizes x 4 random orders
    (each with its own run seed) no share is refused, down to 24 clips a node, and the worst node
    stays within the random order's reach (``limit``)."""
    for n in (24 * nodes, 200 * nodes, 2000):
        for per_shard in (7, 64):
            for seed in range(4):
                labels = np.random.default_rng([n, per_shard, seed]).permutation(balanced(n, classes))
                mix = judged(labels, per_shard, nodes, seed)
                assert mix is not None and mix.nodes == nodes
                assert mix.mixed, (n, per_shard, seed, mix)
                assert mix.worst <= mix.limit and 0 <= mix.shuffled <= 1


@pytest.mark.parametrize("nodes", [2, 3, 4, 8])
@pytest.mark.parametrize("per_shard", [12, 40, 300])
def test_a_set_written_class_by_class_whose_shares_split_the_classes_is_refused(nodes, per_shard):
    """One shard per class and as many classes as nodes: each node owns one shard, one class, for
    the whole run, whatever the run seed; also with twice as many nodes as shards (a node owns
    half a shard). (Below about 10 clips a node a random order splits the classes too often for
    the guard to tell: 2 nodes of 5 clips, split by class, pass; a random order splits them so
    once in 126.)"""
    for seed in range(3):
        mix = judged(np.repeat(np.arange(nodes), per_shard), per_shard, nodes, seed)
        assert not mix.mixed and mix.worst == pytest.approx(1 - 1 / nodes)
        assert mix.node_classes == (1,) * nodes and mix.classes == nodes
        if nodes % 2 == 0:  # half as many shards, two classes each: each node half a shard, one class
            mix = judged(np.repeat(np.arange(nodes), per_shard), 2 * per_shard, nodes, seed)
            assert not mix.mixed and mix.node_classes == (1,) * nodes
    assert "node" in mix.describe() and f"of the {mix.classes} classes" in mix.describe()


def test_a_class_sorted_set_cut_into_many_shards_is_refused_whatever_shares_the_run_is_dealt():
    """Node-affine shares are whole shards dealt by the run seed: a class-sorted set of 8 one-class
    shards, 4 classes, on 2 nodes is dealt a shard of every class to each node at some seeds, and the
    node test alone (``shares_mixed``) passes exactly those, the divergence being what the shares' class
    counts give; the stored-order test refuses the set at every seed (its shards are 0.75 from the
    set's mix, a random order's 0.03). So does it the issue-42 case: 2 classes in 12 shards of 5 on 2
    nodes, which the node test alone let through at most seeds."""
    labels = np.repeat(np.arange(4), 256)
    verdicts = Counter()
    for seed in range(40):
        shares = partition.assign([128] * 8, 2, seed)
        counts = Counter(labels[r.shard * 128] for r in shares[0] for _ in range(r.size))
        mix = judged(labels, 128, 2, seed)
        assert mix.worst == pytest.approx(0.5 * sum(abs(counts[c] / 512 - 0.25) for c in range(4)))
        even = set(counts.values()) == {128} and len(counts) == 4
        assert mix.shares_mixed == even, (seed, counts, mix)
        assert not mix.mixed and mix.stored == pytest.approx(0.75) and mix.stored_shuffled < 0.1
        verdicts[even] += 1
    assert verdicts[True] and verdicts[False]  # both deals happen
    assert "its shards are 0.75 from the whole set's class mix" in mix.describe()
    small = [judged(np.repeat(np.arange(2), 30), 5, 2, seed) for seed in range(100)]
    assert sum(m.shares_mixed for m in small) > 50 and not any(m.mixed for m in small)


def test_nothing_to_judge_by_gives_no_verdict_and_says_why():
    """One node, shards whose labels the manifest does not record, or one class: None (not judged), and
    ``unjudged`` names the reason."""
    labels = [np.array([0, 1, 0, 1]), np.array([1, 0, 1, 0])]
    shares = partition.assign([4, 4], 2, 0)
    for cut, why in [((labels, partition.assign([4, 4], 1, 0)), "one node"),
                     (([labels[0], []], shares), "the manifest records no per-sample labels"),
                     (([np.zeros(4, int), np.array([0, 0, -1, -1])], shares),
                      "the labelled clips are of fewer than two classes")]:
        assert classmix.class_mix(*cut) is None and classmix.unjudged(*cut) == why
    assert classmix.class_mix(labels, shares) is not None and classmix.unjudged(labels, shares) is None


def test_the_verdict_is_the_same_on_every_rank_and_under_any_naming_of_classes_or_nodes():
    """Every rank computes it alone, so it must not depend on anything but its inputs: twice the same;
    classes renamed, the same divergence; nodes listed in another order, the same worst share."""
    rng = np.random.default_rng(3)
    labels = np.concatenate([rng.permutation(balanced(300, 3)), np.repeat(np.arange(3), 100)])
    shards = [labels[i:i + 50] for i in range(0, 600, 50)]
    shares = partition.assign([50] * 12, 3, 7)
    mix = classmix.class_mix(shards, shares, 7)
    assert mix == classmix.class_mix(shards, shares, 7)
    renamed = classmix.class_mix([(s + 1) % 3 for s in shards], shares, 7)
    assert renamed.worst == pytest.approx(mix.worst) and renamed.mixed == mix.mixed
    assert classmix.class_mix(shards, shares[::-1], 7).worst == pytest.approx(mix.worst)


# --- the loader --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """40 clips of 2 classes in 2 shards: written class by class (one class a shard), and the same
    clips with the classes alternating."""
    root = tmp_path_factory.mktemp("classmix")
    make_shardset(str(root / "sorted"), {"train": 40}, per_shard=20, num_classes=2, class_sorted=True)
    make_shardset(str(root / "mixed"), {"train": 40}, per_shard=20, num_classes=2)
    return {"sorted": str(root / "sorted"), "mixed": str(root / "mixed")}


def labels_read(loader) -> Counter:
    return Counter(int(label) for batch in loader for label, ok in zip(batch["labels"], batch["valid"]) if ok)


def test_the_loader_refuses_node_affine_epochs_on_a_class_sorted_set(sets):
    with pytest.raises(UsageError) as refused:
        clip_loader(sets["sorted"], "train", rank=1, world_size=2, local_size=1, shuffle="node", **SMALL)
    message = str(refused.value)
    assert message.startswith("--shuffle node: node-affine epochs on 2 nodes would give them different "
                              "classes")
    assert "train's stored order follows the classes" in message and "--shuffle global" in message
    assert "\n" not in message
    # not judged where there is nothing to judge: one node, validation, global epochs
    clip_loader(sets["sorted"], "train", world_size=2, local_size=2, shuffle="node", **SMALL)
    clip_loader(sets["sorted"], "train", world_size=2, local_size=1, shuffle="node", train=False, **SMALL)
    clip_loader(sets["sorted"], "train", world_size=2, local_size=1, shuffle="global", **SMALL)


def test_with_the_fallback_each_rank_reads_both_classes_in_global_epochs(sets, caplog):
    """``shuffle_fallback`` (--shuffle auto): global epochs instead, rank 0 says so in one line; each
    rank then reads clips of both classes in an epoch, where node-affine epochs would have given
    it one class for the run; the mixed set stays node-affine (each node its own shard)."""
    with caplog.at_level("INFO", logger="trainer.data.epochs"):
        ranks = [clip_loader(sets["sorted"], "train", rank=r, world_size=2, local_size=1, shuffle="node",
                             shuffle_fallback=True, **SMALL) for r in (0, 1)]
    said = [r.getMessage() for r in caplog.records if "global epochs, not node-affine" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("--shuffle auto: global epochs, not node-affine: "
                                                 "node-affine epochs on 2 nodes would give them different "
                                                 "classes"), said
    assert ranks[0].describe() == ("train: 40 clips in 2 shards, shuffle node (on 2 nodes the shares would "
                                   "differ in classes: global epochs instead): one order of every shard for "
                                   "the 2 rank(s)")
    for epoch in range(2):
        read = [labels_read(r) for r in ranks]
        assert sum(read, Counter()) == Counter({0: 20, 1: 20})
        assert any(len(r) == 2 for r in read), (epoch, read)

    mixed = [clip_loader(sets["mixed"], "train", rank=r, world_size=2, local_size=1, shuffle="node",
                         shuffle_fallback=True, **SMALL) for r in (0, 1)]
    assert "shuffle node: 2 nodes of 1 rank(s)" in mixed[0].describe()
    shard_of = {k: i for i, s in enumerate(Manifest.load(sets["mixed"]).splits["train"].shards)
                for k in s.keys}
    assert [{shard_of[k] for b in r for k in b["keys"]} for r in mixed] in ([{0}, {1}], [{1}, {0}])
    assert [labels_read(r) for r in mixed] == [Counter({0: 10, 1: 10})] * 2


def test_a_set_without_per_sample_labels_trains_node_affine_saying_it_was_not_judged(sets, caplog):
    """A manifest that records no per-sample labels (another tool's, an older one) cannot be judged:
    node-affine epochs as asked, rank 0 saying so in one line; a labelled set says nothing."""
    manifest = Manifest.load(sets["sorted"])
    for shard in manifest.splits["train"].shards:
        shard.labels = []
    with caplog.at_level("INFO", logger="trainer.data.epochs"):
        ranks = [clip_loader(manifest, "train", rank=r, world_size=2, local_size=1, shuffle="node", **SMALL)
                 for r in (0, 1)]
        clip_loader(sets["mixed"], "train", rank=0, world_size=2, local_size=1, shuffle="node", **SMALL)
    said = [r.getMessage() for r in caplog.records if "not judged" in r.getMessage()]
    assert said == ["--shuffle node: node-affine epochs on 2 nodes, their class mix not judged (train: the "
                    "manifest records no per-sample labels)"], said
    assert "shuffle node: 2 nodes of 1 rank(s)" in ranks[1].describe()


# --- a real start on two simulated nodes ---------------------------------------------------------
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")


def start(data: str, out, *flags: str) -> subprocess.CompletedProcess:
    """``trainer train`` on 2 ranks, each on a host of its own (-H localhost:1,127.0.0.1:1), one epoch."""
    return subprocess.run([HOROVODRUN, "-np", "2", "-H", "localhost:1,127.0.0.1:1", "--gloo", sys.executable,
                           "-m",
                           "trainer", "train", "--data", data, "--output-dir", str(out), "--val-split", "",
                           "--epochs",
                           "1", "--depth", "10", "--width", "4", "--crop-size", "32", "--scale-size", "36",
                           "--batch-size", "2", "--workers", "0", "--no-tensorboard", *flags],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.long
def test_a_two_node_start_on_a_class_sorted_set_refuses_node_and_trains_global_under_auto(sets, tmp_path):
    """--shuffle node: every rank ends with one ``trainer train: error:`` line, status 2, no
    traceback (horovodrun's own report of the failed rank aside), nothing trained. --shuffle auto with a
    node cache: global epochs (the default since issue 42, the cache still used), and the run finishes."""
    p = start(sets["sorted"], tmp_path / "node", "--shuffle", "node")
    lines = {r: [line.split(":", 1)[1] for line in (p.stdout + p.stderr).splitlines()
                 if line.startswith(f"[{r}]<")]
             for r in (0, 1)}
    assert p.returncode == 1 and "Exit code: 2" in p.stderr, p.stderr[-3000:]
    for r in (0, 1):
        assert not [line for line in lines[r] if "Traceback" in line], lines[r]
        errors = [line for line in lines[r] if "trainer train: error: " in line]
        refusal = "--shuffle node: node-affine epochs on 2 nodes would give them different classes"
        assert len(errors) == 1 and refusal in errors[0], lines[r]
    assert not (tmp_path / "node" / "checkpoint.pt").exists()

    p = start(sets["sorted"], tmp_path / "auto", "--cache-dir", str(tmp_path / "cache"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "not node-affine" not in p.stderr and "shuffle global: one order of every shard" in p.stderr
    assert (tmp_path / "auto" / "checkpoint.pt").exists()
