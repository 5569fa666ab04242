"""Does each node's share of a node-affine run hold the whole set's mix of classes? Pure functions, no I/O.

Node-affine epochs (``shards.plan.partition.assign``) give node k the same samples for the whole run.
That is harmless when the stored order mixes the classes (ingest's hashed order: every node's
share is then a random sample of the set) and harmful when the order follows the classes or the
sources (a set another tool wrote class by class or video by video): each node would train on its
own classes for the whole run, and every rank's gradients and BN statistics would follow them.

The measure, from the class labels the manifest records per sample (``ShardInfo.labels``):

* node k's divergence: the total variation distance between its share's class distribution
  p_k and the whole set's q, TV_k = 1/2 sum_c |p_k(c) - q(c)| (0: the same mix; 1: no class in
  common; the share of clips that would have to change class); the set's, ``worst``: the
  largest TV_k over the nodes;
* ``worst`` depends on the sizes as much as on the order (a random share of n clips of C
  classes is off by about 1/2 sqrt(2 C / (pi n)): 0.02 at 512 clips of 4 classes, 0.28 at 940
  clips of 400), so it is set against what the set's own labels give over the same shares in a
  random order (ingest's hashed order): ``shuffled``, the mean and spread of ``worst`` over
  ``ROUNDS`` seeded permutations of the labels;
* node shares count as differing in classes when ``worst`` exceeds the random order's mean by
  more than ``MARGIN`` and by more than ``SPREADS`` of its standard deviations: a difference
  both large (a tenth of a node's clips in other classes than chance puts there) and far
  outside what a random order reaches at these sizes (the margin grows for tiny sets, whose
  random shares already differ a lot).

The shares are the run's own (``partition.assign`` deals whole shards to the nodes with the run's
seed), so a class-sorted set cut into many shards may by chance be dealt nearly balanced shares: at
small sizes a share 2:1 in classes that should be 1:1 is within a random order's reach, and the node
test alone passed such sets at most seeds. So the stored order is judged too, by the same rule: the
shards' own divergence from the whole set's mix (``stored``: their mean TV, weighted by their clips),
against the same labels' in a random order (the same permutations). A set whose shards hold far
fewer classes than chance puts there (one written class by class, or a class range after another) is
refused whatever the deal; a hashed set's shards are random samples and pass.

``unjudged`` says why a set cannot be judged (its manifest records no per-sample labels, one class,
one node): the loader says so in one line and trains the mode asked for. ``bench/classmix.py``
prints what each kind of order gives at the benchmarks' sizes and Kinetics', and the false-pass rate
on class-sorted sets over seeds, nodes and class counts (docs/benchmarks/classmix.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .partition import Run

MARGIN = 0.1  # total variation beyond a random order's above which node shares differ in classes ...
SPREADS = 4  # ... if also this many of its standard deviations beyond it
ROUNDS = 32  # random permutations for the random order's mean and spread


@dataclass(frozen=True)
class Mix:
    """How node shares' class mixes differ from the whole set's (see the module docstring)."""
    nodes: int
    worst: float  # the largest node's total variation distance from the whole set
    node: int  # the node it is on
    shuffled: float  # ``worst`` of the same shares with the labels in random order: mean ...
    spread: float  # ... and standard deviation over ``ROUNDS`` orders
    classes: int  # classes in the set (labelled samples)
    node_classes: tuple[int, ...]  # classes present in each node's share
    stored: float = 0.0  # the shards' mean total variation from the whole set (weighted by their clips) ...
    stored_shuffled: float = 0.0  # ... and in a random order: mean ...
    stored_spread: float = 0.0  # ... and standard deviation over the same ``ROUNDS`` orders

    @property
    def limit(self) -> float:
        """``worst`` above this: node shares differ in classes."""
        return self.shuffled + max(MARGIN, SPREADS * self.spread)

    @property
    def stored_limit(self) -> float:
        """``stored`` above this: the stored order follows the classes."""
        return self.stored_shuffled + max(MARGIN, SPREADS * self.stored_spread)

    @property
    def shares_mixed(self) -> bool:
        """The node test alone: the shares this run is dealt hold the set's mix."""
        return self.worst <= self.limit

    @property
    def mixed(self) -> bool:
        return self.shares_mixed and self.stored <= self.stored_limit

    def describe(self) -> str:
        shares = (f"node {self.node}'s share is {self.worst:.2f} from the whole set's class mix (total "
                  f"variation; in a random order {self.shuffled:.2f} +- {self.spread:.2f}, limit "
                  f"{self.limit:.2f}); the {self.nodes} node shares hold "
                  f"{min(self.node_classes)}-{max(self.node_classes)} of the {self.classes} classes")
        if self.stored <= self.stored_limit:
            return shares
        return (f"its shards are {self.stored:.2f} from the whole set's class mix on average (in a random "
                f"order {self.stored_shuffled:.2f} +- {self.stored_spread:.2f}, limit "
                f"{self.stored_limit:.2f}), so any deal of them can split the classes; this run's: {shares}")


def share_labels(labels: Sequence[Sequence[int]], shares: Sequence[Sequence[Run]]) -> list[np.ndarray]:
    """The class labels of each node's share: ``labels[shard][sample]`` over the runs it owns."""
    return [np.concatenate([np.asarray(labels[r.shard][r.start:r.stop], dtype=np.int64) for r in runs] or
                           [np.zeros(0, dtype=np.int64)]) for runs in shares]


def divergences(parts: Sequence[np.ndarray], classes: int) -> tuple[np.ndarray, np.ndarray]:
    """(each part's total variation distance of its class distribution from all parts' together, each
    part's labelled samples); labels < 0 (unlabelled) left out, parts without labels count as 0."""
    counts = np.stack([np.bincount(p[p >= 0], minlength=classes) for p in parts]).astype(float)
    whole = counts.sum(axis=0)
    q = whole / whole.sum()
    sizes = counts.sum(axis=1, keepdims=True)
    p = np.divide(counts, sizes, out=np.zeros_like(counts), where=sizes > 0)
    return np.where(sizes[:, 0] > 0, 0.5 * np.abs(p - q).sum(axis=1), 0.0), sizes[:, 0]


def worst_divergence(parts: Sequence[np.ndarray], classes: int) -> tuple[float, int]:
    """(largest total variation distance of a part's class distribution from all parts' together,
    the part it is on); labels < 0 (unlabelled) left out, parts without labels count as 0."""
    tv, _ = divergences(parts, classes)
    k = int(np.argmax(tv))
    return float(tv[k]), k


def mean_divergence(parts: Sequence[np.ndarray], classes: int) -> float:
    """The parts' total variation distances from all parts' together, averaged weighted by their labelled
    samples (the share of all clips that would have to change class for every part to hold the mix)."""
    tv, sizes = divergences(parts, classes)
    return float((tv * sizes).sum() / sizes.sum())


def _split(flat: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    return np.split(flat, np.cumsum(sizes)[:-1])


def unjudged(labels: Sequence[Sequence[int]], shares: Sequence[Sequence[Run]]) -> str | None:
    """Why the class mix of ``shares`` cannot be judged, or None when it can: fewer than two nodes, a
    shard whose labels the manifest does not record, or fewer than two classes among the labels."""
    if len(shares) < 2:
        return "one node"
    if any(len(labels[r.shard]) < r.stop for runs in shares for r in runs):
        return "the manifest records no per-sample labels"
    flat = np.concatenate([np.asarray(x, dtype=np.int64) for x in labels] or [np.zeros(0, dtype=np.int64)])
    if len(np.unique(flat[flat >= 0])) < 2:
        return "the labelled clips are of fewer than two classes"
    return None


def class_mix(labels: Sequence[Sequence[int]], shares: Sequence[Sequence[Run]], seed: int = 0) -> Mix | None:
    """The class mix of ``shares`` (``partition.assign``'s runs per node) and of the shards themselves
    against the whole set, or None when there is nothing to judge by (``unjudged``)."""
    if unjudged(labels, shares):
        return None
    parts = share_labels(labels, shares)
    flat = np.concatenate(parts)
    flat = flat[flat >= 0]
    classes = int(flat.max()) + 1
    sizes = [int((p >= 0).sum()) for p in parts]
    shards = [np.asarray(x, dtype=np.int64) for x in labels]
    shard_sizes = [int((x >= 0).sum()) for x in shards]
    worst, node = worst_divergence(parts, classes)
    rng = np.random.default_rng([seed, len(shares), len(flat)])
    shuffled, stored_shuffled = [], []
    for _ in range(ROUNDS):  # one random order serves both: cut as the node shares, and as the shards
        order = rng.permutation(flat)
        shuffled.append(worst_divergence(_split(order, sizes), classes)[0])
        stored_shuffled.append(mean_divergence(_split(order, shard_sizes), classes))
    present = tuple(len(np.unique(p[p >= 0])) for p in parts)
    return Mix(len(shares), worst, node, float(np.mean(shuffled)), float(np.std(shuffled, ddof=1)),
               len(np.unique(flat)), present, mean_divergence(shards, classes),
               float(np.mean(stored_shuffled)),
               float(np.std(stored_shuffled, ddof=1)))
