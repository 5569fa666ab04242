"""nginx in front of ``shard-service serve`` replicas, as docs/runbooks/service.md deploys it: an
upstream of the replicas with passive health checks (``max_fails``/``fail_timeout``), requests
retried on the next replica when one refuses, fails or answers 502/503/504 (idempotent requests
only: nginx never retries a POST), and the internal location from which nginx sends the files the
replicas hand it (``service.accel``). Debian's nginx, a master of the test's own on a free
loopback port (``../shared/notes/nginx.md``), stopped on every path.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

from service.accel import nginx_location

NGINX = "/usr/sbin/nginx"
ACCEL_PREFIX = "/_accel"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def front_config(prefix: str, port: int, replicas: list[str], accel: bool = True) -> str:
    """nginx.conf for a front on 127.0.0.1:``port`` balancing ``replicas`` (host:port each)."""
    servers = "".join(f"    server {r} max_fails=1 fail_timeout=2s;\n" for r in replicas)
    temps = " ".join(f"{k}_temp_path {prefix}/t{i};" for i, k in
                     enumerate(("client_body", "proxy", "fastcgi", "uwsgi", "scgi")))
    return f"""user root; worker_processes 1; daemon off; pid {prefix}/nginx.pid; error_log {prefix}/error.log;
events {{ worker_connections 1024; }}
http {{
  access_log off; sendfile on; tcp_nopush on; {temps}
  upstream replicas {{
{servers}    keepalive 32;
  }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://replicas;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header Host $http_host;
      {"proxy_set_header X-Sendfile-Type X-Accel-Redirect;" if accel else ""}
      proxy_next_upstream error timeout http_502 http_503 http_504;
      proxy_next_upstream_tries 4;
      proxy_connect_timeout 2s;
      proxy_read_timeout 120s;
    }}
{nginx_location(ACCEL_PREFIX)}
  }}
}}
"""


class Front:
    """One nginx master with ``front_config``; ``url`` once started."""

    def __init__(self, prefix: str, replicas: list[str], accel: bool = True):
        self.prefix, self.port = str(prefix), free_port()
        os.makedirs(self.prefix, exist_ok=True)
        self.conf = os.path.join(self.prefix, "nginx.conf")
        with open(self.conf, "w") as f:
            f.write(front_config(self.prefix, self.port, replicas, accel))
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
