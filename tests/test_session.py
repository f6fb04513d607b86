"""The lease session every guarded run shares (``hold.client.session.LeaseSession``):
a real daemon, a real lease; its end happens once, whoever asks first, and a
daemon that stops answering is a clear loss within the client's deadline."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from conftest import LOADED, daemon_pid

from hold.client import waits
from hold.client.session import DaemonLost, LeaseSession
from hold.statedir import open_state_dir


def _events(state: Path, name: str) -> list[dict[str, object]]:
    out = []
    for line in (state / "daemon.log").read_text().splitlines():
        e = json.loads(line)
        if e.get("event") == name:
            out.append(e)
    return out


def _open(said: list[str], needs_lease: bool) -> LeaseSession:
    session = LeaseSession.open(open_state_dir(), said.append, digest=None, needs_lease=needs_lease)
    assert isinstance(session, LeaseSession), said
    return session


def test_a_lease_ends_once_whoever_asks(isolated_hold: Path) -> None:
    said: list[str] = []
    session = _open(said, needs_lease=True)
    env: dict[str, str] = {}
    try:
        code = session.acquire(
            cls="npu",
            indices=None,
            count=1,
            label="session-test",
            ttl=60.0,
            grace=1.0,
            wait=True,
            wait_timeout=None,
            tree=None,
            env=env,
        )
        assert code is None, said
        assert session.granted is not None and session.holds_lease
        assert env["HOLD_LEASE"] == session.granted.lease
        client = session.client
        assert client is not None
        asked: list[float] = []
        real_end = client.end

        def counted_end(timeout: float = 60.0) -> object:
            asked.append(timeout)
            return real_end(timeout=timeout)

        client.end = counted_end  # type: ignore[method-assign]
        session.end()  # a stack's stop, say
        session.end()  # and the run's way out: nothing more
        assert asked == [60.0]
    finally:
        session.close()
    state = isolated_hold / "state"
    ending = [e for e in _events(state, "session_ending") if e.get("lease") == env["HOLD_LEASE"]]
    assert len(ending) == 1, ending
    assert ending[0].get("reason") == "ended by its holder"  # its end, not the lifeline


def test_a_stopped_daemon_is_a_loss_within_the_deadline(isolated_hold: Path) -> None:
    said: list[str] = []
    session = _open(said, needs_lease=False)
    assert session.guarded
    pid = daemon_pid(isolated_hold / "state")
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        try:
            session.register({"tree_id": "abc123", "leaf": None, "grace": 1.0})
        except DaemonLost as e:
            took = time.monotonic() - start
            assert "did not answer" in str(e), e
        else:
            raise AssertionError("a stopped daemon answered")
        # asked, then asked whether it still reads: two deadlines, and some slack
        assert took < 2 * waits.DAEMON + LOADED, took
    finally:
        os.kill(pid, signal.SIGCONT)
        session.close()
