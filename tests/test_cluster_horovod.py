"""Horovod across two "hosts" on loopback, launched the way multi-node jobs are launched.

``horovodrun -np 2 -H localhost:1,127.0.0.1:1 --gloo``: two host names for this machine, one slot
each. horovodrun treats a name as local when it resolves to one of the machine's addresses, so it
starts both ranks without ssh, but gives them the topology of two single-GPU nodes: each rank is
local rank 0 of a local size of 1, the cross size is 2, and the Gloo rendezvous runs on ``lo``
(../shared/notes/horovod-elastic.md). The shards are read over HTTP from the shard service on
127.0.0.1 (``shard-service serve --read-auth``, its catalog naming the set), with the token in
fsspec's headers (``FSSPEC_HTTP_HEADERS``) as docs/runbooks/service.md says, through each host's own
node-local cache (``--cache-dir``, a per-host path as on real nodes' local disks; its byte budget
``SHARD_CACHE_BUDGET``). Each rank's loader forks a worker after downloading through its pooled
keep-alive connections to the service, and goes on downloading through them afterwards. The
commands are the runbooks' own (the trainers' settings of docs/runbooks/service.md, the two-host
launch of docs/runbooks/training.md), read from them and run (tests/helpers/runbooks.py).
"""
from __future__ import annotations

import json
import os
import re
import secrets
from collections import Counter

from helpers.runbooks import block_commands, run_commands, shell_env
from helpers.shardsets import ServiceProcess, make_shardset, register

from shards.catalog import Catalog

HOSTS = ("localhost", "127.0.0.1")


def test_two_host_horovodrun_trains_from_the_service_through_node_local_caches(tmp_path):
    data, out, token = tmp_path / "data", tmp_path / "run", secrets.token_urlsafe(32)
    manifest = make_shardset(str(data), {"train": 16, "val": 6}, per_shard=4, num_classes=3, frames=4,
                             size=(40, 32))
    register(Catalog(str(tmp_path / "catalog.sqlite")), str(data), "tiny")
    (tmp_path / "tokens").write_text(token + "\n")
    home = tmp_path / "home"  # the reader's token file, where docs/runbooks/service.md keeps it
    (home / ".config" / "kinetics-fast").mkdir(parents=True)
    (home / ".config" / "kinetics-fast" / "shard-token").write_text(token + "\n")
    budget = sum(s.bytes for split in manifest.splits.values() for s in split.shards)  # room for every shard
    server = ServiceProcess("--catalog", str(tmp_path / "catalog.sqlite"), "--token-file",
                            str(tmp_path / "tokens"),
                            "--read-auth", "--access-log")
    url = server.start()
    try:
        # the trainers' settings of docs/runbooks/service.md, then the two-host launch of
        # docs/runbooks/training.md; each rank first records the topology horovodrun gave it
        subs = {"500GB": str(budget), "http://127.0.0.1:PORT/manifest.json": f"{url}/v1/datasets/tiny",
                "exec python": "env | grep '^HOROVOD_' > env-$HOROVOD_RANK; exec python"}
        commands = (block_commands("service.md", "export FSSPEC_HTTP_HEADERS", subs)
                    + block_commands("training.md", "horovodrun -np 2 -H localhost:1,127.0.0.1:1", subs))
        output = run_commands(commands, cwd=tmp_path,
                              env=shell_env({**os.environ, "HOME": str(home), "OMP_NUM_THREADS": "1"}))
    finally:
        server.kill(15)

    envs = [dict(line.split("=", 1) for line in (tmp_path / f"env-{r}").read_text().splitlines())
            for r in (0, 1)]
    assert {e["HOROVOD_HOSTNAME"] for e in envs} == set(HOSTS)
    for r, e in enumerate(envs):
        assert (e["HOROVOD_RANK"], e["HOROVOD_SIZE"]) == (str(r), "2")
        assert (e["HOROVOD_LOCAL_RANK"], e["HOROVOD_LOCAL_SIZE"], e["HOROVOD_CROSS_SIZE"]) == ("0", "1", "2")
        assert e["HOROVOD_GLOO_IFACE"] == "lo" and e["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "127.0.0.1"
    # --shuffle auto with a cache: node-affine, each host a node, as rank 0 says
    assert "data train: 16 clips in 4 shards, shuffle node: 2 nodes of 1 rank(s)" in output, output[-4000:]

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r["event"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2] and all(r["val_samples"] == 6 for r in epochs)
    assert max(r["step"] for r in records if r["event"] == "train") == 2 * 4  # 16 clips / (2 ranks x 2)

    # each host staged the shards it read into its own cache, verified, within the budget, and read
    # them from there afterwards: over two epochs of training and validation, no shard was
    # downloaded more often than the number of hosts that hold it
    shards = {f"/v1/datasets/tiny/{s.name}": s.sha256 for split in manifest.splits.values()
              for s in split.shards}
    # (training reads node-affine, --shuffle auto with a cache: a host may hold a piece of a shard,
    # <sha256>.<start>-<end>.tar, beside whole copies)
    copies = {host: list((tmp_path / f"cache-{host}").rglob("*.tar")) for host in HOSTS}
    assert (all(copies.values()) and {p.name.split(".")[0] for c in copies.values()
                                      for p in c} <= set(shards.values()))
    assert all(sum(p.stat().st_size for p in c) <= budget for c in copies.values())
    requests = [m.groups() for m in map(re.compile(r'"(GET|HEAD) (\S+) HTTP/1\.1" (\d+)').search, server.log)
                if m]
    downloads = Counter(path for method, path, status in requests if method == "GET" and path in shards)
    # the token went along
    assert downloads and {status for _, _, status in requests} <= {"200", "206"}, requests
    for path, count in downloads.items():
        assert count <= sum(p.name.split(".")[0] == shards[path] for c in copies.values()
                            for p in c), (path, count)
