"""Where a build asked for over HTTP may read: the roots the operator allows (``--source-root``).

A root is a local directory or a URL prefix (``s3://bucket/videos``, ``https://host/videos``).
A request's ``src`` is allowed when it lies under a root:

  * a local path (or ``file://`` URL) is resolved first, ``..`` and symbolic links included, and
    must then be a root or below one, by whole path components (``/data/videos2`` is not under
    ``/data/videos``); the build reads the resolved path. Every symbolic link inside the tree
    (to a video, a class folder, an annotation file) must resolve under a root too.
  * a URL needs a root of the same scheme and host, and a path that is the root's or below it;
    dot segments (also percent-encoded), a query, a fragment or credentials are refused, and so
    are chained fsspec URLs (``zip::s3://...``): each names storage no root allows.

With no root nothing is allowed: a server started without ``--source-root`` refuses every build
(403). The check is made when the request arrives; whoever can write inside a root can still
change what is there afterwards, so roots should hold only what builds may read.
"""
from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit


class SourceRefused(Exception):
    """A build's source outside what the operator allows (the message names the rule)."""


def _local(location: str) -> str | None:
    """The local path of a path or ``file://`` URL; None for any other URL."""
    if "://" not in location and "::" not in location:
        return location
    parts = urlsplit(location)
    if parts.scheme == "file" and parts.netloc in ("", "localhost") and "::" not in location:
        return unquote(parts.path)
    return None


def _segments(path: str) -> list[str]:
    return [s for s in path.split("/") if s]


class SourceRoots:
    """The allowed roots; ``check`` says whether a request's ``src`` lies under one of them."""

    def __init__(self, roots: list[str]):
        self.local: list[str] = []
        self.urls: list[tuple[str, str, list[str]]] = []  # (scheme, host, path segments)
        for root in roots:
            path = _local(root)
            if path is not None:
                self.local.append(os.path.realpath(path))
                continue
            parts = urlsplit(root)
            if "::" in root or not parts.scheme or parts.query or parts.fragment or "@" in parts.netloc:
                raise ValueError(f"--source-root {root}: give a local directory or a plain URL prefix "
                                 "(scheme://host/path)")
            self.urls.append((parts.scheme.lower(), parts.netloc.lower(), _segments(parts.path)))

    def __bool__(self) -> bool:
        return bool(self.local or self.urls)

    def describe(self) -> str:
        return ", ".join([*self.local, *(f"{s}://{h}/{'/'.join(p)}" for s, h, p in self.urls)]) or "none"

    def check(self, src: str) -> str:
        """The location to build from (a local path resolved); SourceRefused if no root allows ``src``."""
        if not self:
            raise SourceRefused("builds over HTTP are disabled: the server was started without --source-root")
        path = _local(src)
        if path is not None:
            real = os.path.realpath(path)
            if not self.allows_local(real):
                raise SourceRefused(f"src {src}: resolves to {real}, which is under no --source-root "
                                    f"(allowed: {self.describe()})")
            return real
        if "::" in src:
            raise SourceRefused(f"src {src}: chained URLs are not allowed")
        parts = urlsplit(src)
        if parts.query or parts.fragment or "@" in parts.netloc:
            raise SourceRefused(f"src {src}: a source URL may have no query, fragment or credentials")
        segments = _segments(parts.path)
        if any(unquote(s) in (".", "..") or "/" in unquote(s) or "\\" in unquote(s) for s in segments):
            raise SourceRefused(f"src {src}: dot segments and encoded slashes are not allowed in a source "
                                "URL")
        scheme, host = parts.scheme.lower(), parts.netloc.lower()
        if not any(scheme == s and host == h and segments[:len(p)] == p for s, h, p in self.urls):
            raise SourceRefused(f"src {src}: {scheme}://{host} is under no --source-root "
                                f"(allowed: {self.describe()})")
        return src

    def allows_local(self, real: str) -> bool:
        return any(real == root or real.startswith(root.rstrip("/") + "/") for root in self.local)

    def check_tree(self, top: str) -> None:
        """SourceRefused if a symbolic link anywhere under the local directory ``top`` resolves
        outside every root (a link inside a root to a directory inside a root is followed)."""
        seen, stack = set(), [top]
        while stack:
            directory = stack.pop()
            real = os.path.realpath(directory)
            if real in seen:
                continue
            seen.add(real)
            try:
                entries = list(os.scandir(directory))
            except OSError:
                continue  # unreadable: the listing reports it
            for entry in entries:
                if entry.is_symlink():
                    target = os.path.realpath(entry.path)
                    if not self.allows_local(target):
                        raise SourceRefused(f"src {top}: {entry.path} is a symbolic link to {target}, which "
                                            f"is under no --source-root (allowed: {self.describe()})")
                if entry.is_dir():
                    stack.append(entry.path)
