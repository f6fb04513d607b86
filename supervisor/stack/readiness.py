"""Readiness probes, and the ports they are about.

A probe answers one question -- "is the unit ready now?" -- within a bound
(every network call has a timeout, a command probe is stopped when it
overruns); the caller repeats it until the unit's deadline. Kinds:

* ``http``: ``GET http://127.0.0.1:PORT/PATH`` answers 2xx;
* ``tcp``: a connection to ``127.0.0.1:PORT`` is accepted;
* ``log``: a line of the unit's output matches a regex (fed by the reader);
* ``exec``: a command exits 0 (spawned with the unit's isolation: its
  environment and marker, CPU mask, cgroup leaf, a session of its own);
* ``file``: a path exists.

An HTTP or TCP answer is believed only if the listening socket belongs to a
process of the unit's own tree: anyone can answer on a port, and a 200 from a
stale server left by someone else must not make a unit "ready". A listener
owned by a process outside the tree is a *fatal* answer naming that process.

Ports: ``auto`` asks the kernel for a free one (bind to port 0, read it,
close). Between that close and the unit's own bind another process could take
the number; the window is the unit's start-up time, and if it happens the
probe finds the foreign listener and names it rather than trusting it.
"""

from __future__ import annotations

import errno
import os
import re
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from hold_supervisor.proc import scan
from hold_supervisor.proc.identity import AccessDenied, NoSuchProcess, read_cmdline
from hold_supervisor.proc.stop import stop_tree
from hold_supervisor.proc.tree import Tree
from hold_supervisor.spawn.child import Child, SpawnError

PROBE_CALL_TIMEOUT = 1.0  # one HTTP request or TCP connect
EXEC_ATTEMPT_TIMEOUT = 10.0  # one run of an exec probe, at most


class Answer(NamedTuple):
    """One probe's answer: ``ok``; ``detail`` says why (shown while waiting);
    ``fatal``: waiting longer cannot help (a foreign process owns the port)."""

    ok: bool
    detail: str
    fatal: bool = False


# ------------------------------------------------------------------ ports


def pick_free_port() -> int:
    """A TCP port that is free now (the kernel's choice); see the module docstring."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        port: int = s.getsockname()[1]
        return port


def describe_pid(pid: int) -> str:
    try:
        cmd = " ".join(read_cmdline(pid).split())
    except (NoSuchProcess, AccessDenied):
        return f"pid {pid}"
    return f"pid {pid} ({cmd if len(cmd) <= 160 else cmd[:157] + '...'})"


def port_holders(port: int, candidates: list[int] | None = None) -> list[int]:
    """Pids (among ``candidates``, default all) that hold a listening TCP socket on ``port``."""
    inodes = {
        i for i, ln in scan.listeners().items() if ln.port == port and ln.proto.startswith("tcp")
    }
    if not inodes:
        return []
    pids = scan.pids() if candidates is None else candidates
    owners: set[int] = set()
    # socket_owners keeps one pid per inode; a forked server shares its socket,
    # so ask per pid to name them all.
    for pid in pids:
        if scan.socket_owners(inodes, [pid]):
            owners.add(pid)
    return sorted(owners)


def port_taken(port: int) -> str | None:
    """Who holds ``port`` now (``pid N (command)``), or None if it is free."""
    holders = [p for p in port_holders(port) if p != os.getpid()]
    if holders:
        return ", ".join(describe_pid(p) for p in holders)
    # Not visible as a listener here (another user's process without root, or
    # another network namespace's): binding tells whether it is free.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return "a process this user cannot see"
            return f"not usable: {e.strerror}"
    return None


def owned_by_tree(port: int, tree: Tree) -> Answer:
    """Does the listener on ``port`` belong to ``tree``? (Fatal if it is someone else's.)"""
    members = list(tree.members())
    if port_holders(port, members):
        return Answer(True, f"port {port} is the unit's")
    others = [p for p in port_holders(port) if p not in members]
    if others:
        who = ", ".join(describe_pid(p) for p in others)
        return Answer(
            False, f"port {port} answers, but it is held by {who}, not by this unit", fatal=True
        )
    return Answer(False, f"port {port} answers, but no process of the unit listens on it")


# ------------------------------------------------------------------ probes


class Probe:
    """Base: :meth:`check` answers once, within ``limit`` seconds."""

    kind = "none"
    # Whether a line of output may change the answer (the log probe): only such
    # a probe is asked again as output comes; the others are asked on a schedule.
    on_output = False

    def check(self, tree: Tree, limit: float) -> Answer:
        raise NotImplementedError

    def abort(self) -> None:
        """Stop whatever :meth:`check` is waiting for (called from another thread)."""


class HttpProbe(Probe):
    kind = "http"

    def __init__(self, port: int, path: str) -> None:
        self.port = port
        self.path = path

    def check(self, tree: Tree, limit: float) -> Answer:
        import http.client  # here: ~20 ms of imports (email, ssl) a stack without http probes skips

        conn = http.client.HTTPConnection(
            "127.0.0.1", self.port, timeout=max(0.05, min(PROBE_CALL_TIMEOUT, limit))
        )
        try:
            conn.request("GET", self.path, headers={"User-Agent": "hold-readiness"})
            resp = conn.getresponse()
            status = resp.status
            resp.read(65536)
        except (OSError, http.client.HTTPException) as e:
            return Answer(False, f"GET {self.path}: {_why(e)}")
        finally:
            conn.close()
        if not 200 <= status < 300:
            return Answer(False, f"GET {self.path}: status {status}")
        owner = owned_by_tree(self.port, tree)
        if not owner.ok:
            return owner
        return Answer(True, f"GET {self.path}: {status}")


class TcpProbe(Probe):
    kind = "tcp"

    def __init__(self, port: int) -> None:
        self.port = port

    def check(self, tree: Tree, limit: float) -> Answer:
        try:
            with socket.create_connection(
                ("127.0.0.1", self.port), timeout=max(0.05, min(PROBE_CALL_TIMEOUT, limit))
            ):
                pass
        except OSError as e:
            return Answer(False, f"connect to port {self.port}: {_why(e)}")
        owner = owned_by_tree(self.port, tree)
        if not owner.ok:
            return owner
        return Answer(True, f"port {self.port} accepts connections")


class LogProbe(Probe):
    """Ready once a line of the unit's output matches; :meth:`feed` is called by the reader."""

    kind = "log"
    on_output = True

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self.pattern = pattern
        self._matched: str | None = None
        self._lock = threading.Lock()

    def feed(self, line: str) -> None:
        if self._matched is None and self.pattern.search(line):
            with self._lock:
                self._matched = line

    def reset(self) -> None:
        """Forget a match (before a restart: the new process must say it again)."""
        with self._lock:
            self._matched = None

    def check(self, tree: Tree, limit: float) -> Answer:
        if self._matched is not None:
            return Answer(True, f"output matched {self.pattern.pattern!r}: {self._matched[:80]}")
        return Answer(False, f"no output line matches {self.pattern.pattern!r} yet")


class FileProbe(Probe):
    kind = "file"

    def __init__(self, path: str) -> None:
        self.path = path

    def check(self, tree: Tree, limit: float) -> Answer:
        if os.path.lexists(self.path):
            return Answer(True, f"{self.path} exists")
        return Answer(False, f"{self.path} does not exist yet")


class ExecProbe(Probe):
    """Ready when ``argv`` exits 0. ``start`` spawns it with the unit's isolation;
    an attempt that overruns (or is aborted) is stopped with its whole tree."""

    kind = "exec"

    def __init__(self, argv: tuple[str, ...], start: Callable[[tuple[str, ...]], Child]) -> None:
        self.argv = argv
        self.start = start
        self._abort_r, self._abort_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def abort(self) -> None:
        try:
            os.write(self._abort_w, b"x")
        except OSError:
            pass

    def close(self) -> None:
        os.close(self._abort_r)
        os.close(self._abort_w)

    def check(self, tree: Tree, limit: float) -> Answer:
        try:
            child = self.start(self.argv)
        except SpawnError as e:
            return Answer(False, f"probe command: {e}", fatal=e.exit_code in (126, 127))
        probe_tree = Tree(f"{tree.tree_id}probe", child.ident, child.pid, child.pid)
        poller = select.poll()
        poller.register(child.pidfd, select.POLLIN)
        poller.register(self._abort_r, select.POLLIN)
        deadline = time.monotonic() + min(EXEC_ATTEMPT_TIMEOUT, max(0.05, limit))
        while child.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0 or any(fd == self._abort_r for fd, _ in poller.poll(left * 1000)):
                break
        if child.returncode is None:
            stop_tree(probe_tree, sig=signal.SIGTERM, grace=0.5)
            _reap_soon(child)
            return Answer(
                False,
                f"probe command still running after {min(EXEC_ATTEMPT_TIMEOUT, limit):.1f}s, "
                "stopped",
            )
        # What it started and left behind goes too.
        if probe_tree.members():
            stop_tree(probe_tree, sig=signal.SIGTERM, grace=0.5)
        code = child.returncode
        if code == 0:
            return Answer(True, "probe command exited 0")
        what = f"status {code}" if code > 0 else f"signal {-code}"
        return Answer(False, f"probe command exited with {what}")


def _reap_soon(child: Child, timeout: float = 2.0) -> None:
    if child.poll() is None:
        p = select.poll()
        p.register(child.pidfd, select.POLLIN)
        p.poll(timeout * 1000)
        child.poll()


def _why(e: BaseException) -> str:
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, TimeoutError | socket.timeout):
        return "no answer in time"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror.lower()
    return str(e) or type(e).__name__
