"""Bytes sent by nginx, every check kept here (``serve --x-accel-redirect PREFIX``); with
``--grant-links``, shards are granted instead, nginx checking each request (``service.grants``).

Behind nginx (configured as docker/nginx-replicas.conf is), a GET of a local set's file is decided here as
always (the token, the set's state and refusals, the file's checks, ETag and Cache-Control, conditionals and
the range), and when the answer is 200 or 206 the service sends no byte: it answers nginx with those headers
and ``X-Accel-Redirect: PREFIX/<the file's path>``, and nginx sends the file from its internal
location with ``sendfile``. The request must say nginx is there to do it (``X-Sendfile-Type:
X-Accel-Redirect``, which nginx's ``proxy_set_header`` adds, as Rack's sendfile middleware asks)
and prove it came from the front: ``X-Accel-Secret`` holding one of the secrets of
``--x-accel-secret-file``, which the front's ``proxy_set_header`` sends (docker/nginx-replicas.conf
includes it from ``accel-secret.conf`` beside it), compared in constant time. Anyone else, a client
that reaches a replica directly with ``X-Sendfile-Type`` included, gets the bytes from the service,
as without the flag, and never a server path (``X-Accel-Redirect``, ``X-Accel-Root``).

nginx applies the client's own Range to the file (its range filter) and never its own
validators (its location has ``etag off`` and ``if_modified_since off``, and carries the service's
ETag, which its If-Range check then compares), so it must reach the answer decided here. It does
for the requests ``nginx_agrees`` lets through, and the service answers every other one itself,
bytes and all, exactly as without nginx:

  * no ``If-Match`` or ``If-Unmodified-Since`` (nginx would test them against its own
    validators, which it has none of);
  * no ``Range``, or one plain range ``bytes=A-B``, ``bytes=A-`` or ``bytes=-N`` of at most 18 digits a
    number (spaces, several ranges, other units, longer numbers are parsed differently by nginx or
    refused here: ``service.ranges``);
  * the whole file: a frame of the viewer (a span inside a shard) is sent by the service.

Refusals, 304s, 412s and 416s never carry a byte and are answered here. HEADs too. The file is
opened and checked here first (``service.files.open_local``: no symbolic link below the set's
directory, a regular file of the recorded size and stamp) and nginx opens it again with
``disable_symlinks on from=`` that directory: a file swapped between the two is refused by nginx,
or served with the checked ETag, which the client's per-sample digests then judge.
"""
from __future__ import annotations

import hmac
import re
from dataclasses import dataclass
from urllib.parse import quote

from .grants import Grants

SENDFILE_TYPE = "X-Accel-Redirect"
SECRET_HEADER = "X-Accel-Secret"
SECRET = re.compile(r"[A-Za-z0-9_-]{16,}")  # what nginx's config holds between quotes as it is
_PLAIN_RANGE = re.compile(r"bytes=(\d{1,18}-\d{0,18}|-\d{1,18})", re.IGNORECASE)


@dataclass(frozen=True)
class Front:
    """The nginx in front: its internal location ``prefix``, the secrets its requests carry
    (several while one is replaced by another), and the grants it checks (``service.grants``; None:
    every file handed over by ``X-Accel-Redirect``)."""
    prefix: str
    secrets: tuple[str, ...]
    grants: Grants | None = None

    def sends(self, headers) -> str | None:
        """The secret the request proved it came through this front with, if it asks it to send the
        file (None otherwise): the one nginx holds, so the one a grant is signed with."""
        given = headers.get(SECRET_HEADER, "").encode()
        trusted = [hmac.compare_digest(given, s.encode()) for s in self.secrets]  # every secret compared
        if any(trusted) and headers.get("X-Sendfile-Type", "").strip().lower() == SENDFILE_TYPE.lower():
            return self.secrets[trusted.index(True)]
        return None

    def redirect(self, root: str, name: str) -> dict:
        """The headers that hand ``root/name`` to nginx: its internal URI, and the directory below
        which it must follow no symbolic link."""
        return {"X-Accel-Redirect": self.prefix.rstrip("/") + quote(f"{root.rstrip('/')}/{name}"),
                "X-Accel-Root": root.rstrip("/") or "/"}


def nginx_agrees(headers) -> bool:
    """Whether nginx, sending the whole file for this request, answers as ``service.ranges`` decided."""
    if "If-Match" in headers or "If-Unmodified-Since" in headers:
        return False
    ranges = headers.getall("Range", []) if hasattr(headers, "getall") else [headers.get("Range")]
    ranges = [r for r in ranges if r is not None]
    return not ranges or (len(ranges) == 1 and _PLAIN_RANGE.fullmatch(ranges[0]) is not None)
