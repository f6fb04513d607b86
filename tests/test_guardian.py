"""The daemon as guardian of registered trees, through its socket as a client
speaks it: each tree stopped with its own grace; a root claim that is not the
client's descendant is refused and logged with who made it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import HOLD, alive, wait_for

IGNORE_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"


def ignores_term(pid: int) -> bool:
    """Has the process set SIGTERM to ignored (its ``SigIgn`` mask in /proc)?"""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(line.split()[1] for line in f if line.startswith("SigIgn:"))
    except (OSError, StopIteration):
        return False
    return bool(int(mask, 16) >> (signal.SIGTERM - 1) & 1)


def start_daemon() -> Path:
    """A daemon for this test's state directory (started the way clients do)."""
    res = subprocess.run([*HOLD, "status"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    return Path(os.environ["HOLD_STATE_DIR"])


def talk(sock: socket.socket, f: Any, msg: dict[str, Any]) -> dict[str, Any]:
    sock.sendall(json.dumps(msg).encode() + b"\n")
    line = f.readline()
    assert line, "the daemon closed the connection"
    out: dict[str, Any] = json.loads(line)
    return out


def test_each_tree_is_stopped_with_its_own_grace() -> None:
    state = start_daemon()
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(str(state / "daemon.sock"))
    f = sock.makefile("rb")
    assert talk(sock, f, {"op": "open"})["ev"] == "session"
    # Trees of their own: a fixed id is every copy's marker, and another run of
    # this test on the machine would stop ours with its own.
    quick, slow = os.urandom(8).hex(), os.urandom(8).hex()
    assert talk(sock, f, {"op": "tree", "tree_id": quick, "grace": 0.2})["ev"] == "ok"
    assert talk(sock, f, {"op": "tree", "tree_id": slow, "grace": 4})["ev"] == "ok"
    procs = {
        tid: subprocess.Popen(
            [sys.executable, "-c", IGNORE_TERM], env={**os.environ, "HOLD_TREE": tid}
        )
        for tid in (quick, slow)
    }
    try:
        # Both have set their handlers (a TERM before would end them).
        for p in procs.values():
            wait_for(lambda p=p: ignores_term(p.pid), 10, what=f"{p.pid} to ignore SIGTERM")
        t0 = time.monotonic()
        f.close()  # (the file object keeps the descriptor open, too)
        sock.close()  # the lifeline: the daemon stops both trees
        wait_for(lambda: procs[quick].poll() is not None, 10, what="the quick tree")
        quick_s = time.monotonic() - t0
        wait_for(lambda: procs[slow].poll() is not None, 15, what="the slow tree")
        slow_s = time.monotonic() - t0
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
    # Its own 0.2 s, not the other's 4 s (trees are stopped one after the other,
    # in registration order).
    assert quick_s < 2.5, quick_s
    assert slow_s >= 4.0, slow_s


def test_a_root_claim_that_is_not_the_clients_descendant_is_refused_and_logged() -> None:
    state = start_daemon()
    # Not a descendant of this client: our parent (pytest's), alive throughout.
    victim = os.getppid()
    try:
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(str(state / "daemon.sock"))
        f = sock.makefile("rb")
        assert talk(sock, f, {"op": "open"})["ev"] == "session"
        tid = os.urandom(8).hex()
        assert talk(sock, f, {"op": "tree", "tree_id": tid, "grace": 1})["ev"] == "ok"
        # Not answered (a root report is fire-and-forget); then a status proves it was read.
        sock.sendall(json.dumps({"op": "root", "tree_id": tid, "pid": victim}).encode() + b"\n")
        assert talk(sock, f, {"op": "status"})["ev"] == "status"
        log = (state / "daemon.log").read_text()
        refused = [json.loads(ln) for ln in log.splitlines() if "tree_root_refused" in ln]
        assert refused and refused[0]["claimed_pid"] == victim
        assert refused[0]["peer_pid"] == os.getpid() and refused[0]["peer_uid"] == os.getuid()
        f.close()
        sock.close()  # the session ends: its tree is stopped, the victim is not in it
        wait_for(
            lambda: "session_ended" in (state / "daemon.log").read_text(),
            10,
            what="the session to end",
        )
        assert alive(victim)
    finally:
        sock.close()


def test_an_end_stops_a_tree_still_in_its_leaf_and_does_not_walk_one_whose_leaf_is_gone() -> None:
    """``end`` from the holder: a tree whose leaf still has a process is stopped
    by the daemon (the holder may not have); one whose leaf is empty and gone
    was stopped by the holder and is not walked again (issue 13's handoff)."""
    from hold_supervisor.environ import minimal_env
    from hold_supervisor.proc.cgroup import CgroupUnavailable, Hierarchy
    from hold_supervisor.spawn.child import spawn

    try:
        hier = Hierarchy.find()
    except CgroupUnavailable as e:
        pytest.skip(f"no writable cgroup v2 here: {e}")
    state = start_daemon()
    live_id, done_id = os.urandom(6).hex(), os.urandom(6).hex()
    live, done = hier.create(f"hold-{live_id}"), hier.create(f"hold-{done_id}")
    env = minimal_env(os.environ, tree_id=live_id)
    sock = socket.socket(socket.AF_UNIX)
    child = None
    try:
        sock.connect(str(state / "daemon.sock"))
        f = sock.makefile("rb")
        assert talk(sock, f, {"op": "open"})["ev"] == "session"
        for tid, leaf in ((live_id, live), (done_id, done)):
            ans = talk(sock, f, {"op": "tree", "tree_id": tid, "leaf": leaf.path, "grace": 1})
            assert ans["ev"] == "ok", ans
        # Spawned once its tree is registered, as a holder does: from a
        # threaded process (xdist's) it reaches its leaf through a stub a
        # moment after spawn returns, and until then only its marker says it
        # is a member -- the marker of a process born after the registration.
        child = spawn([sys.executable, "-c", "import time; time.sleep(60)"], env=env, cgroup=live)
        done.remove(hier.base)  # what a holder does once its tree is stopped
        assert talk(sock, f, {"op": "end"})["ev"] == "ended"
        assert child.collect(10) is not None, "the tree still in its leaf was not stopped"
    finally:
        sock.close()
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGKILL)
            child.wait()
        live.kill()
        live.wait_empty(5)
        if os.path.isdir(live.path):
            live.remove(hier.base)
    log = [json.loads(line) for line in (state / "daemon.log").read_text().splitlines()]
    stopped = {e.get("tree") for e in log if e.get("event") == "tree_stopped"}
    assert live_id in stopped
    assert done_id not in stopped
