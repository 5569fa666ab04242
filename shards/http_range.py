"""Byte ranges over HTTP, checked and retried: one streamed GET per range through fsspec's
HTTP filesystem, resumed where it broke off.

Every response must be exactly what was asked (``range_problem``): 206, a ``Content-Range``
whose first and last byte and total size are the requested ones, a ``Content-Length`` equal
to the range, a body of that length, and, when the server sends a SHA-256 strong ETag (as
the dataset service does), the manifest's SHA-256. Anything else (a 200 with the whole file,
a short body, a wrong total, another ETag, a 5xx, a dropped connection) is retried from the
first missing byte with exponential backoff and jitter (``Retry.attempts`` requests in all
per range), then fails naming the URL, the bytes and the last problem. 404 and other 4xx answers fail at once: asking again will not help.
"""
from __future__ import annotations

import asyncio
import io
import random
import re
import time
from dataclasses import dataclass
from typing import Mapping

import aiohttp
from fsspec.core import url_to_fs

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)$")
_SHA256_ETAG = re.compile(r'"([0-9a-f]{64})"$')
_RETRIED_4XX = {408, 425, 429}


@dataclass(frozen=True)
class Retry:
    attempts: int = 5  # tries per missing byte range before giving up
    backoff: float = 0.25  # seconds before the second try, doubling up to max_backoff
    max_backoff: float = 8.0

    def sleep(self, failures: int) -> None:
        base = min(self.max_backoff, self.backoff * 2 ** (failures - 1))
        time.sleep(base * (0.5 + random.random() / 2))


DEFAULT_RETRY = Retry()


class RangeError(OSError):
    """A byte range that could not be read as asked, after the retries."""


def range_problem(status: int, headers: Mapping[str, str], start: int, end: int,
                  size: int | None = None, sha256: str | None = None) -> str | None:
    """Why a response to ``Range: bytes=start-(end-1)`` cannot be used, or None if it can.

    ``size``: the file's total size as the manifest says; ``sha256``: its digest.
    """
    if status != 206:
        return f"status {status}, expected 206 Partial Content"
    text = headers.get("Content-Range", "")
    m = _CONTENT_RANGE.match(text.strip())
    if not m:
        return f"Content-Range {text!r} is not 'bytes {start}-{end - 1}/SIZE'"
    first, last, total = int(m[1]), int(m[2]), m[3]
    if (first, last) != (start, end - 1):
        return f"Content-Range {text!r} answers other bytes than {start}-{end - 1}"
    if total == "*" or (size is not None and int(total) != size) or int(total) < end:
        return f"Content-Range {text!r}: total size {total}, expected {size if size is not None else f'>= {end}'}"
    length = headers.get("Content-Length")
    if length is not None and length.strip() != str(end - start):
        return f"Content-Length {length}, expected {end - start}"
    etag = _SHA256_ETAG.match(headers.get("ETag", "").strip())
    if sha256 and etag and etag[1] != sha256:
        return f"ETag {etag[1][:12]}... differs from the manifest's SHA-256 {sha256[:12]}... (file changed)"
    return None


class HTTPRange(io.RawIOBase):
    """Bytes [start, end) of an HTTP(S) URL as a raw stream (wrap it in ``io.BufferedReader``)."""

    def __init__(self, url: str, start: int, end: int, size: int | None = None, sha256: str | None = None,
                 retry: Retry = DEFAULT_RETRY):
        self.url, self.start, self.pos, self.end = url, start, start, end
        self.size, self.sha256, self.retry = size, sha256, retry
        self.fs, self.path = url_to_fs(url)
        self.f = None
        self.failures, self.problem = 0, ""

    def readable(self) -> bool:
        return True

    def _failed(self, problem: str) -> None:
        """Note a failure; raise after the last try, else back off before the next."""
        self._drop()
        self.failures += 1
        self.problem = problem
        if self.failures >= self.retry.attempts:
            raise RangeError(f"{self.url}: bytes {self.start}-{self.end - 1}, at byte {self.pos}: {problem}; "
                             f"gave up after {self.failures} attempts")
        self.retry.sleep(self.failures)

    def _fatal(self, problem: str) -> None:
        self._drop()
        raise RangeError(f"{self.url}: bytes {self.start}-{self.end - 1}, at byte {self.pos}: {problem}")

    def _open(self) -> None:
        try:
            f = self.fs.open(self.path, "rb", block_size=0, size=self.end,
                             headers={"Range": f"bytes={self.pos}-{self.end - 1}"})
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.url}: not found (404)") from None
        except aiohttp.ClientResponseError as e:
            if 400 <= e.status < 500 and e.status not in _RETRIED_4XX:
                self._fatal(f"status {e.status} {e.message}")
            return self._failed(f"status {e.status} {e.message}")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            return self._failed(f"{type(e).__name__}: {e}")
        self.f = f
        problem = range_problem(f.r.status, f.r.headers, self.pos, self.end, self.size, self.sha256)
        if problem:
            self._failed(problem)

    def readinto(self, buf) -> int:
        while self.pos < self.end:
            if self.f is None:
                self._open()
                continue
            try:
                data = self.f.read(min(len(buf), self.end - self.pos))
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                self._failed(f"reading the body: {type(e).__name__}: {e}")
                continue
            if not data:
                self._failed(f"the body ended {self.end - self.pos} bytes short")
                continue
            n = len(data)
            buf[:n] = data
            self.pos += n
            if self.pos == self.end:
                self._drop()
            return n
        return 0

    def _drop(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None

    def close(self) -> None:
        self._drop()
        super().close()
