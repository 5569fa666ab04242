"""Grants: the service decides once, nginx checks every request (``serve --grant-links DIR``).

Behind nginx (``--x-accel-redirect``, docker/nginx-replicas.conf), a GET of a local set's shard that
nginx could send (``service.accel``) is decided here as always: the token, the set's state and
refusals (removed 404, replaced 410, damaged 409), the file's checks, conditionals, the range. Then,
instead of handing nginx the file for this one request, the service grants the client the file
for ``--grant-seconds`` (``GRANT_SECONDS``): it answers ``307`` to a URL nginx checks by itself,
as S3's presigned URLs are checked by S3::

    /_grant/<set id>/<file>?expires=<unix time>&md5=<base64url(MD5(expires URI Authorization " " secret))>

``Cache-Control: private, max-age=<seconds>`` on the 307 lets the client keep the grant
(``shards.io.http_range`` does: every range of that file, from every thread of the process, goes to
nginx straight until it expires, and a 403 or 410 from the grant sends the client back here for a
new one). nginx's ``secure_link`` checks each request against the same secret (the one the
front proved itself with, ``X-Accel-Secret``: nginx holds it in ``grant-secret.conf``), 403 when
the URL or the Authorization header was altered, 410 once ``expires`` has passed, and sends the
file with ``sendfile``; no byte and no request reach Python. The grant is bound to who asked: the
``Authorization`` header the client sent is in the signed text, so the URL is worthless with
another token or none.

What a grant does not see: a set removed, replaced or found damaged, or a token taken off
``--token-file``, is refused from the next grant on; a grant already given is honoured until it
expires, so ``--grant-seconds`` bounds how long a revoked client can still read (60 s by default).

nginx finds the file through ``DIR/<set id>``, a symbolic link to the set's directory this module
keeps (written before the first grant of the set on this replica, replaced atomically if the set's
location differs): the URL names the set and file as the API does, never a server path. nginx
follows no symbolic link below that link (``disable_symlinks on from=DIR/<set id>``). DIR must be
the same directory for nginx and every replica (shared storage, as the sets are).

MD5 with a secret is what Debian's nginx-light has (``ngx_http_secure_link_module``; an HMAC
needs njs or Lua, which it lacks); the secret is 16 or more characters and never leaves the
front and the replicas.
"""
from __future__ import annotations

import base64
import hashlib
import os
import re
import time
import uuid
from dataclasses import dataclass, field

PREFIX = "/_grant"
GRANT_SECONDS = 60
_SET_ID = re.compile(r"[0-9a-f]{64}")  # what nginx's /_grant/ location takes for a set


def signature(uri: str, expires: int, authorization: str, secret: str) -> str:
    """What nginx's ``secure_link_md5 "$secure_link_expires$uri$http_authorization $grant_secret"``
    computes."""
    digest = hashlib.md5(f"{expires}{uri}{authorization} {secret}".encode()).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


@dataclass
class Grants:
    """Grants of ``seconds`` through the links in ``links`` (module docstring)."""
    links: str
    seconds: int = GRANT_SECONDS
    linked: dict = field(default_factory=dict)  # set id -> the directory its link points at

    @staticmethod
    def covers(set_id: str, name: str) -> bool:
        """Whether a file is granted rather than handed over: a shard, of a set nginx's location takes."""
        return name.endswith(".tar") and _SET_ID.fullmatch(set_id) is not None

    def link(self, set_id: str, root: str) -> None:
        """``links/<set_id>`` pointing at ``root``, the set's directory (written when missing or other)."""
        if self.linked.get(set_id) == root:
            return
        path = os.path.join(self.links, set_id)
        try:
            current = os.readlink(path)
        except OSError:
            current = None
        if current != root:
            tmp = f"{path}.tmp-{uuid.uuid4().hex}"
            os.symlink(root, tmp)
            os.replace(tmp, path)  # atomic: nginx sees the old link or the new one
        self.linked[set_id] = root

    def location(self, set_id: str, name: str, authorization: str, secret: str) -> tuple[str, int]:
        """The grant's URL for file ``name`` of set ``set_id``, and its ``max-age``."""
        expires = int(time.time()) + self.seconds
        uri = f"{PREFIX}/{set_id}/{name}"  # plain: the request path was checked (service.api.middleware)
        md5 = signature(uri, expires, authorization, secret)
        return f"{uri}?expires={expires}&md5={md5}", self.seconds - 1
