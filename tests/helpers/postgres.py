"""A PostgreSQL server of the tests' own on loopback: Debian's ``postgresql`` (scripts/test.sh
installs it), ``initdb`` into a new temporary directory, ``pg_ctl start`` on a free port of
127.0.0.1 (its socket in that directory too), one database per test, and ``stop`` on every path.

PostgreSQL refuses to run as root: as root the server runs as the ``postgres`` user the package
creates (``runuser``), in a directory given to it; as another user, as that user.
"""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import uuid


def bindir() -> str:
    """The newest installed server's programs (``/usr/lib/postgresql/N/bin``)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if not found:
        raise RuntimeError("no PostgreSQL server installed: scripts/test.sh installs Debian's postgresql")
    return os.path.dirname(found[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """One server; ``url(db)`` names a database of it; ``database()`` makes a new, empty one."""

    def __init__(self):
        self.bin, self.port = bindir(), _free_port()
        # not under pytest's 0700 tree: the server's user must reach it
        self.root = tempfile.mkdtemp(prefix="kf-postgres-")
        self.data, self.log = os.path.join(self.root, "data"), os.path.join(self.root, "server.log")
        self.user = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            os.chown(self.root, entry.pw_uid, entry.pw_gid)

    def _run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        return subprocess.run([*prefix, *cmd], capture_output=True, text=True, timeout=300, check=check,
                              cwd=self.root)

    def start(self) -> PostgresServer:
        if not os.path.exists(self.data):
            self._run(os.path.join(self.bin, "initdb"), "-D", self.data, "-A", "trust", "-U", self.user,
                      "-E", "UTF8", "--locale=C.UTF-8", "--no-sync")
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        done = self._run(os.path.join(self.bin, "pg_ctl"), "-D", self.data, "-l", self.log, "-o", options,
                         "-w", "-t", "120", "start", check=False)
        if done.returncode != 0:
            raise RuntimeError(f"PostgreSQL did not start: {done.stderr.strip()}\n{self.tail()}")
        return self

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``fast``: sessions ended, a clean shutdown; ``immediate``: as a crash)."""
        done = self._run(os.path.join(self.bin, "pg_ctl"), "-D", self.data, "-m", mode, "-w", "-t", "60",
                         "stop", check=False)
        if done.returncode != 0 and (pid := self.pid()) is not None:
            try:
                os.killpg(pid, signal.SIGKILL)  # the postmaster leads its group of backends
            except ProcessLookupError:
                pass

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop the server whatever state it is in, and remove its directory."""
        try:
            self.stop()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def pid(self) -> int | None:
        try:
            with open(os.path.join(self.data, "postmaster.pid")) as f:
                return int(f.readline())
        except (OSError, ValueError):
            return None

    def tail(self) -> str:
        try:
            with open(self.log) as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def database(self) -> str:
        """The URL of a new, empty database."""
        import psycopg

        name = f"t{uuid.uuid4().hex[:16]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)
