"""Waiting for a ticket, as a person sees it (issue 14).

Not at a terminal: a line per change, saying when the holder's lease ends
(the date where it is not today) and how long that is. At a terminal (a pty
as the client's stderr): one line redrawn in place (``\\r``, clear to the end
of the line) within the terminal's width, about once a second, cleared when
the wait ends.

Real clients against the test's own daemon (conftest); the holder is
``tests/progs/gated.py``, which keeps its lease until told to go.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import PROGS, wait_for

from hold.daemon.tokens import read_record
from hold_supervisor.parse import format_when

BIN = Path(sys.executable).parent
NPU_HOLD = str(BIN / "npu-hold")
GATED = str(PROGS / "gated.py")
LABEL = "holder-with-a-label-long-enough-to-need-cutting"


class Holder:
    """``npu-hold -t TIME -l LABEL -- gated.py`` holding npu:0 until :meth:`go`."""

    def __init__(self, base: Path, time_limit: str) -> None:
        self.base = base
        self.err = open(base / "H.stderr", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                NPU_HOLD,
                "-t",
                time_limit,
                "-l",
                LABEL,
                "--",
                sys.executable,
                GATED,
                str(base),
                "H",
                "--wait",
            ],
            stdin=subprocess.DEVNULL,
            stdout=self.err,
            stderr=self.err,
        )
        wait_for(
            lambda: (base / "H.ready").exists() or self.proc.poll() is not None,
            20,
            what="the holder's command",
        )
        assert self.proc.poll() is None, (base / "H.stderr").read_text()
        self.record = wait_for(self._token, 20, what="the holder's token")

    def _token(self) -> dict[str, object] | None:
        rec = read_record(os.path.join(os.environ["HOLD_STATE_DIR"], "npu-0.token"))
        return rec if rec and rec.get("command_pid") else None

    def go(self) -> None:
        (self.base / "H.go").write_text("")

    def close(self) -> None:
        self.go()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.err.close()


@pytest.fixture
def holder(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Holder]:
    h = Holder(tmp_path, getattr(request, "param", "2d"))
    try:
        yield h
    finally:
        h.close()


def test_waiting_lines_give_the_date_and_the_time_left(tmp_path: Path, holder: Holder) -> None:
    """A lease that ends in two days: its date, and 1d23h left; lines, never ``\\r``."""
    expires = float(holder.record["expires"])  # type: ignore[arg-type]
    with open(tmp_path / "W.stderr", "w") as err:
        argv = [NPU_HOLD, "--wait-timeout", "2.5s", "--", "true"]
        res = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err, timeout=30)
    said = (tmp_path / "W.stderr").read_text()
    assert res.returncode == 75, said
    when = format_when(expires)
    assert re.fullmatch(r"\w{3} \d{1,2} \w{3} \d{2}:\d{2}", when), when  # not today
    assert f"held by {LABEL!r} (lease {holder.record['lease']}, pid {holder.proc.pid}, " in said
    assert f", until {when} (1d23h left)" in said, said
    assert "\r" not in said and "\x1b" not in said
    # One line per change: the holder did not change, so it is said once.
    assert said.count("waiting for npu, number 1 in line") == 1, said


# --------------------------------------------------------------------------
# At a terminal.


def open_pty(cols: int) -> tuple[int, int]:
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, cols, 0, 0))
    return master, slave


def read_until(master: int, buf: bytearray, done: Callable[[str], bool], timeout: float) -> str:
    """Read the pty into ``buf`` until ``done(text)`` (or the end, or ``timeout``: fails)."""
    deadline = time.monotonic() + timeout
    while not done(buf.decode(errors="replace")):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out; the terminal shows {bytes(buf)!r}")
        if not select.select([master], [], [], left)[0]:
            continue
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: every writer has closed the terminal
            chunk = b""
        if not chunk:
            raise AssertionError(f"the terminal closed; it showed {bytes(buf)!r}")
        buf += chunk
    return buf.decode(errors="replace")


WAITED = re.compile(r"waiting (\d[\dhms.]*) for npu")


@pytest.mark.parametrize(("cols", "columns_env"), [(60, None), (200, "80")])
def test_live_waiting_line_at_a_terminal(
    tmp_path: Path, holder: Holder, cols: int, columns_env: str | None
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns_env:
        env["COLUMNS"] = columns_env
    width = int(columns_env or cols)
    master, slave = open_pty(cols)
    try:
        proc = subprocess.Popen(
            [NPU_HOLD, "-l", "waiter", "--", "true"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=slave,
            stderr=slave,
        )
        os.close(slave)
        slave = -1
        buf = bytearray()
        try:
            # Redrawn in place, about once a second: three draws, three elapsed times.
            text = read_until(master, buf, lambda t: len(set(WAITED.findall(t))) >= 3, 20)
            holder.go()
            text = read_until(master, buf, lambda t: "granted npu:0" in t, 20)
            assert proc.wait(20) == 0, text
            # The grant's line whole (its \r\n may come in a chunk of its own).
            granted = re.compile(r"granted npu:0 \(lease \w+\)\r\n")
            text = read_until(master, buf, lambda t: granted.search(t) is not None, 5)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    draws = [d for d in text.split("\r") if "waiting" in d]
    assert len(draws) >= 3, text
    for d in draws:
        line = d.replace("\x1b[K", "")
        assert line.startswith("npu-hold: waiting "), repr(d)
        assert len(line) <= width - 1, (len(line), line)
        assert "\n" not in line, repr(d)  # redrawn, not a new line each time
    # The live line's words: place in line, who holds it, the time left (the
    # label cut first to make room; at 60 columns the end of the line too).
    first = draws[0].replace("\x1b[K", "")
    assert "1st in line; npu:0: root's " in first, first
    assert LABEL not in first
    if width >= 80:
        assert re.search(r"'h[-\w]*\.\.\.', 1d23h left$", first), first
    # Cleared when granted, then the grant on a line of its own.
    assert re.search(r"\r\x1b\[Knpu-hold: granted npu:0 \(lease \w+\)\r\n", text), repr(text)


def test_live_line_shows_the_time_left_at_a_wide_terminal(tmp_path: Path, holder: Holder) -> None:
    env = {**os.environ, "COLUMNS": "200"}
    master, slave = open_pty(200)
    try:
        proc = subprocess.Popen(
            [NPU_HOLD, "--wait-timeout", "1.5s", "--", "true"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=slave,
            stderr=slave,
        )
        os.close(slave)
        buf = bytearray()
        try:
            text = read_until(master, buf, lambda t: "giving up\r\n" in t, 20)
            assert proc.wait(20) == 75, text
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finally:
        os.close(master)
    draw = next(d for d in text.split("\r") if "waiting" in d).replace("\x1b[K", "")
    assert draw.endswith(f"1st in line; npu:0: root's {LABEL!r}, 1d23h left"), draw
    # The failure is said on a clean line: the live line cleared first.
    assert "\r\x1b[Knpu-hold: npu not granted within 1.5s; giving up\r\n" in text, repr(text)
