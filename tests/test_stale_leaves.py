"""A cgroup leaf whose maker was killed before it gave the leaf to anyone (issue 24:
a client SIGKILLed between its ``mkdir`` and the tree's registration left an empty
``hold-<id>`` cgroup behind for ever).

A leaf's name carries its maker (``hold-<id>.<pid>.<start time>``), so whoever can
tell the maker is gone removes it: the maker's ticket daemon when its connection
ends, and the next leaf made beside it. Never a leaf of a live maker, one with a
process in it, one of another name, or another user's.

The maker here is a real client: a process that opens a session with the real
daemon, takes a lease, makes its leaf through the same call as ``hold run``
(:meth:`Hierarchy.create`), says so and waits -- the window -- and is SIGKILLed there.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import HOLD, alive, update_config, wait_for

MAKER = textwrap.dedent(
    """
    import json, os, socket, sys
    from hold_supervisor.proc.cgroup import Hierarchy
    lease = sys.argv[1] == "lease"
    if lease:
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(os.path.join(os.environ["HOLD_STATE_DIR"], "daemon.sock"))
        f = sock.makefile("rb")
        def talk(msg, want):
            sock.sendall(json.dumps(msg).encode() + b"\\n")
            while True:
                ans = json.loads(f.readline())
                if ans["ev"] == want:
                    return ans
                assert ans["ev"] in ("queued", "warning"), ans
        talk({"op": "open"}, "session")
        talk({"op": "acquire", "cls": "npu", "count": 1, "label": "maker", "ttl": 60,
              "grace": 1, "wait": True}, "granted")
    leaf = Hierarchy.find().create("hold-" + os.urandom(6).hex())
    print(leaf.path, flush=True)
    sys.stdin.read()  # the window: made, not yet registered
    """
)


def _need_cgroup() -> str:
    from hold_supervisor.proc.cgroup import CgroupUnavailable, Hierarchy

    try:
        return Hierarchy.find().base
    except CgroupUnavailable as e:
        pytest.skip(f"no writable cgroup v2 here: {e}")


def _maker(mode: str) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen(
        [sys.executable, "-c", MAKER, mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    line = p.stdout.readline().strip()
    assert line and os.path.isdir(line), (line, p.poll())
    return p, line


def _kill(p: subprocess.Popen[str]) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=10)
    assert p.stdin is not None
    p.stdin.close()
    assert p.stdout is not None
    p.stdout.close()


def _status() -> dict[str, Any]:
    res = subprocess.run([*HOLD, "status", "--json"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    out: dict[str, Any] = json.loads(res.stdout)
    return out


def test_the_daemon_removes_the_leaf_of_a_client_killed_before_registering_it(
    isolated_hold: Path,
) -> None:
    _need_cgroup()
    _status()  # a daemon, started the way clients do
    maker, leaf = _maker("lease")
    _kill(maker)
    # The lease's end (its lifeline) is the daemon's cue: nobody else knows the leaf.
    wait_for(lambda: not os.path.exists(leaf), 10, what="the daemon to remove the leaf")
    log = (isolated_hold / "state" / "daemon.log").read_text()
    # Any client of this user that makes a leaf beside it may sweep it first
    # (another test's `hold run`, under -n 2): then the daemon found nothing
    # left to remove. Alone, only the daemon can have removed it.
    if not _others_make_leaves():
        assert "stale_leaves_removed" in log and leaf in log, log[-2000:]


def _others_make_leaves() -> bool:
    """Does another process of this suite run beside this one (pytest-xdist)?"""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1


def test_the_next_leaf_made_beside_it_removes_it_and_nothing_else(
    isolated_hold: Path,
) -> None:
    base = _need_cgroup()
    update_config(isolated_hold, cgroups="required")
    stale_maker, stale = _maker("none")  # no daemon knows it: no guardian at all
    live_maker, live = _maker("none")
    busy_maker, busy = _maker("none")
    other = os.path.join(base, "hold-notmine")  # not of the pattern: not ours
    os.mkdir(other)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        with open(os.path.join(busy, "cgroup.procs"), "w") as f:
            f.write(str(sleeper.pid))
        _kill(stale_maker)
        _kill(busy_maker)  # dead too, but its leaf holds a process
        assert os.path.isdir(stale)
        res = subprocess.run(
            [*HOLD, "run", "--", "true"], capture_output=True, text=True, timeout=60
        )
        assert res.returncode == 0, res.stderr
        assert not os.path.exists(stale)
        assert os.path.isdir(live) and os.path.isdir(busy) and os.path.isdir(other)
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)
        _kill(live_maker)
        for path in (busy, live, other):
            wait_for(lambda p=path: _rmdir(p), 10, what=f"{path} to empty")
    assert not alive(sleeper.pid)


def _rmdir(path: str) -> bool:
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def test_a_leaf_made_by_a_live_client_stays_when_its_connection_ends(
    isolated_hold: Path,
) -> None:
    """The lifeline ends while the maker still runs (it closed its socket): its leaf
    is its own to remove."""
    _need_cgroup()
    _status()
    state = isolated_hold / "state"
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(str(state / "daemon.sock"))
    from hold_supervisor.proc.cgroup import Hierarchy

    leaf = Hierarchy.find().create("hold-" + os.urandom(6).hex())
    try:
        f = sock.makefile("rb")
        sock.sendall(b'{"op": "open"}\n')
        assert json.loads(f.readline())["ev"] == "session"
        sock.sendall(
            json.dumps(
                {
                    "op": "acquire",
                    "cls": "npu",
                    "count": 1,
                    "label": "x",
                    "ttl": 60,
                    "grace": 1,
                    "wait": True,
                }
            ).encode()
            + b"\n"
        )
        while json.loads(f.readline())["ev"] != "granted":
            pass
        f.close()
        sock.close()
        # The lease ends (the daemon says so in its log) and the leaf is still there.
        log = state / "daemon.log"
        wait_for(lambda: '"session_ended"' in log.read_text(), 10, what="the lease's end")
        assert os.path.isdir(leaf.path)
    finally:
        leaf.remove(Hierarchy.find().base)
