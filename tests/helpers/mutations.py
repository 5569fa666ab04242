"""The shard-set mutation campaign's engine (tests/test_mutation_campaign.py): a seeded mutator of
sound shard sets, and a runner that gives each damaged copy to verify, stats, preview, the loader
and the viewer's routes, in-process, in forked children under a memory and a time limit.

``mutation(seed, sound)`` is a pure function of the seed and the sound set's description: one to
three changes, each a dict naming what it did (``{"kind": "flip", "file": ..., "at": [...]}``),
to the tars (bytes flipped, cut, inserted, duplicated, zeroed; a member's header field rewritten,
a member deleted, one shard in place of another; with ``rehash`` the manifest's sizes, SHA-256 and
digests then made to match, as another tool editing the set would) or to the manifest (a field
deleted, retyped, scaled, negated, repointed at a path outside the set, ranges shifted, the JSON
text broken). ``apply(changes, sound, copy)`` makes the copy.

``Campaign.run(seeds)`` forks one child at a time; the child runs copy after copy, writing one
JSON line per copy (``Outcome``) and exiting; a child that dies (a signal, the memory limit past
what Python can raise) is answered by a new one for the seeds after the one it died on, that one
recorded as ``died``. In the child an audit hook records every file opened, and every connection
made, outside the copy and its work folder (``outside``)."""
from __future__ import annotations

import asyncio
import contextlib
import copy as copying
import hashlib
import io
import json
import logging
import os
import random
import resource
import shutil
import signal
import sys
import tarfile
import traceback
from dataclasses import dataclass, field

import torch

from shards import cli
from shards.base.errors import CommandError
from shards.format.digests import sample_digest
from shards.format.tar import BLOCK

BAIT = ["../other/train/train-000000.tar", "../../other/train/train-000000.tar", "/etc/passwd",
        "file:///etc/passwd", "http://127.0.0.1:9/train-000000.tar",
        "train/../../other/train/train-000000.tar",
        "train\\..\\..\\other\\train-000000.tar", "%2e%2e/other/train/train-000000.tar", "train/", "",
        "s3://bucket/train-000000.tar", "~/train-000000.tar", "train/train-000000.tar\x00.txt"]
TYPEFLAGS = [b"1", b"2", b"3", b"5", b"6", b"7", b"g", b"x", b"L", b"K", b"S", b"Z"]
BAD_NAMES = ["../evil.jpg", "/etc/passwd", "{key}.99.jpg", "{key}.cls", "{key}.00.jpg", "other.00.jpg",
             "{key}.txt", "{key}", "{key}.00.mv.png", "{key}/00.jpg", "{key}.json.gz", ".{key}.00.jpg"]
JSON_BREAKS = ["", "[]", "null", "3", '"manifest"', "{", "[" * 100000 + "]" * 100000, "\ufeff{}", "{}",
               '{"format": "evil/9"}', "NaN", "1e400"]
VALUES = [None, True, False, "3", 3, -1, 3.5, 1e308, [], {}, [1], {"a": 1}, "x" * 300, 2 ** 70, -(2 ** 63)]
SCALES = [0, 2, 10, 1000, 10 ** 12, 2 ** 62, 2 ** 64]
SOUND = -1  # the seed of the copy with no change: every tool must pass it
TIME_LIMIT_S = 20  # per copy and tool: a tool past it hangs
MEMORY_HEADROOM = 2 << 30  # bytes of address space a child may add to what it started with


@dataclass
class Sound:
    """The sound set a campaign mutates: its folder, manifest (parsed), and each shard's members
    as (name, header offset, data offset, size)."""
    directory: str
    manifest: dict
    members: dict[str, list[tuple[str, int, int, int]]] = field(default_factory=dict)

    @classmethod
    def of(cls, directory: str) -> "Sound":
        with open(os.path.join(directory, "manifest.json"), "rb") as f:
            manifest = json.load(f)
        members = {}
        for split in manifest["splits"].values():
            for shard in split["shards"]:
                with tarfile.open(os.path.join(directory, shard["name"])) as tar:
                    members[shard["name"]] = [(m.name, m.offset, m.offset_data, m.size) for m in tar]
        return cls(directory, manifest, members)

    def shards(self) -> list[dict]:
        return [s for split in self.manifest["splits"].values() for s in split["shards"]]


# --- the mutator -------------------------------------------------------------------------------

def _paths(node, path=()):
    """Every (path, value) in a JSON tree, the root left out."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        yield path + (k,), v
        yield from _paths(v, path + (k,))


def _pick_path(rng: random.Random, manifest: dict, want=None):
    """A path into the manifest: shard fields weighted up (they hold what readers act on)."""
    paths = [(p, v) for p, v in _paths(manifest) if want is None or want(v)]
    shard_paths = [(p, v) for p, v in paths if "shards" in p]
    pool = shard_paths if shard_paths and rng.random() < 0.7 else paths
    return list(rng.choice(pool)[0]) if pool else None


def _tar_change(rng: random.Random, sound: Sound) -> dict:
    name = rng.choice(sorted(sound.members))
    size = os.path.getsize(os.path.join(sound.directory, name))
    members = sound.members[name]
    header = rng.choice(members)[1]  # a member's header block
    at = header + rng.randrange(BLOCK) if rng.random() < 0.5 else rng.randrange(size)
    kind = rng.choice(["flip", "flip", "cut", "insert", "duplicate", "zero", "header", "header", "header",
                       "delete_member", "other_shard"])
    change = {"kind": kind, "file": name}
    if kind == "flip":
        change["at"] = sorted({at} | {rng.randrange(size) for _ in range(rng.choice([0, 0, 1, 7]))})
        change["mask"] = rng.randrange(1, 256)
    elif kind == "cut":
        change["at"] = rng.choice([at, at - at % BLOCK, rng.randrange(size), size - BLOCK, size - 2 * BLOCK])
    elif kind == "insert":
        change["at"] = rng.choice([at, header, size - 2 * BLOCK])
        change["bytes"] = rng.choice([1, 7, BLOCK, 3 * BLOCK, 1000])
        change["zero"] = rng.random() < 0.3
    elif kind == "duplicate":
        source = rng.choice(members)
        whole = source[2] - source[1] + source[3]  # its header and data
        change["start"], change["length"] = source[1], rng.choice([BLOCK, whole, 100])
        change["at"] = rng.choice([header, at, size - 2 * BLOCK])
    elif kind == "zero":
        change["at"], change["length"] = at, rng.choice([1, BLOCK, 4 * BLOCK, 50])
    elif kind == "header":
        change["header"] = header
        change["field"] = rng.choice(["size", "size", "type", "name", "checksum", "mode", "magic"])
        if change["field"] == "size":
            change["value"] = rng.choice([0, 1, 511, 513, 10 ** 9, 8 ** 11 - 1, 2 ** 40, -1, "base256"])
        elif change["field"] == "type":
            change["value"] = rng.choice(TYPEFLAGS).decode()
        elif change["field"] == "name":
            change["value"] = rng.choice(BAD_NAMES)
    elif kind == "delete_member":
        change["member"] = members.index(rng.choice(members))
    else:
        change["other"] = rng.choice(sorted(sound.members))
    return change


def _manifest_change(rng: random.Random, sound: Sound) -> dict:
    kind = rng.choice(["delete", "retype", "scale", "negate", "repoint", "repoint", "shift", "json", "extra",
                       "classes", "label", "swap"])
    m = sound.manifest
    change: dict = {"kind": kind}
    if kind in ("delete", "retype"):
        change["path"] = _pick_path(rng, m)
        change["value"] = rng.choice(VALUES)
    elif kind in ("scale", "negate"):
        change["path"] = _pick_path(rng, m, lambda v: isinstance(v, int) and not isinstance(v, bool))
        change["factor"] = rng.choice(SCALES) if kind == "scale" else -1
    elif kind == "repoint":
        s = rng.randrange(len(sound.shards()))
        change["shard"], change["name"] = s, rng.choice(BAIT + [sh["name"] for sh in sound.shards()])
    elif kind == "shift":
        s = rng.randrange(len(sound.shards()))
        n = len(sound.shards()[s]["offsets"])
        change["shard"], change["sample"] = s, rng.randrange(n)
        change["field"] = rng.choice(["offsets", "lengths", "both"])
        change["by"] = rng.choice([BLOCK, -BLOCK, 2 * BLOCK, 1, -1, 4 * BLOCK])
    elif kind == "json":
        change["how"] = rng.choice(["truncate", "byte", "text"])
        change["at"] = rng.randrange(1000)
        change["text"] = rng.choice(JSON_BREAKS)
        change["byte"] = rng.choice([0x00, 0xFF, 0x22, 0x7B, 0x5D, 0x2C, 0x80])
    elif kind == "extra":
        change["path"] = _pick_path(rng, m, lambda v: isinstance(v, dict)) or []
        change["value"] = rng.choice(VALUES)
    elif kind == "classes":
        change["value"] = rng.choice([["a", "a", "b"], "abc", [], ["a"], [1, 2, 3], [None], ["x"] * 2000,
                                      m["classes"][:1], m["classes"] + ["extra"]])
    elif kind == "label":
        s = rng.randrange(len(sound.shards()))
        change["shard"], change["sample"] = s, rng.randrange(len(sound.shards()[s]["labels"]))
        change["value"] = rng.choice([999, -5, -1, 0, 1, 2, len(m["classes"])])
    else:  # two samples' entries of one list exchanged
        s = rng.randrange(len(sound.shards()))
        n = len(sound.shards()[s]["offsets"])
        change["shard"], change["samples"] = s, [rng.randrange(n), rng.randrange(n)]
        change["field"] = rng.choice(["offsets", "lengths", "keys", "labels", "digests"])
    return change


def mutation(seed: int, sound: Sound) -> list[dict]:
    """The changes copy ``seed`` makes: one (most copies) to three, tars and manifest alike; a tar
    change is followed by the manifest made to match the new bytes for half the seeds. ``SOUND``: none."""
    if seed == SOUND:
        return []
    rng = random.Random(seed)
    changes = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        if rng.random() < 0.55:
            changes.append(_tar_change(rng, sound))
            if rng.random() < 0.5:
                changes.append({"kind": "rehash", "file": changes[-1]["file"]})
        else:
            changes.append(_manifest_change(rng, sound))
    return changes


# --- making a copy -----------------------------------------------------------------------------

def _header_edit(block: bytearray, what: str, value, checksum: bool = True) -> None:
    if what == "size":
        if value == "base256":
            block[124:136] = b"\x80" + (2 ** 80).to_bytes(11, "big")
        elif value == -1:
            block[124:136] = b"\xff" * 12
        else:
            block[124:136] = (b"%011o" % value)[-11:].rjust(11, b"0") + b"\0"
    elif what == "type":
        block[156:157] = value.encode()
    elif what == "name":
        block[0:100] = value.encode()[:100].ljust(100, b"\0")
    elif what == "mode":
        block[100:108] = b"7777777\0"
    elif what == "magic":
        block[257:265] = b"garbage\0"
    if what == "checksum":
        block[148:156] = b"0000000\0"
        return
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)


def _tar_apply(data: bytearray, change: dict, sound: Sound, key: str) -> bytearray:
    kind, size = change["kind"], len(data)
    if kind == "flip":
        for at in change["at"]:
            if at < len(data):  # an earlier change may have cut the file short
                data[at] ^= change["mask"]
    elif kind == "cut":
        del data[max(0, change["at"]):]
    elif kind == "insert":
        n = change["bytes"]
        blob = bytes(n) if change["zero"] else random.Random(change["at"]).randbytes(n)
        data[change["at"]:change["at"]] = blob
    elif kind == "duplicate":
        data[change["at"]:change["at"]] = data[change["start"]:change["start"] + change["length"]]
    elif kind == "zero":
        data[change["at"]:change["at"] + change["length"]] = bytes(
            max(0, min(change["length"], size - change["at"])))
    elif kind == "header":
        block = bytearray(data[change["header"]:change["header"] + BLOCK])
        value = change.get("value")
        if isinstance(value, str) and "{key}" in value:
            value = value.format(key=key)
        _header_edit(block, change["field"], value)
        data[change["header"]:change["header"] + BLOCK] = block
    elif kind == "delete_member":
        _, header, start, length = sound.members[change["file"]][change["member"]]
        del data[header:start + length + (-length) % BLOCK]
    return data


def _rehash(m: dict, name: str, data: bytes) -> None:
    """The manifest's entry of shard ``name`` made to agree with ``data`` (size, SHA-256, each
    sample's digest of the bytes its range now holds)."""
    splits = m.get("splits")
    for split in (splits.values() if isinstance(splits, dict) else ()):
        shards = split.get("shards") if isinstance(split, dict) else None
        for shard in shards if isinstance(shards, list) else ():
            if not isinstance(shard, dict) or shard.get("name") != name:
                continue  # the manifest mutations may have made any of these something else
            shard["bytes"], shard["sha256"] = len(data), hashlib.sha256(data).hexdigest()
            offsets, lengths = shard.get("offsets"), shard.get("lengths")
            if not (isinstance(offsets, list) and isinstance(lengths, list)
                    and all(isinstance(v, int) and v >= 0 for v in offsets + lengths)):
                # ranges a manifest mutation broke stay as they are (the manifest is refused at load)
                continue
            shard["digests"] = [sample_digest(data[o:o + n]) for o, n in zip(offsets, lengths)]


def _at(tree, path):
    for k in path[:-1]:
        tree = tree[k]
    return tree


def _manifest_apply(m: dict, change: dict, sound: Sound):
    """``m`` changed as ``change`` says; returns text instead when the change breaks the JSON text."""
    kind = change["kind"]
    shards = [s for split in m["splits"].values() for s in split["shards"]]
    if kind in ("delete", "retype", "scale", "negate") and change["path"]:
        parent, last = _at(m, change["path"]), change["path"][-1]
        if kind == "delete":
            del parent[last]
        elif kind == "retype":
            parent[last] = change["value"]
        else:
            parent[last] *= change["factor"]
    elif kind == "repoint":
        shards[change["shard"]]["name"] = change["name"]
    elif kind == "shift":
        shard, i = shards[change["shard"]], change["sample"]
        for f in (("offsets", "lengths") if change["field"] == "both" else (change["field"],)):
            shard[f][i] += change["by"]
    elif kind == "json":
        text = json.dumps(m).encode()
        at = change["at"] % len(text)
        if change["how"] == "truncate":
            return text[:at]
        if change["how"] == "byte":
            return text[:at] + bytes([change["byte"]]) + text[at + 1:]
        return change["text"].encode("utf-8", "surrogatepass")
    elif kind == "extra":
        _at(m, change["path"] + ["x"])["unknown_field"] = change["value"]
    elif kind == "classes":
        m["classes"] = change["value"]
    elif kind == "label":
        shards[change["shard"]]["labels"][change["sample"]] = change["value"]
    elif kind == "swap":
        values = shards[change["shard"]].get(change["field"], [])
        a, b = change["samples"]
        if len(values) > max(a, b):
            values[a], values[b] = values[b], values[a]
    return m


def apply(changes: list[dict], sound: Sound, directory: str) -> None:
    """The damaged copy: the sound set copied to ``directory``, then ``changes`` made to it."""
    shutil.copytree(sound.directory, directory)
    m, text = copying.deepcopy(sound.manifest), None
    for change in changes:
        if "file" in change:
            path = os.path.join(directory, change["file"])
            if change["kind"] == "other_shard":
                shutil.copyfile(os.path.join(sound.directory, change["other"]), path)
                continue
            with open(path, "rb") as f:
                data = bytearray(f.read())
            if change["kind"] == "rehash":
                if isinstance(m, dict):
                    _rehash(m, change["file"], bytes(data))
                continue
            key = sound.members[change["file"]][0][0].split(".", 1)[0]
            with open(path, "wb") as f:
                f.write(_tar_apply(data, change, sound, key))
        elif isinstance(m, dict):
            try:
                result = _manifest_apply(m, change, sound)
            # an earlier change took away what this one edits
            except (KeyError, IndexError, TypeError, AttributeError):
                continue
            if isinstance(result, bytes):
                text, m = result, None
    with open(os.path.join(directory, "manifest.json"), "wb") as f:
        f.write(text if m is None else json.dumps(m).encode())


# --- running the tools -------------------------------------------------------------------------

class Hang(BaseException):
    """A tool ran past ``TIME_LIMIT_S`` on one copy (a BaseException: no ``except Exception`` in
    the code under test takes it for a refusal)."""


def _on_alarm(signum, frame):
    raise Hang(f"ran past {TIME_LIMIT_S} s")


def _last_frame(e: BaseException) -> tuple[str, str]:
    """(file:line in function, file:function) of the traceback's last frame: the file relative to
    the repository, or its base name outside it (the standard library's tarfile)."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return "?", "?"
    f = frames[-1]
    name = os.path.relpath(f.filename) if f.filename.startswith(os.getcwd()) else os.path.basename(f.filename)
    return f"{name}:{f.lineno} in {f.name}", f"{name}:{f.name}"


def _bug(e: BaseException) -> dict:
    frame, where = _last_frame(e)
    return {"bug": f"{type(e).__name__}: {str(e)[:300]}", "frame": frame, "type": type(e).__name__,
            "where": where}


def _guarded(work):
    """``work()``'s outcome: {"refused": bool, "line": ...} or {"bug": ..., "frame": ...}."""
    signal.alarm(TIME_LIMIT_S)
    try:
        return work()
    except CommandError as e:
        return {"refused": True, "line": str(e)[:300], "status": e.status}
    except Hang as e:
        return {**_bug(e), "type": "hang"}
    except Exception as e:  # a traceback: the finding this campaign looks for (MemoryError included)
        return _bug(e)
    finally:
        signal.alarm(0)


def _command(argv: list[str]):
    def work():
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = cli.main(argv)
            except SystemExit as e:  # argparse's usage errors; preview's own refusals (a message)
                status = e.code if isinstance(e.code, int) else 1
                err.write(str(e.code) if not isinstance(e.code, int) else "")
        line = (err.getvalue().strip().splitlines() or out.getvalue().strip().splitlines() or [""])[-1][:300]
        if status not in (0, 1, 2):
            return {"bug": f"exit status {status}", "frame": line, "type": f"exit {status}", "where": argv[0]}
        return {"refused": status != 0, "line": line, "status": status}
    return _guarded(work)


def _loader(directory: str):
    from trainer.data import ClipLoader, EpochOptions

    def work():
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loader = ClipLoader(directory, "train", EpochOptions(batch_size=2), num_workers=0, crop_size=16,
                                scale_size=20)
            batches = sum(1 for _ in loader)
        return {"refused": False, "line": f"{batches} batches"}
    return _guarded(work)


class _Failures(logging.Handler):
    """The exceptions the service logged (its answer to them is a 500)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.seen: list[BaseException] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.seen.append(record.exc_info[1])


class _ViewerSite:
    """The service app with the viewer on 127.0.0.1 in this child, a catalog in ``work``; each copy
    registered as a ready set under the SHA-256 of its manifest file as it is now."""

    def __init__(self, work: str):
        from aiohttp.test_utils import TestClient, TestServer

        from service.api.app import make_app
        from service.viewer import add_routes
        from shards.catalog import Catalog

        self.catalog = Catalog(os.path.join(work, "catalog.sqlite"))
        app = make_app(self.catalog, data_root=os.path.join(work, "data"))
        add_routes(app)
        self.loop = asyncio.new_event_loop()
        self.client = TestClient(TestServer(app, host="127.0.0.1"), loop=self.loop)
        self.loop.run_until_complete(self.client.start_server())
        self.port = self.client.port
        self.failures = _Failures()
        logging.getLogger("service").addHandler(self.failures)

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()

    def register(self, directory: str, n: int) -> str:
        with open(os.path.join(directory, "manifest.json"), "rb") as f:
            data = f.read()
        sha = hashlib.sha256(data).hexdigest()
        dataset = hashlib.sha256(f"{directory}{n}".encode()).hexdigest()
        claim = self.catalog.claim(dataset, source="campaign", location=directory, options={},
                                   name=f"copy{n}", strict_name=True)
        self.catalog.finish(dataset, claim.owner, splits={}, files={"manifest.json": [len(data), sha]},
                            manifest_sha256=sha, builder_version="campaign")
        return dataset

    def visit(self, directory: str, n: int):
        routes = ["", "/probe", "/clips?split=train", "/clips/train/0", "/frames/train/0/0",
                  "/frames/train/1/1", "/clips/val/0"]

        async def walk(ref):
            answers = []
            for route in routes:
                r = await self.client.get(f"/v1/viewer/{ref}{route}")
                body = await r.read()
                answers.append((route, r.status, body[:200].decode("utf-8", "replace")))
            return answers

        def work():
            self.failures.seen = []
            answers = self.loop.run_until_complete(walk(self.register(directory, n)))
            if self.failures.seen:  # an exception the service logged and answered with a bare 500
                route = next(route for route, status, _ in answers if status >= 500)
                e = self.failures.seen[0]
                if isinstance(e, CommandError):  # a one-line refusal answered as an internal error
                    return {**_bug(e), "type": "refusal answered 500", "where": type(e).__name__}
                return {**_bug(e), "route": route or "/"}
            # a 404 answers the route (a split or clip the manifest does not have), not the set's bytes
            refusals = [f"{route or '/'}: {status} {body[:120]}" for route, status, body in answers
                        if status >= 400 and status != 404]
            return {"refused": bool(refusals), "line": "; ".join(refusals) or "every route 200"}
        return _guarded(work)


@dataclass
class Outcome:
    """What one copy did: its seed, changes, each tool's outcome, and what was touched outside it."""
    seed: int
    changes: list
    tools: dict
    outside: list

    def findings(self) -> dict[str, str]:
        """{signature: one line} per broken property: a traceback or a hang (signature: the tool,
        the exception's type, the file and function it was raised in), a status not 0/1/2, a
        reader refusing what verify passed, a file or connection outside the copy."""
        found = {f"{tool}: {o['type']} in {o['where']}": f"{tool}: {o['bug']} ({o['frame']})"
                 for tool, o in self.tools.items() if "bug" in o}
        readers = [tool for tool, o in self.tools.items() if tool != "verify" and o.get("refused")]
        if readers and self.tools["verify"].get("refused") is False:
            found[f"verify passed what {readers[0]} refused"] = (
                f"verify: 0 problems, but {', '.join(readers)} refused: "
                + "; ".join(f"{t}: {self.tools[t]['line'][:160]}" for t in readers))
        if self.outside:
            found["outside the set"] = f"outside the set: {'; '.join(self.outside[:3])}"
        return found


class _Outside:
    """An audit hook recording files opened under ``root`` but outside the copy and the work folder,
    any of ``BAIT``'s absolute paths, and connections to anything but the viewer's port."""

    def __init__(self, root: str):
        self.root, self.allowed, self.port, self.seen = os.path.realpath(root), (), None, []
        sys.addaudithook(self.hook)

    def hook(self, event: str, args) -> None:
        if event == "open" and isinstance(args[0], (str, bytes)) and self.allowed:
            path = os.path.realpath(os.fsdecode(args[0]))
            inside = any(path == a or path.startswith(a + os.sep) for a in self.allowed)
            if (path.startswith(self.root + os.sep) and not inside) or path in ("/etc/passwd",):
                self.seen.append(f"opened {path}")
        elif event == "socket.connect" and self.allowed:
            address = args[1]
            if not (isinstance(address, tuple) and address[0] == "127.0.0.1" and address[1] == self.port):
                self.seen.append(f"connected to {address!r}")


def _child(sound: Sound, seeds: list[int], root: str, results: str, viewer_every: int) -> None:
    # GNU OpenMP's thread pool does not survive a fork: a parent that has run a parallel op (any
    # earlier test in this pytest process) leaves the child to hang or crash in its first one, as
    # torch's DataLoader workers avoid by the same call
    torch.set_num_threads(1)
    signal.signal(signal.SIGALRM, _on_alarm)
    resource.setrlimit(resource.RLIMIT_AS, (_address_space() + MEMORY_HEADROOM,) * 2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    logging.disable(logging.WARNING)  # the service's log.exception of a 500 still reaches _Failures
    work = os.path.join(root, f"work-{os.getpid()}")
    os.makedirs(work)
    outside = _Outside(root)
    site = _ViewerSite(work) if viewer_every else None
    outside.port = site.port if site else None
    with open(results, "a") as out:
        for seed in seeds:
            out.write(json.dumps({"started": seed}) + "\n")
            out.flush()
            copy = os.path.join(root, f"copy-{seed}")
            changes = mutation(seed, sound)
            apply(changes, sound, copy)
            outside.allowed, outside.seen = (copy, work), []
            tools = {"verify": _command(["verify", copy, "--workers", "1"]),
                     "stats": _command(["stats", copy, "--probe", "0"]),
                     "preview": _command(["preview", copy, "--clips", "2", "--height", "16",
                                          "--out", os.path.join(work, "sheet.png")]),
                     "loader": _loader(copy)}
            if site and seed % viewer_every == 0:
                tools["viewer"] = site.visit(copy, seed)
            seen, outside.allowed = outside.seen, ()
            out.write(json.dumps({"seed": seed, "changes": changes, "tools": tools, "outside": seen},
                                 default=repr) + "\n")
            out.flush()
            shutil.rmtree(copy, ignore_errors=True)
    if site:
        site.close()


def _address_space() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


class Campaign:
    """Copies of ``sound`` made and checked under ``root`` (each removed once checked)."""

    def __init__(self, sound: Sound, root: str, viewer_every: int = 4):
        self.sound, self.root, self.viewer_every = sound, root, viewer_every
        import service.api.app  # noqa: F401  (imported once, before the children fork)
        import service.viewer  # noqa: F401
        import trainer.data.loader  # noqa: F401

    def run(self, seeds: list[int]) -> list[Outcome]:
        results = os.path.join(self.root, "results.jsonl")
        done: dict[int, Outcome] = {}
        todo = list(seeds)
        while todo:
            open(results, "w").close()
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    _child(self.sound, todo, self.root, results, self.viewer_every)
                except BaseException:  # the engine itself failed: say so in the results, not silently
                    with open(results, "a") as out:
                        out.write(json.dumps({"engine": traceback.format_exc()}) + "\n")
                    code = 3
                os._exit(code)
            status = _wait(pid, results)
            started = None
            with open(results) as f:
                for line in f:
                    row = json.loads(line)
                    if "engine" in row:
                        raise AssertionError("the campaign's child failed:\n" + row["engine"])
                    if "started" in row:
                        started = row["started"]
                    else:
                        done[row["seed"]] = Outcome(row["seed"], row["changes"], row["tools"], row["outside"])
                        started = None
            if started is None:
                break
            done[started] = Outcome(started, mutation(started, self.sound),
                                    {"verify": {"bug": f"child died ({_describe(status)})", "frame": "?",
                                                "type": "died", "where": "?"}}, [])
            shutil.rmtree(os.path.join(self.root, f"copy-{started}"), ignore_errors=True)
            todo = todo[todo.index(started) + 1:]
        return [done[s] for s in seeds if s in done]


def _wait(pid: int, results: str) -> int:
    """The child's exit status; a child whose results stop growing for longer than all its tools'
    alarms together (stuck where no alarm reaches) is killed with SIGKILL."""
    import time

    seen, since = -1, time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        size = os.path.getsize(results)
        if size != seen:
            seen, since = size, time.monotonic()
        elif time.monotonic() - since > 6 * TIME_LIMIT_S:
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit status {os.WEXITSTATUS(status)}"
