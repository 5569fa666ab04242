"""The manifest: one JSON file per output directory describing every shard and sample.

Readers (the loader, ``shards verify``, the service) read this one small file instead of
listing or stat-ing the filesystem. Shard names are relative to the manifest's directory,
so a shard set can be moved or served over HTTP as a whole.

A set's ``identity`` is the SHA-256 of its class list and, per split, every shard's name, sample
count, size and SHA-256: what the set *is*, whoever wrote it and from what. Two builds with the
same bytes have it (builds are deterministic), a set served over HTTP has its directory's, and
any other options (frames, clips per video, motion, shard size, a reshard) give another. It is
distinct from ``fingerprint``, the builder's hash of the input videos alone, which sets built
from the same videos with other options share. The loader's position and a checkpoint record
the identity, so a resume on another set is refused. It is written into the manifest for readers
of the file; a loaded manifest derives it from its shard list (so manifests written before it
existed have it too, and a stored value that no longer matches the shards cannot pass for them).

Format versions: ``/2`` adds each sample's xxh3-64 digest (``ShardInfo.digests``, checked by
every reader as the bytes arrive: ``shards.format.digests``); ``/1`` manifests, without them, are still
read (their samples are checked only by the shard's SHA-256).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field

from ..base.errors import CommandError, NotFound
from ..io import storage
from ..io.http_range import DEFAULT_RETRY, Retry, patiently
from . import checks
from .checks import BadManifest

MANIFEST_NAME = "manifest.json"
CLASSES_NAME = "classes.txt"  # the class names, one a line, in label order
LEDGER_NAME = "errors.jsonl"  # one JSON line per input that could not be used
STAGING_NAME = ".staging"  # a build's work in progress, gone once it finishes
SET_FILES = (MANIFEST_NAME, CLASSES_NAME, LEDGER_NAME)  # besides the shards, what a set holds
FORMAT = "kinetics-fast-shards/2"
READABLE_FORMATS = ("kinetics-fast-shards/1", FORMAT)
MAX_MANIFEST_BYTES = 1 << 30  # Kinetics-700's is about 70 MB


@dataclass
class ShardInfo:
    name: str  # path relative to the manifest's directory
    num_samples: int
    bytes: int
    sha256: str
    keys: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # byte offset of each sample's first header
    lengths: list[int] = field(default_factory=list)  # bytes from that header to the sample's end
    labels: list[int] = field(default_factory=list)  # class index per sample, -1 when unlabeled
    digests: list[str] = field(default_factory=list)  # xxh3-64 hex of each sample's bytes (format /2)


@dataclass
class SplitInfo:
    shards: list[ShardInfo] = field(default_factory=list)
    num_failed: int = 0
    # the videos used with a caveat (few frames, no motion vectors, ...) or listed but not found, by the
    # code of the ledger's warning; written only when there are some (manifests before it lack it)
    warnings: dict[str, int] = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)

    @property
    def num_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)


@dataclass
class Manifest:
    classes: list[str]
    splits: dict[str, SplitInfo]
    config: dict = field(default_factory=dict)
    fingerprint: str = ""
    format: str = FORMAT
    base: str = ""  # directory URL the manifest was loaded from; not serialised

    @property
    def motion(self) -> str:
        """The motion fields stored beside the frames (``shards.format.motionfield``): "mv", "flow"
        or "none"."""
        return self.config.get("clip", {}).get("motion", "none")

    @property
    def frames(self) -> int | None:
        """Frames per clip, as the build recorded it (None for a set whose manifest does not say)."""
        return self.config.get("clip", {}).get("frames")

    @property
    def identity(self) -> str:
        """The set itself (module docstring): SHA-256 hex over the classes and every shard's name,
        sample count, size and SHA-256."""
        body = {"classes": self.classes,
                "splits": {name: [[s.name, s.num_samples, s.bytes, s.sha256] for s in split.shards]
                           for name, split in self.splits.items()}}
        return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def describe(self) -> str:
        """The set in a few words for a message (``describe``)."""
        return describe({name: split.num_samples for name, split in self.splits.items()},
                        self.config.get("clip", {}))

    def title(self) -> str:
        """``shard set IDENTITY (what it holds)`` for a message (``set_title``)."""
        return set_title(self.identity, self.describe())

    def shard_url(self, shard: ShardInfo) -> str:
        return storage.join(self.base, shard.name)

    def to_json(self) -> bytes:
        d = asdict(self)
        d.pop("base")
        d["identity"] = self.identity
        for split in d["splits"].values():
            split["num_samples"] = sum(s["num_samples"] for s in split["shards"])
            if not split["warnings"]:
                del split["warnings"]
        return json.dumps(d, sort_keys=True, separators=(",", ":")).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes, base: str = "") -> "Manifest":
        """The manifest in ``data`` (the file at ``base``), checked before anything is made of it
        (``shards.format.checks``): ``BadManifest``, one line naming the file, field and reason."""
        where = storage.join(base, MANIFEST_NAME) if base else MANIFEST_NAME
        if len(data) > MAX_MANIFEST_BYTES:
            raise BadManifest(f"{where}: {len(data):,} bytes, more than a manifest this build reads "
                              f"({MAX_MANIFEST_BYTES:,})")
        try:
            d = json.loads(data)
        except UnicodeDecodeError as e:
            raise BadManifest(f"{where}: not UTF-8 JSON (byte {e.start}: {e.reason})") from None
        except ValueError as e:
            raise BadManifest(f"{where}: not JSON ({e})" if data.strip()
                              else f"{where}: empty file") from None
        except RecursionError:
            raise BadManifest(f"{where}: not JSON a manifest can hold (nested too deeply)") from None
        checks.check(d, where, READABLE_FORMATS, FORMAT)
        splits = {}
        for name, s in d["splits"].items():
            shards = [ShardInfo(**sh) for sh in s["shards"]]
            splits[name] = SplitInfo(shards=shards, num_failed=s.get("num_failed", 0),
                                     warnings=s.get("warnings", {}))
        return cls(classes=d["classes"], splits=splits, config=d.get("config", {}),
                   fingerprint=d.get("fingerprint", ""), format=d["format"], base=base)

    def save(self, directory: str) -> str:
        url = storage.join(directory, MANIFEST_NAME)
        storage.atomic_write(url, self.to_json())
        self.base = directory
        return url

    @classmethod
    def load(cls, url: str, retry: Retry = DEFAULT_RETRY) -> "Manifest":
        """Load from a directory URL or from the manifest file's URL; an HTTP source that is down is
        waited for as ``retry`` says (``shards.io.http_range``: up to the source deadline)."""
        if url.rstrip("/").endswith(".json"):
            base = url.rsplit("/", 1)[0] if "/" in url else "."
        else:
            base, url = url.rstrip("/"), storage.join(url, MANIFEST_NAME)
        try:
            if url.startswith(("http://", "https://")):
                data = patiently(lambda: storage.read_bytes(url, MAX_MANIFEST_BYTES + 1), url, retry)
            else:
                data = storage.read_bytes(url, MAX_MANIFEST_BYTES + 1)
        except CommandError:  # (SourceUnavailable: the source stayed down past its deadline)
            raise
        except Exception as e:
            if url.startswith(("http://", "https://")):
                raise _http_refusal(url, e) from None
            if isinstance(e, (IsADirectoryError, PermissionError, NotADirectoryError)):
                raise NotFound(f"{url}: {os.strerror(e.errno).lower()}") from None
            if not isinstance(e, FileNotFoundError):
                raise
            if not storage.exists(base):
                raise NotFound(f"{base}: no such file or directory") from None
            raise NotFound(f"{url}: no manifest (was the shard set built to the end?)") from None
        return cls.from_json(data, base=base)


def describe(clips: dict[str, int], clip: dict) -> str:
    """A set in a few words: its clips per split and the build options that shape a clip, from
    ``clip`` (a manifest's ``config["clip"]``, or a catalog record's), e.g. ``96 train + 8 val
    clips, 4 frames, 4 clips per video``."""
    words = [f"{' + '.join(f'{n} {name}' for name, n in clips.items()) or 'no'} clips"]
    if "frames" in clip:
        words.append(f"{clip['frames']} frames")
    for key, unit in (("clips_per_video", "clips"), ("eval_clips", "eval clips")):
        if clip.get(key, 1) != 1:
            words.append(f"{clip[key]} {unit} per video")
    if clip.get("short_side"):
        words.append(f"short side {clip['short_side']}")
    if clip.get("motion", "none") != "none":
        words.append(f"motion {clip['motion']}")
    return ", ".join(words)


def set_title(identity: str, description: str) -> str:
    """A set named in a message: its identity's first 16 hex digits (64 bits: enough to tell sets
    apart, short enough to read) and what it holds."""
    return f"shard set {identity[:16]} ({description})"


def _http_refusal(url: str, error: Exception) -> CommandError:
    """The error for a manifest an HTTP server would not give, with the server's own words (fsspec's
    errors drop its body): asked again with the standard library's client and the same headers."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, headers=storage.http_headers(url.split(":", 1)[0]))
    try:
        with urllib.request.urlopen(request, timeout=30):
            return CommandError(f"{url}: {error}")  # answered this time: report the first failure
    except urllib.error.HTTPError as e:
        said = e.read(2000).decode("utf-8", "replace").strip().splitlines()
        text = f"{url}: HTTP {e.code}: {said[0] if said else e.reason}"
        if e.code in (401, 403):
            return CommandError(
                text + """; give the token as FSSPEC_HTTP_HEADERS='{"Authorization": "Bearer TOKEN"}'""")
        return NotFound(text) if e.code == 404 else CommandError(text)
    except OSError as e:
        return CommandError(f"{url}: {getattr(e, 'reason', e)}")


def digest(obj) -> str:
    """A short stable hash of a JSON-serialisable object (for configs and fingerprints)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
