"""nginx in front of ``shard-service serve`` replicas with the shipped configuration,
docker/nginx-replicas.conf (docs/runbooks/service.md deploys it): an upstream of the replicas with
passive health checks (``max_fails``/``fail_timeout``), requests retried on the next replica when
one refuses, fails or answers 502/503/504 (idempotent requests only: nginx never retries a POST),
and the internal location from which nginx sends the files the replicas hand it
(``service.accel``). Only the replicas' addresses, the port and the temporary paths are the
test's. Debian's nginx, a master of the test's own on a free loopback port
(``../shared/notes/nginx.md``), stopped on every path.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

NGINX = "/usr/sbin/nginx"
SHIPPED = Path(__file__).resolve().parents[2] / "docker" / "nginx-replicas.conf"
ACCEL_PREFIX = "/_accel"
ACCEL_SECRET = "front-secret-for-the-tests-0123456789"


def accel_flags(directory: str) -> list[str]:
    """A replica's flags behind a ``Front``: the internal location, and the secret the front sends
    (its file written in ``directory``)."""
    path = os.path.join(directory, "accel-secret")
    with open(path, "w") as f:
        f.write(ACCEL_SECRET + "\n")
    return ["--x-accel-redirect", ACCEL_PREFIX, "--x-accel-secret-file", path]


def grant_flags(links: str, seconds: int) -> list[str]:
    """A replica's flags granting files for ``seconds`` through the links in ``links`` (made here),
    which the front must be given too (``front_config``)."""
    os.makedirs(links, exist_ok=True)
    return ["--grant-links", links, "--grant-seconds", str(seconds)]


def write_secret(prefix: str) -> None:
    """The front's half of the secret: accel-secret.conf and grant-secret.conf beside its
    nginx.conf, which the shipped configuration includes."""
    with open(os.path.join(prefix, "accel-secret.conf"), "w") as f:
        f.write(f'proxy_set_header X-Accel-Secret "{ACCEL_SECRET}";\n')
    with open(os.path.join(prefix, "grant-secret.conf"), "w") as f:
        f.write(f'set $grant_secret "{ACCEL_SECRET}";\n')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def front_config(prefix: str, port: int, replicas: list[str], grant_links: str | None = None) -> str:
    """The shipped docker/nginx-replicas.conf, for a front on 127.0.0.1:``port`` balancing
    ``replicas`` (host:port each), with its temporary files under ``prefix`` and the replicas'
    grant links in ``grant_links`` (default: ``prefix``/grants)."""
    conf = SHIPPED.read_text().replace("/data/grants/", f"{grant_links or os.path.join(prefix, 'grants')}/")
    servers = re.findall(r"^ *server replica\d:8765 (.*);$", conf, re.M)
    assert servers, f"{SHIPPED}: no replica lines"
    conf = re.sub(r"^( *)server replica1:8765 .*;$",
                  lambda m: "".join(f"{m[1]}server {r} {servers[0]};\n" for r in replicas).rstrip("\n"), conf,
                  flags=re.M)
    conf = re.sub(r"^ *server replica[2-9]:8765 .*;\n", "", conf, flags=re.M)
    temps = " ".join(f"{k}_temp_path {prefix}/t{i};" for i, k in
                     enumerate(("client_body", "proxy", "fastcgi", "uwsgi", "scgi")))
    conf = conf.replace("http {\n", f"http {{\n    {temps}\n",
                        1).replace("listen 8080;", f"listen 127.0.0.1:{port};")
    assert f"listen 127.0.0.1:{port};" in conf and all(f"server {r} " in conf for r in replicas)
    return f"user root; daemon off; pid {prefix}/nginx.pid; error_log {prefix}/error.log;\n" + conf


class Front:
    """One nginx master with ``front_config``; ``url`` once started."""

    def __init__(self, prefix: str, replicas: list[str], grant_links: str | None = None):
        self.prefix, self.port = str(prefix), free_port()
        os.makedirs(self.prefix, exist_ok=True)
        self.conf = os.path.join(self.prefix, "nginx.conf")
        with open(self.conf, "w") as f:
            f.write(front_config(self.prefix, self.port, replicas, grant_links))
        write_secret(self.prefix)
        self.proc, self.url = None, f"http://127.0.0.1:{self.port}"

    def start(self) -> Front:
        if not os.path.exists(NGINX):
            raise RuntimeError(f"{NGINX} missing: scripts/test.sh installs Debian's nginx-light")
        self.proc = subprocess.Popen([NGINX, "-c", self.conf, "-p", self.prefix], start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited: {self.errors()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"nginx never listened: {self.errors()}") from None
                time.sleep(0.05)

    def errors(self) -> str:
        try:
            with open(os.path.join(self.prefix, "error.log")) as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGQUIT)  # graceful: its workers finish and exit with it
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the master leads its workers' group
            self.proc.wait()
