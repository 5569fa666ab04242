"""The shard service against slow and hostile clients, with real sockets on loopback (client
addresses 127.0.0.x tell the clients apart): connections that send their headers a byte at a
time, or nothing, are closed at the header deadline while a normal client is served; a body that
does not arrive gets 408; connections over the per-client and the total cap get 503 at once;
and a server started with few open files, flooded with connections, says so in one log line,
not one traceback per failed accept, and serves again once they close."""
from __future__ import annotations

import select
import signal
import socket
import sys
import threading
import time

import pytest
from helpers.shardsets import ServiceProcess, http, served_tiny

from shards.format.manifest import Manifest

TOKEN = "token-for-client-tests"


@pytest.fixture(scope="module")
def shardset(tmp_path_factory):
    return served_tiny(tmp_path_factory.mktemp("clients"), TOKEN)


def serve(root, *args: str, command: tuple[str, ...] | None = None) -> ServiceProcess:
    server = ServiceProcess("--catalog", str(root / "catalog.sqlite"), "--token-file", str(root / "tokens"),
                            *args, command=command)
    server.start()
    return server


def connect(url: str, source: str) -> socket.socket:
    host, port = url.split("//")[1].split(":")
    return socket.create_connection((host, int(port)), timeout=30, source_address=(source, 0))


def keep_alive_request(sock: socket.socket, path: str = "/v1/health") -> bytes:
    """One request on a kept-alive connection; the answer's head (the server has admitted it)."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    return data


def hold_until_closed(sock: socket.socket, head: bytes, drip: bytes | None) -> tuple[float | None, int]:
    """Send ``head``, then ``drip`` a byte every 0.1 s (or nothing), until the server closes the
    connection; (when it did, by ``time.monotonic()``, or None: not within 600 drips; bytes dripped)."""
    sock.sendall(head)
    dripped = 0
    while dripped < 600:
        try:
            if select.select([sock], [], [], 0.1)[0] and sock.recv(4096) == b"":
                return time.monotonic(), dripped
            if drip:
                sock.sendall(drip)
            dripped += 1
        except OSError:  # reset by the server
            return time.monotonic(), dripped
    return None, dripped


DEADLINE = 2.0


def test_slow_and_silent_connections_are_closed_at_the_header_deadline_while_others_are_served(shardset):
    """Six connections from one client send nothing, or a header a byte every 0.1 s; with
    ``--header-timeout 2`` each is closed no sooner than 2 s after it was opened and, late by no
    more than the server was slow to answer the normal client meanwhile (its longest wait between
    two answers, plus 0.5 s for the test's own threads), no later: a bound that follows the
    machine's load instead of guessing it. The normal client is answered over and over while all
    six are held open, every answer the shard's bytes."""
    server = serve(shardset, "--header-timeout", str(DEADLINE), "--body-timeout", "2")
    try:
        shard = Manifest.load(str(shardset / "tiny")).splits["train"].shards[0]
        data = (shardset / "tiny" / shard.name).read_bytes()
        opened, attackers = [], []
        for _ in range(6):
            before = time.monotonic()
            attackers.append(connect(server.url, "127.0.0.2"))
            opened.append((before, time.monotonic()))
        outcomes = [None] * len(attackers)

        def attack(k):
            head, drip = ((b"", None) if k == 0 else  # says nothing at all
                          # a header, a byte at a time
                          (b"GET /v1/health HTTP/1.1\r\nHost: x\r\nX-Slow: ", b"a"))
            outcomes[k] = hold_until_closed(attackers[k], head, drip)

        threads = [threading.Thread(target=attack, args=(k,)) for k in range(len(attackers))]
        for t in threads:
            t.start()
        answered = []  # when each answer to the normal client was complete
        while any(t.is_alive() for t in threads):  # a normal client, served all along
            status, _, body = http(server.url, path=f"/v1/datasets/tiny/{shard.name}")
            assert status == 200 and body == data
            answered.append(time.monotonic())
        closed = [when for when, _ in outcomes]
        assert None not in closed, outcomes  # the dripping heads never completed, yet they ended
        while_held = sum(t < min(closed) for t in answered)
        assert while_held >= 10, (while_held, len(answered))
        for (before, after), when in zip(opened, closed):
            assert when - before >= DEADLINE, (when - before, outcomes)
            due = after + DEADLINE
            # then late by no more than the server's longest silence to the normal client
            if when - due > 0.5:
                marks = [due, *(t for t in answered if due < t < when), when]
                slowest = max(b - a for a, b in zip(marks, marks[1:]))
                assert when - due <= slowest + 0.5, (when - due, slowest)
        for sock in attackers:
            sock.close()
        # a body that does not arrive: 408 (the token is right, the body stops short)
        sock = connect(server.url, "127.0.0.3")
        sock.sendall(f"POST /v1/builds HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"src\": ".encode())
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
        sock.close()
        assert answer.startswith(b"HTTP/1.1 408 ") and b"--body-timeout" in answer, answer
    finally:
        server.kill(signal.SIGTERM)


def test_connections_over_the_caps_get_503_at_once(shardset):
    server = serve(shardset, "--header-timeout", "600", "--max-connections", "8",
                   "--max-connections-per-client", "3")
    held = []
    try:
        for _ in range(3):
            held.append(connect(server.url, "127.0.0.2"))
            assert keep_alive_request(held[-1]).startswith(b"HTTP/1.1 200 ")
        assert http(server.url, path="/v1/health")[0] == 200  # another client is served
        over = connect(server.url, "127.0.0.2")
        answer = over.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in answer
        assert b"127.0.0.2 holds its limit of 3 connections (--max-connections-per-client)" in answer
        assert over.recv(4096) == b""  # and closed
        for client in ("127.0.0.3", "127.0.0.3", "127.0.0.3", "127.0.0.4", "127.0.0.4"):
            held.append(connect(server.url, client))
            assert keep_alive_request(held[-1]).startswith(b"HTTP/1.1 200 ")
        over = connect(server.url, "127.0.0.5")  # the ninth connection
        answer = over.recv(4096)
        assert b"the server holds its limit of 8 connections (--max-connections)" in answer
        held.pop().close()
        status, _, _ = http(server.url, path="/v1/health")
        assert status == 200  # a slot freed is a slot used
    finally:
        for sock in held:
            sock.close()
        server.kill(signal.SIGTERM)


def test_running_out_of_open_files_is_logged_once_and_the_server_recovers(shardset):
    server = serve(shardset, "--max-connections", "1000", "--max-connections-per-client", "0",
                   command=("prlimit", "--nofile=150:150", sys.executable, "-m", "service", "serve", "--port",
                            "0"))
    flood = []
    try:
        assert any("more than 150 open files allow" in line for line in server.log)
        for _ in range(300):  # more than 150 descriptors: the kernel queues them, accept() fails
            flood.append(connect(server.url, "127.0.0.2"))
        deadline = time.time() + 60
        while not any("out of open files" in line for line in server.log):
            assert time.time() < deadline and server.proc.poll() is None, "".join(server.log)
            time.sleep(0.1)
        time.sleep(3)  # the loop retries accept() every second: several more failures
        for sock in flood:
            sock.close()
        flood.clear()
        status, _, _ = http(server.url, path="/v1/health")
        assert status == 200
        reports = [line for line in server.log if "out of open files" in line]
        assert len(reports) == 1 and "(limit 150)" in reports[0], reports
        assert not any("Traceback" in line for line in server.log), "".join(server.log)[-3000:]
    finally:
        for sock in flood:
            sock.close()
        server.kill(signal.SIGTERM)
