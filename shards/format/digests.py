"""Every sample's bytes checked against the manifest's per-sample digest as they are read.

A shard's SHA-256 can only be checked once the whole shard is read, and a reader of byte ranges
(the loader, over HTTP, from an object store, from the node-local cache) never reads a whole
shard. So format ``/2`` manifests carry each sample's xxh3-64 digest (``ShardInfo.digests``): about
16 GB/s on one core here, 9 us for a 150 kB clip (CRC32C 17 us, zlib's CRC-32 63 us, SHA-256
126 us; ``bench/digest.py``). ``CheckedSamples`` passes a range of whole samples through one
sample at a time, each checked before any of its bytes are handed on. A sample whose bytes
differ is read again once, on its own, from the same URL (a new request: a bit flipped on the
wire or by a proxy is not flipped twice); if it differs again the read fails naming the shard,
the sample, both digests and the URL (``CorruptSample``, whose attributes hold the same), or, for a
reader that goes on without such samples, the sample's bytes are replaced by what ``replace``
makes of that ``CorruptSample`` (the trainer's loader: a marker it recognises).
"""
from __future__ import annotations

import io

import xxhash

from ..base.errors import DataFault

ALGORITHM = "xxh3-64"


def sample_digest(data) -> str:
    return xxhash.xxh3_64_hexdigest(data)


class CorruptSample(DataFault, OSError):
    """A sample whose bytes differ from the manifest's digest twice in a row: deterministic, never
    retried as if it were transient. Attributes: ``url``, ``shard`` (its name in the manifest),
    ``key``, ``index`` (the sample's in the shard), ``expected`` and ``found`` (the digests)."""

    FACTS = ("url", "shard", "key", "index", "expected", "found")

    @classmethod
    def of(cls, url: str, shard: str, key: str, index: int, expected: str, found: str,
           why: str = "read twice"):
        return cls(f"{url}: shard {shard}, sample {key}: {ALGORITHM} digest {found}, the manifest says "
                   f"{expected} ({why})", url=url, shard=shard, key=key, index=index, expected=expected,
                   found=found)

    def facts(self) -> dict:
        return {k: getattr(self, k) for k in self.FACTS}


class ShortShard(DataFault):
    """A shard that ends before the bytes the manifest gives it: ``url``, ``shard``, ``key`` (the
    sample it ends in), ``at`` (the byte it ends at), ``missing`` (bytes short of the manifest's size)."""

    @classmethod
    def of(cls, url: str, info, key: str, at: int) -> "ShortShard":
        missing = info.bytes - at
        return cls(f"{url}: shard {info.name} ends at byte {at:,}, inside sample {key}: {missing:,} of the "
                   f"manifest's {info.bytes:,} bytes missing (a partial copy?)", url=url, shard=info.name,
                   key=key, at=at, missing=missing)


CHUNK = 1 << 20  # what a read of a sample asks for at a time


def read_upto(src, n: int) -> bytes:
    """Up to ``n`` bytes of ``src``, a chunk at a time: a stream that ends early gives what it had,
    and no more than that and a chunk is allocated, whatever size the manifest claims."""
    parts, got = [], 0
    while got < n:
        part = src.read(min(CHUNK, n - got))
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


class TooManyBadSamples(DataFault):
    """More bad samples than a reader's budget allows (``--max-bad-samples``)."""


class CheckedSamples(io.RawIOBase):
    """Bytes [offsets[first], end of sample last) of a shard (``info``, a manifest ``ShardInfo``),
    read from ``src`` (a stream of those bytes; by default ``opener`` of them), each sample
    checked against ``info.digests`` before it is handed on; one that fails is read again through
    ``opener(start, end)`` (a function returning a readable binary stream of those bytes of the
    shard, from its source). A sample that fails again raises its ``CorruptSample``, or with
    ``replace`` (a function of that ``CorruptSample`` returning bytes) is handed on as those bytes."""

    def __init__(self, url: str, info, first: int, last: int, opener, src=None, replace=None):
        self.url, self.info, self.opener, self.replace = url, info, opener, replace
        self.next, self.last = first, last  # samples [next, last] are still to come
        self.src = (src if src is not None
                    else opener(info.offsets[first], info.offsets[last] + info.lengths[last]))
        self.buf, self.at = b"", 0

    def readable(self) -> bool:
        return True

    def _sample(self) -> bytes:
        """The next sample's bytes (and any gap before the one after it), checked."""
        i, info = self.next, self.info
        end = info.offsets[i + 1] if i < self.last else info.offsets[i] + info.lengths[i]
        data = read_upto(self.src, end - info.offsets[i])
        if len(data) < info.lengths[i]:
            raise ShortShard.of(self.url, info, info.keys[i], info.offsets[i] + len(data))
        if sample_digest(memoryview(data)[:info.lengths[i]]) != info.digests[i]:
            with self.opener(info.offsets[i], info.offsets[i] + info.lengths[i]) as again:
                retry = read_upto(again, info.lengths[i])
            got = sample_digest(retry)
            if got != info.digests[i]:
                error = CorruptSample.of(self.url, info.name, info.keys[i], i, info.digests[i], got)
                if self.replace is None:
                    raise error
                retry = self.replace(error)
            data = retry + data[info.lengths[i]:]
        self.next += 1
        return data

    def readinto(self, buf) -> int:
        if self.at >= len(self.buf):
            if self.next > self.last:
                return 0
            self.buf, self.at = self._sample(), 0
        n = min(len(buf), len(self.buf) - self.at)
        buf[:n] = memoryview(self.buf)[self.at:self.at + n]
        self.at += n
        return n

    def close(self) -> None:
        if not self.closed:
            self.src.close()
        super().close()
