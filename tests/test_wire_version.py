"""The wire's version: a client and a daemon of different releases of hold.

Every request carries ``"v"``; a daemon refuses one of another version (exit
125, both versions named) instead of reading it as its own. A client that
meets an idle daemon of its own speaking another version replaces it, as it
replaces one reading another configuration; a busy one stays, and the client
says which daemon, why and what to do.

"Another release" is this code with its ``WIRE`` set otherwise before
anything reads it, started as an autostart starts a daemon: a real daemon,
refusing for real.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import alive, daemon_pid

from hold.protocol import WIRE, LineBuffer, Message
from hold.statedir import open_state_dir
from hold_supervisor.exitcodes import TOOL

OTHER = WIRE + 1
BIN = Path(sys.executable).parent


def _start_daemon(state: Path, wire: int) -> int:
    """A detached, idle-exiting daemon (an autostarted one) that speaks ``wire``."""
    code = (
        "import sys, hold.protocol as p\n"
        f"p.WIRE = {wire}\n"
        "from hold.cli.entry import main\n"
        "sys.argv = ['hold', 'daemon', '--detach']\n"
        "raise SystemExit(main())\n"
    )
    state.mkdir(mode=0o700, exist_ok=True)
    with open(state.parent / "other-daemon.log", "ab") as log:
        subprocess.run(
            [sys.executable, "-c", code],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            check=True,
            timeout=30,
        )
    pid = daemon_pid(state)
    assert pid is not None
    return pid


class Raw:
    """A plain socket to the daemon: the requests exactly as written."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(path)
        self.buf = LineBuffer()
        self.pending: list[Message] = []

    def ask(self, msg: dict[str, Any]) -> Message:
        self.sock.sendall(json.dumps(msg).encode() + b"\n")
        return self.next()

    def next(self) -> Message:
        while not self.pending:
            data = self.sock.recv(65536)
            assert data, "the daemon closed the connection"
            self.pending.extend(self.buf.feed(data))
        return self.pending.pop(0)

    def close(self) -> None:
        self.sock.close()


def test_a_request_of_another_version_is_refused_and_changes_nothing() -> None:
    sd = open_state_dir()
    pid = _start_daemon(Path(sd.path), WIRE)
    raw = Raw(sd.socket)
    try:
        for spoken in (OTHER, True, str(WIRE), None):
            ans = raw.ask({"op": "open", "v": spoken})
            assert ans["ev"] == "error" and ans["code"] == TOOL and ans["wire"] == WIRE, ans
            assert f"speaks wire version {WIRE}" in ans["error"], ans
            assert f"in version {spoken!r}" in ans["error"], ans
            assert f"pid {pid}" in ans["error"], ans
        # Nothing was opened (a second open would be refused: "session
        # already open"), and the connection still serves its own version.
        ans = raw.ask({"op": "open", "v": WIRE})
        assert ans["ev"] == "session" and ans["arbiter"]["wire"] == WIRE, ans
        # Without "v" (a person at socat, a client from before versions): version 1.
        ans = raw.ask({"op": "leases"})
        assert ans["ev"] == ("leases" if WIRE == 1 else "error"), ans
    finally:
        raw.close()


def test_an_idle_daemon_of_another_version_is_replaced() -> None:
    sd = open_state_dir()
    old = _start_daemon(Path(sd.path), OTHER)
    run = subprocess.run(
        [str(BIN / "npu-hold"), "-l", "wire", "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert not alive(old)
    new = daemon_pid(Path(sd.path))
    assert new is not None and new != old
    raw = Raw(sd.socket)
    try:
        ans = raw.ask({"op": "open", "v": WIRE})
        assert ans["ev"] == "session" and ans["arbiter"]["wire"] == WIRE, ans
    finally:
        raw.close()


def test_a_busy_daemon_of_another_version_stays_and_is_named() -> None:
    sd = open_state_dir()
    old = _start_daemon(Path(sd.path), OTHER)
    holder = Raw(sd.socket)  # a client of that release, holding a lease
    try:
        assert holder.ask({"op": "open", "v": OTHER})["ev"] == "session"
        ans = holder.ask(
            {
                "op": "acquire",
                "v": OTHER,
                "cls": "npu",
                "label": "theirs",
                "ttl": 60.0,
                "grace": 1.0,
            }
        )
        while ans["ev"] in ("queued", "warning"):
            ans = holder.next()
        assert ans["ev"] == "granted", ans

        run = subprocess.run(
            [str(BIN / "npu-hold"), "-l", "ours", "--", "true"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == TOOL, (run.returncode, run.stderr)
        said = run.stderr
        assert said.startswith("npu-hold: the ticket daemon for "), said
        assert f"(pid {old}) speaks wire version {OTHER} of hold" in said, said
        assert f"this client speaks {WIRE}" in said, said
        assert "cannot be replaced now: busy: npu lease" in said, said
        assert "Traceback" not in said, said

        status = subprocess.run(
            [str(BIN / "hold"), "status"], capture_output=True, text=True, timeout=60
        )
        assert status.returncode == TOOL, (status.returncode, status.stderr)
        assert f"speaks wire version {OTHER}" in status.stderr, status.stderr

        # The daemon and its lease are as they were.
        assert daemon_pid(Path(sd.path)) == old
        ans = holder.ask({"op": "leases", "v": OTHER})
        assert [lease["label"] for lease in ans["leases"]] == ["theirs"], ans
    finally:
        holder.close()
