"""The pure partition functions: equal shares, exact cover, determinism, resume, elastic resume."""
from collections import Counter

import pytest

from shards.plan import partition as P

SIZES = [17, 5, 11, 23, 9, 14]  # 79 samples in 6 shards of uneven size
N = sum(SIZES)


def samples(order, positions):
    """(shard, index) of each position of the padded order."""
    return [order.locate(p) for p in positions]


def epoch(world_size, workers, batch, remainder="pad", seed=0, ep=0, bufsize=8):
    """Every rank's sequence of (shard, index, valid) for one epoch."""
    order = P.epoch_order(SIZES, seed, ep)
    seg = P.Segment(world_size, workers, batch)
    out = []
    for rank in range(world_size):
        seq = P.rank_sequence(len(order), seg, rank, remainder, bufsize, seed, ep)
        out.append([(*order.locate(p), p < N) for p in seq])
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 7, 64, 100])
@pytest.mark.parametrize("workers,batch", [(1, 1), (3, 4), (2, 5)])
def test_pad_gives_equal_shares_and_every_sample_once(world_size, workers, batch):
    ranks = epoch(world_size, workers, batch)
    share = len(ranks[0])
    assert all(len(r) == share for r in ranks) and share % batch == 0
    assert 0 <= world_size * share - N < world_size * batch  # less than one global batch of padding
    valid = Counter((s, i) for r in ranks for s, i, ok in r if ok)
    assert set(valid) == {(s, i) for s, n in enumerate(SIZES) for i in range(n)}
    assert set(valid.values()) == {1}
    assert sum(not ok for r in ranks for *_, ok in r) == world_size * share - N


@pytest.mark.parametrize("world_size", [1, 2, 3, 7])
def test_drop_gives_equal_whole_batches_and_no_repeats(world_size):
    ranks = epoch(world_size, 2, 3, remainder="drop")
    share = len(ranks[0])
    assert all(len(r) == share for r in ranks) and share % 3 == 0
    seen = Counter((s, i) for r in ranks for s, i, _ in r)
    assert set(seen.values()) == {1}
    assert N - world_size * 3 < len(seen) <= N


def test_pad_never_hands_a_rank_nothing():
    assert P.per_rank(10, 64, 4, "pad") == 4
    assert P.per_rank(10, 4, 4, "drop") == 0
    with pytest.raises(ValueError):
        P.per_rank(10, 4, 4, "fill")


def test_ranks_beyond_shard_count_read_byte_ranges_of_shards():
    order = P.epoch_order(SIZES, 0, 0)
    for rank in range(64):
        runs = [r for s in P.streams(N, 64, rank, 1, 1) for r in order.slice(s.begin, s.end)]
        assert sum(r.size for r in runs) == 2 and len(runs) <= 2
        assert all(0 <= r.start < r.stop <= SIZES[r.shard] for r in runs)


def test_each_rank_reads_a_few_long_runs():
    """Contiguous rank ranges: opens per rank ~ 1 + share / shard size, not one per sample."""
    sizes = [100] * 50
    order = P.epoch_order(sizes, 3, 1)
    for rank in range(8):
        runs = [r for s in P.streams(5000, 8, rank, 4, 5) for r in order.slice(s.begin, s.end)]
        assert len({r.shard for r in runs}) <= 625 // 100 + 2


def test_worker_streams_split_the_rank_range_within_one_batch():
    for workers in (1, 2, 3, 5):
        st = P.streams(N, 3, 1, workers, 2)
        assert st[0].begin == P.per_rank(N, 3, 2) and st[-1].end == 2 * st[0].begin
        assert all(a.end == b.begin for a, b in zip(st, st[1:]))
        sizes = [s.size for s in st]
        assert max(sizes) - min(sizes) <= 2


def test_worker_batches_matches_round_robin():
    for nb in range(12):
        for w_count in (1, 2, 3, 5):
            for done in range(nb + 1):
                for w in range(w_count):
                    expect = sum(1 for b in range(done, nb) if b % w_count == w)
                    assert P.worker_batches(nb, w_count, w, done) == expect


def test_same_seed_same_order_other_seed_or_epoch_differs():
    a = epoch(3, 2, 4, seed=1, ep=0)
    assert epoch(3, 2, 4, seed=1, ep=0) == a
    assert epoch(3, 2, 4, seed=2, ep=0) != a
    assert epoch(3, 2, 4, seed=1, ep=1) != a


def test_piece_order_is_shuffled_and_rotated():
    orders = {tuple(P.epoch_order(SIZES, 0, e).runs) for e in range(5)}
    assert len(orders) == 5
    stored = P.epoch_order(SIZES, 0, 0, shuffle=False)
    assert stored.runs == [P.Run(i, 0, n) for i, n in enumerate(SIZES)]


def test_pieces_cut_shards_into_near_equal_runs():
    runs = P.pieces([10, 3], piece_samples=4)
    assert runs == [P.Run(0, 0, 3), P.Run(0, 3, 6), P.Run(0, 6, 10), P.Run(1, 0, 3)]


def test_order_slice_wraps_for_padding():
    order = P.Order([P.Run(0, 2, 5), P.Run(1, 0, 2)])
    assert order.slice(1, 4) == [P.Run(0, 3, 5), P.Run(1, 0, 1)]
    assert order.slice(4, 7) == [P.Run(1, 1, 2), P.Run(0, 2, 4)]
    assert order.slice(0, 11) == order.runs * 2 + [P.Run(0, 2, 3)]


def test_buffer_shuffle_is_a_bounded_permutation():
    rng = P.rng_for("t")
    out = list(P.buffer_shuffle(range(1000), 50, rng))
    assert sorted(out) == list(range(1000)) and out != list(range(1000))
    # the j-th item out was among the first j + 50 read
    assert all(x < j + 50 for j, x in enumerate(out))
    assert list(P.buffer_shuffle(range(10), 1, rng)) == list(range(10))


def test_resume_continues_the_same_sequence():
    order = P.epoch_order(SIZES, 4, 2)
    for done in (1, 2, 3):
        full = P.rank_sequence(N, P.Segment(3, 2, 4), 1, "pad", 8, 4, 2)
        rest = P.rank_sequence(N, P.Segment(3, 2, 4, done), 1, "pad", 8, 4, 2)
        assert rest == full[done * 4:]
    assert len(order) == N


@pytest.mark.parametrize("hops", [[(4, 2, 3, 2), (3, 1, 3, 0)],
                                  [(4, 2, 2, 3), (3, 3, 2, 1), (5, 1, 1, 0)],
                                  [(2, 1, 4, 5), (7, 2, 1, 0)]])
@pytest.mark.parametrize("remainder", ["pad", "drop"])
def test_elastic_resume_covers_the_epoch_once(hops, remainder):
    """Run k batches per rank at one world size, then the rest at others: no sample repeats,
    none is skipped (with drop: only the tail of the last segment may be left out)."""
    seed, ep, buf = 5, 1, 6
    base = P.epoch_order(SIZES, seed, ep)
    past, got = [], Counter()
    for i, (world, workers, batch, done) in enumerate(hops):
        order = P.segment_order(base, past, remainder, buf, seed, ep)
        n = len(order)
        nb = P.per_rank(n, world, batch, remainder) // batch
        upto = done or nb  # the last segment runs to the end of the epoch
        for rank in range(world):
            seq = P.rank_sequence(n, P.Segment(world, workers, batch), rank, remainder, buf, seed, ep, i)
            got.update(order.locate(p) for p in seq[: upto * batch] if p < n)
        past.append(P.Segment(world, workers, batch, done))
    assert set(got.values()) == {1}
    if remainder == "pad":
        assert len(got) == N
    else:
        world, _, batch, _ = hops[-1]
        assert len(got) > N - world * batch - sum(w * b for w, _, b, _ in hops[:-1])


@pytest.mark.parametrize("world_size,workers,batch,done", [(1, 1, 4, 0), (3, 2, 5, 1), (7, 3, 4, 2),
                                                           (64, 2, 1, 0), (100, 1, 3, 0)])
def test_step_samples_count_the_real_clips_of_each_global_step(world_size, workers, batch, done):
    """Batch b of every rank is optimizer step b; its real (not padding) clips, counted from the
    ranks' full sequences, are what ``step_samples`` gives from the padded streams alone."""
    order = P.epoch_order(SIZES, 0, 0)
    seg = P.Segment(world_size, workers, batch, done)
    counts = P.step_samples(len(order), seg, "pad", 8, 0, 0)
    seqs = [P.rank_sequence(len(order), seg, r, "pad", 8, 0, 0) for r in range(world_size)]
    real = [sum(p < N for seq in seqs for p in seq[b * batch:(b + 1) * batch]) for b in range(len(counts))]
    assert counts == real and len(counts) == len(seqs[0]) // batch
    assert sum(P.step_samples(len(order), P.Segment(world_size, workers, batch), "pad", 8, 0, 0)) == N
    assert P.step_samples(len(order), seg, "drop", 8, 0, 0) == [world_size * batch] * (
        P.per_rank(N, world_size, batch, "drop") // batch - done)


# --- node-affine epochs ----------------------------------------------------------------------
def node_epoch(nodes, ranks, workers, batch, remainder="pad", seed=0, ep=0, bufsize=8, sizes=SIZES):
    """Every rank's sequence of (shard, index, valid) for one node-affine epoch."""
    orders = P.epoch_orders(sizes, nodes, seed, ep)
    lengths = tuple(len(o) for o in orders)
    seg = P.Segment(nodes * ranks, workers, batch, nodes=nodes)
    out = []
    for rank in range(nodes * ranks):
        node = rank // ranks
        seq = P.rank_sequence(lengths, seg, rank, remainder, bufsize, seed, ep)
        out.append([(*orders[node].locate(p), p < lengths[node]) for p in seq])
    return out


def owned(nodes, seed=0, sizes=SIZES):
    return [{(r.shard, i) for r in runs for i in range(r.start, r.stop)}
            for runs in P.assign(sizes, nodes, seed)]


@pytest.mark.parametrize("nodes", [1, 2, 3, 4, 7, 16, 79])
@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("workers,batch", [(1, 1), (3, 4), (2, 5)])
def test_node_affine_gives_equal_shares_every_sample_once_and_only_the_nodes_own(
        nodes, ranks, workers, batch):
    ranks_seen = node_epoch(nodes, ranks, workers, batch)
    share = len(ranks_seen[0])
    assert all(len(r) == share for r in ranks_seen) and share % batch == 0
    assert share == P.per_rank(N, nodes * ranks, batch)  # the same steps per epoch as the global mode
    valid = Counter((s, i) for r in ranks_seen for s, i, ok in r if ok)
    assert (set(valid) == {(s, i) for s, n in enumerate(SIZES) for i in range(n)}
            and set(valid.values()) == {1})
    mine = owned(nodes)
    for rank, seq in enumerate(ranks_seen):
        assert {(s, i) for s, i, _ in seq} <= mine[rank // ranks]  # padding too comes from the node's own set
    drop = node_epoch(nodes, ranks, workers, batch, remainder="drop")
    assert len({len(r) for r in drop}) == 1 and len(drop[0]) == P.per_rank(N, nodes * ranks, batch, "drop")
    assert set(Counter((s, i) for r in drop for s, i, _ in r).values()) <= {1}


@pytest.mark.parametrize("nodes", [2, 3, 5, 6, 7, 13, 40, 79])
def test_assignment_is_balanced_fixed_for_the_run_and_cuts_few_shards(nodes):
    parts = P.assign(SIZES, nodes, 3)
    counts = [sum(r.size for r in runs) for runs in parts]
    assert max(counts) - min(counts) <= 1 and sum(counts) == N
    shared = Counter(r.shard for runs in parts for r in runs)
    assert sum(k - 1 for k in shared.values()) <= nodes - 1  # a cut splits at most one shard
    for runs in parts:  # a node holds contiguous pieces: at most one run per shard
        assert len({r.shard for r in runs}) == len(runs)
    assert P.assign(SIZES, nodes, 3) == parts and P.assign(SIZES, nodes, 4) != parts
    for ep in (1, 2):
        orders = P.epoch_orders(SIZES, nodes, 3, ep)
        assert [{(r.shard, i) for r in o.runs for i in range(r.start, r.stop)}
                for o in orders] == owned(nodes, 3)
    if nodes < 40:  # (with one or two samples per node there is little to reorder)
        assert [o.runs for o in P.epoch_orders(SIZES, nodes, 3,
                                               1)] != [o.runs for o in P.epoch_orders(SIZES, nodes, 3, 2)]


def test_one_node_is_the_global_order():
    assert P.epoch_orders(SIZES, 1, 5, 2)[0].runs == P.epoch_order(SIZES, 5, 2).runs
    assert node_epoch(1, 3, 2, 4) == epoch(3, 2, 4)


def test_node_affine_refuses_what_it_cannot_split():
    with pytest.raises(ValueError, match="80 nodes a share of 79 samples"):
        P.assign(SIZES, 80, 0)
    with pytest.raises(ValueError, match="world size 5 is not a whole number of ranks on each of 2 nodes"):
        P.streams((40, 39), 5, 0, 1, 1)


def test_node_affine_resume_continues_the_same_sequence():
    lengths = tuple(len(o) for o in P.epoch_orders(SIZES, 3, 4, 2))
    for rank in range(6):
        full = P.rank_sequence(lengths, P.Segment(6, 2, 4, nodes=3), rank, "pad", 8, 4, 2)
        for done in (1, 2):
            assert P.rank_sequence(lengths, P.Segment(6, 2, 4, done, 3), rank, "pad", 8, 4,
                                   2) == full[done * 4:]


@pytest.mark.parametrize("hops", [
    [(2, 3, 2, 2, 1), (2, 1, 1, 3, 0)],  # fewer ranks per node, same nodes
    [(3, 2, 2, 4, 2), (3, 1, 1, 3, 0)],  # same nodes, padding handed out early: 13, 12, 14 left
    [(4, 2, 1, 2, 2), (2, 2, 3, 1, 1), (3, 1, 1, 2, 0)],  # node count 4 -> 2 -> 3
    [(1, 4, 2, 2, 3), (7, 1, 1, 1, 0)],  # global -> node-affine mid-epoch
    [(16, 1, 1, 1, 2), (5, 2, 2, 1, 0)],
    [(13, 1, 1, 3, 2), (13, 1, 1, 2, 0)],  # a node with nothing left while others have: regrouped
])
@pytest.mark.parametrize("remainder", ["pad", "drop"])
def test_node_affine_elastic_resume_covers_the_epoch_once(hops, remainder):
    """k batches per rank on some nodes and ranks, then the rest on others: no sample twice,
    none skipped (drop: only tails), and where the node count stays, the node's samples stay."""
    seed, ep, buf = 5, 1, 6
    base = P.epoch_orders(SIZES, hops[0][0], seed, ep)
    past, got, owners = [], Counter(), []
    for i, (nodes, ranks, workers, batch, done) in enumerate(hops):
        orders = P.segment_orders(base, past, remainder, buf, seed, ep, nodes)
        lengths = tuple(len(o) for o in orders)
        seg = P.Segment(nodes * ranks, workers, batch, nodes=nodes)
        upto = done or P.batches_per_rank(lengths, nodes * ranks, batch, remainder)
        owners.append([{(r.shard, j) for r in o.runs for j in range(r.start, r.stop)} for o in orders])
        for rank in range(nodes * ranks):
            node = rank // ranks
            seq = P.rank_sequence(lengths, seg, rank, remainder, buf, seed, ep, i)
            took = [orders[node].locate(p) for p in seq[: upto * batch] if p < lengths[node]]
            assert set(took) <= owners[-1][node]
            got.update(took)
        past.append(P.Segment(nodes * ranks, workers, batch, done, nodes))
    assert set(got.values()) == {1}
    if remainder == "pad":
        assert len(got) == N
    else:
        assert len(got) > N - sum(n * r * b for n, r, _, b, _ in hops)
    if hops[0][0] == hops[1][0] and all(len(o) for o in P.remaining(base, past[0], remainder, buf, seed, ep,
                                                                    0)):
        # same nodes: what node k had left stayed on node k
        assert all(after <= before for before, after in zip(owners[0], owners[1]))


@pytest.mark.parametrize("nodes,ranks,workers,batch,done", [(2, 1, 1, 4, 0), (3, 2, 2, 5, 1), (7, 1, 3, 4, 0),
                                                            (16, 2, 1, 1, 1)])
def test_node_affine_step_samples_count_the_real_clips(nodes, ranks, workers, batch, done):
    orders = P.epoch_orders(SIZES, nodes, 0, 0)
    lengths = tuple(len(o) for o in orders)
    seg = P.Segment(nodes * ranks, workers, batch, done, nodes)
    counts = P.step_samples(lengths, seg, "pad", 8, 0, 0)
    seqs = [P.rank_sequence(lengths, seg, r, "pad", 8, 0, 0) for r in range(nodes * ranks)]
    real = [sum(p < lengths[r // ranks] for r, seq in enumerate(seqs) for p in seq[b * batch:(b + 1) * batch])
            for b in range(len(counts))]
    assert counts == real
    assert sum(P.step_samples(lengths, P.Segment(nodes * ranks, workers, batch, 0, nodes), "pad", 8, 0,
                              0)) == N


@pytest.mark.parametrize("call, words", [
    (lambda: P.batches_per_rank(10, 2, 0), "batch_size 0"),
    (lambda: P.per_rank(10, 2, -2), "batch_size -2"),
    (lambda: P.batches_per_rank(10, 0, 4), "world size 0"),
    (lambda: P.worker_batches(5, 0, 0), "num_workers 0"),
    (lambda: P.streams(10, 1, 0, 0, 2), "num_workers 0"),
    (lambda: P.ranks_per_node(4, 0), "nodes 0"),
    (lambda: P.assign(SIZES, 0, 0), "0 nodes"),
    (lambda: P.pieces(SIZES, -3), "piece_samples -3"),
])
def test_sizes_the_partition_cannot_split_are_refused_naming_them(call, words):
    with pytest.raises(ValueError, match=words):  # not a ZeroDivisionError, nor an empty or negative share
        call()
