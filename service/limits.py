"""What one client can hold of the server, bounded (the flags are ``shard-service serve``'s):

  * ``--header-timeout``: a connection must send a complete request head within this many
    seconds of opening, and of the end of the previous response on a kept-alive connection, or
    it is closed (aiohttp's keep-alive timer, which also closes idle connections then). A client
    sending its headers a byte at a time holds a connection this long, no longer.
  * ``--body-timeout``: a request body (only ``POST /v1/builds`` reads one) must arrive within
    this many seconds, else 408.
  * ``--max-connections`` at once, and ``--max-connections-per-client`` from one address: a
    connection over either gets ``503`` with ``Retry-After`` and is closed at once, before any
    of its bytes is read (``Admission``).
  * At start the open-files soft limit is raised to the hard limit (``raise_open_files``), and a
    default ``--max-connections`` lowered to what that allows: two descriptors a connection (its
    socket and the file being sent) and a reserve for the catalog, logs and build processes.
  * Should the process run out of descriptors all the same, it says so once per interval with a
    count (``OutOfFiles``), not once per failed accept or request.
"""
from __future__ import annotations

import asyncio
import errno
import json
import logging
import resource
import time
from collections import Counter

log = logging.getLogger("service.limits")
RESERVED_FILES = 128  # descriptors kept for everything but connections: catalog, logs, build processes
FILES_PER_CONNECTION = 2  # its socket and the file being sent from
OUT_OF_FILES = (errno.EMFILE, errno.ENFILE)


def raise_open_files() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one (as far as the kernel allows); return the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # an unlimited hard limit: as many as the kernel gives a process by default
    for target in (hard, 1 << 20):
        if target == resource.RLIM_INFINITY or target <= soft:
            continue
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError):
            continue
    return soft


def connections_allowed(open_files: int, asked: int) -> int:
    """The connection cap that fits ``open_files`` descriptors, at most ``asked``."""
    return max(1, min(asked, (open_files - RESERVED_FILES) // FILES_PER_CONNECTION))


def _answer(status: int, reason: str, message: str, extra: str = "") -> bytes:
    body = json.dumps({"error": message, "status": status}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n{extra}\r\n").encode() + body


class Admission:
    """Connection counts, all and per client address; one per server process (one event loop)."""

    def __init__(self, max_connections: int, max_per_client: int):
        self.max_connections, self.max_per_client = max_connections, max_per_client
        self.open, self.per_client = 0, {}
        self.refused = 0

    def admit(self, client: str) -> str | None:
        """None if a connection from ``client`` may open (and it is counted), else why not."""
        if self.max_connections and self.open >= self.max_connections:
            return f"the server holds its limit of {self.max_connections} connections (--max-connections)"
        if self.max_per_client and self.per_client.get(client, 0) >= self.max_per_client:
            return (f"{client} holds its limit of {self.max_per_client} connections "
                    "(--max-connections-per-client)")
        self.open += 1
        self.per_client[client] = self.per_client.get(client, 0) + 1
        return None

    def release(self, client: str) -> None:
        self.open -= 1
        if self.per_client[client] == 1:
            del self.per_client[client]
        else:
            self.per_client[client] -= 1

    def protocol(self, make_handler):
        """A protocol factory for ``loop.create_server``: aiohttp's handlers (``make_handler()``,
        the runner's server) behind this admission."""
        return lambda: _Admitted(self, make_handler())


class _Admitted(asyncio.Protocol):
    """An aiohttp request handler, opened only when ``Admission`` allows; every call passed on."""

    def __init__(self, admission: Admission, handler: asyncio.Protocol):
        self.admission, self.handler, self.client = admission, handler, None

    def connection_made(self, transport):
        peer = transport.get_extra_info("peername")
        client = peer[0] if isinstance(peer, tuple) else str(peer)
        refused = self.admission.admit(client)
        if refused:
            self.admission.refused += 1
            transport.write(_answer(503, "Service Unavailable", refused, "Retry-After: 1\r\n"))
            transport.close()
            return
        self.client = client
        self.handler.connection_made(transport)

    def connection_lost(self, exc):
        if self.client is not None:
            self.admission.release(self.client)
            self.handler.connection_lost(exc)

    def data_received(self, data):
        if self.client is not None:
            self.handler.data_received(data)

    def eof_received(self):
        return self.handler.eof_received() if self.client is not None else None

    def pause_writing(self):
        if self.client is not None:
            self.handler.pause_writing()

    def resume_writing(self):
        if self.client is not None:
            self.handler.resume_writing()


class OutOfFiles:
    """Running out of file descriptors, logged at most once per ``interval`` seconds, with the
    failures counted since the last report."""

    def __init__(self, interval: float = 60.0):
        self.interval, self.counts, self.last = interval, Counter(), None

    def note(self, what: str) -> None:
        self.counts[what] += 1
        now = time.monotonic()
        if self.last is not None and now - self.last < self.interval:
            return
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        log.error("out of open files (limit %d): %s failed since the last report (reported at most every "
                  "%.0f s)",
                  soft, ", ".join(f"{n} {w}" for w, n in sorted(self.counts.items())), self.interval)
        self.last = now
        self.counts.clear()

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        """Route the event loop's "accept() out of system resource" reports (one a second per
        listening socket, each with a traceback) through ``note``."""
        default = loop.get_exception_handler()

        def handler(loop, context):
            exc = context.get("exception")
            if isinstance(exc, OSError) and exc.errno in OUT_OF_FILES:
                self.note("accepts")
            elif default is not None:
                default(loop, context)
            else:
                loop.default_exception_handler(context)

        loop.set_exception_handler(handler)
