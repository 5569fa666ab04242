"""Filesystem metadata operations counted for real: a program run under ``strace -f`` (every
process it forks traced too), its calls attributed to processes and cut into phases at marker
calls (``mark``: a stat of a path that does not exist, made by the traced program).

Kinds of call on a path (``kind``): ``open`` of a file, ``listing`` (an open of a directory:
every listing starts with one), ``stat`` (by path: stat, lstat, statx, access, readlink),
``fstat`` (of an open descriptor), ``read`` (pread on a descriptor), ``connect``; anything
else that names a path (mkdir, rename, unlink, utimensat...) is its syscall's name.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections import Counter
from dataclasses import dataclass

MARK = "/.kf-syscall-mark"
TRACED = "%file,fstat,getdents64,pread64,preadv,preadv2,connect,clone,clone3,fork,vfork"

_LINE = re.compile(r"^(\d+)\s+(.*)$")
_CALL = re.compile(r"^(\w+)\((.*)\)\s+=\s+(.*)$")
_FD_PATH = re.compile(r"^-?\d+<(.*?)>")  # a descriptor decoded by strace -y: 3</path/of/it>
_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')
OPENS = {"open", "openat", "openat2", "creat"}
STATS = {"stat", "lstat", "newfstatat", "statx", "access", "faccessat", "faccessat2", "readlink",
         "readlinkat"}
FD_CALLS = {"fstat", "getdents64", "pread64", "preadv", "preadv2", "connect"}
FD_KINDS = {"getdents64": "listing", "pread64": "read", "preadv": "read", "preadv2": "read"}


def mark(phase: str) -> None:
    """In the traced program: start ``phase`` (all calls after this one, until the next mark)."""
    try:
        os.stat(f"{MARK}/{phase}")
    except FileNotFoundError:
        pass


@dataclass(frozen=True)
class Call:
    process: int  # the traced process's pid (its threads' calls count as its own)
    name: str
    path: str  # the path named, or the one of the descriptor (strace -y); "" if none
    args: str
    on_fd: bool  # the call names a descriptor, not a path

    @property
    def kind(self) -> str:
        if self.name in OPENS:
            return "listing" if "O_DIRECTORY" in self.args else "open"
        if self.name == "fstat" or (self.name in STATS and self.on_fd):
            return "fstat"
        if self.name in STATS:
            return "stat"
        return FD_KINDS.get(self.name, self.name)


@dataclass
class Trace:
    root: int  # the traced program's pid
    phases: dict[str, list[Call]]

    def count(self, phase: str, under: str, processes: str = "all") -> Counter:
        """(kind, path relative to ``under``) -> calls, in ``phase`` (a phase name, or a prefix
        ending in "/"), by the root process (``"root"``), the others (``"children"``) or all."""
        bases = {os.path.abspath(under), os.path.realpath(under)}
        out = Counter()
        for name, calls in self.phases.items():
            if name != phase and not (phase.endswith("/") and name.startswith(phase)):
                continue
            for c in calls:
                if processes != "all" and (c.process == self.root) != (processes == "root"):
                    continue
                for base in bases:
                    if c.path == base or c.path.startswith(base + "/"):
                        out[c.kind, os.path.relpath(c.path, base)] += 1
        return out

    def processes(self, phase: str, kind: str, where: str) -> set[int]:
        """The processes other than the root that made a ``kind`` call on ``where`` (a path
        prefix, or for ``connect`` a text in its address) in ``phase``."""
        return {c.process for c in self.phases[phase]
                if c.process != self.root and c.kind == kind
                and where in (c.args if kind == "connect" else c.path)}


def _merged(lines):
    """(pid, text) of each call, joining strace's ``<unfinished ...>`` / ``<... resumed>`` halves."""
    pending = {}
    for line in lines:
        m = _LINE.match(line)
        if not m:
            continue
        pid, text = int(m[1]), m[2]
        if text.startswith(("---", "+++")):
            continue
        if text.endswith("<unfinished ...>"):
            pending[pid] = text[: -len("<unfinished ...>")].rstrip()
            continue
        resumed = re.match(r"<\.\.\. \w+ resumed>\s?(.*)$", text)
        if resumed:
            text = pending.pop(pid, "") + resumed[1]
        yield pid, text


def parse(lines) -> Trace:
    calls, thread_of, root = [], {}, None
    for pid, text in _merged(lines):
        root = pid if root is None else root
        m = _CALL.match(text)
        if not m:
            continue
        name, args, result = m.groups()
        if name in ("clone", "clone3", "fork", "vfork"):
            child = re.match(r"(\d+)", result)
            if child and "CLONE_THREAD" in args:
                thread_of[int(child[1])] = pid
            continue
        fd, string = _FD_PATH.match(args), _STRING.search(args)
        on_fd = name in FD_CALLS or bool(fd and string and string[1] == "")
        if on_fd:
            path = fd[1] if fd else ""
        elif string:  # a relative path is relative to the directory descriptor before it
            path = os.path.join(fd[1], string[1]) if fd and not string[1].startswith("/") else string[1]
        else:
            path = ""
        calls.append((pid, name, os.path.normpath(path) if path else "", args, on_fd))

    def process(tid: int) -> int:
        while tid in thread_of:
            tid = thread_of[tid]
        return tid

    phases, phase = {"": []}, ""
    for pid, name, path, args, on_fd in calls:
        if path.startswith(MARK + "/") and process(pid) == root:
            phase = path[len(MARK) + 1:]
            phases[phase] = []
            continue
        phases[phase].append(Call(process(pid), name, path, args, on_fd))
    return Trace(root, phases)


def trace(argv: list[str], log: str, timeout: float) -> tuple[subprocess.CompletedProcess, Trace]:
    """Run ``argv`` under ``strace -f`` (its output to the file ``log``); the completed process
    (stdout and stderr as text) and its parsed trace. Past ``timeout`` seconds the program and
    everything it started are killed, and the error shows the end of what it printed."""
    assert shutil.which("strace"), "strace is not installed (scripts/setup.sh installs it)"
    cmd = ["strace", "-f", "-qq", "-y", "--seccomp-bpf", "-e", f"trace={TRACED}", "-e", "signal=none", "-o",
           log, *argv]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # a killed strace would leave its tracees running
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(argv)}: still running after {timeout:.0f} s; its output ended "
                             f"with:\n{out[-2000:]}{err[-2000:]}") from None
    with open(log) as f:
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err), parse(f)
