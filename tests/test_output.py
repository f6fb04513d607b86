"""Reading a child's output: no read outlives its deadline, whatever the child does."""

from __future__ import annotations

import os
import select
import signal
import time
import uuid
from collections.abc import Iterator

import pytest

from hold_supervisor.environ import minimal_env
from hold_supervisor.proc.identity import ProcessId
from hold_supervisor.spawn.child import Child, spawn
from hold_supervisor.spawn.output import LineReader

# How late a deadline may be noticed. Generous: other test runs share this
# machine's two cores. A reader that blocks until the child next speaks (the
# bug this guards against) misses it by the child's whole silence: 30 s here.
LATE = 0.5


class Piped:
    """A child whose stdout is a pipe, read by a :class:`LineReader`."""

    def __init__(self, script: str, *, max_line: int = 1 << 20) -> None:
        r, w = os.pipe()
        try:
            self.child: Child = spawn(
                ["sh", "-c", script],
                env=minimal_env(os.environ, tree_id=f"t-{uuid.uuid4().hex[:12]}"),
                stdout=w,
            )
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        self.fd = r
        self.reader = LineReader(r, max_line=max_line)

    def readline(self, within: float = 10.0) -> str | None:
        return self.reader.readline(time.monotonic() + within)

    def close(self) -> None:
        if self.child.poll() is None:
            self.child.send_signal(signal.SIGKILL)
        _wait(self.child)
        os.close(self.fd)


def _wait(child: Child, timeout: float = 10.0) -> int:
    """The child's status, waiting at most ``timeout``."""
    if child.poll() is None:
        poller = select.poll()
        poller.register(child.pidfd, select.POLLIN)
        poller.poll(timeout * 1000)
    rc = child.poll()
    assert rc is not None, f"{child.argv} did not exit within {timeout}s"
    return rc


@pytest.fixture
def piped() -> Iterator[type[Piped]]:
    made: list[Piped] = []

    class Tracked(Piped):
        def __init__(self, script: str, **kw: int) -> None:
            super().__init__(script, **kw)
            made.append(self)

    yield Tracked
    for p in made:
        p.close()


def _times_out_at(reader: LineReader, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    with pytest.raises(TimeoutError):
        reader.readline(deadline)
    now = time.monotonic()
    assert now >= deadline, "gave up before its deadline"
    assert now - deadline < LATE, f"returned {now - deadline:.3f}s after its deadline"


def test_silent_child_times_out_at_the_deadline(piped: type[Piped]) -> None:
    p = piped("echo first; exec sleep 30")
    assert p.readline() == "first"
    _times_out_at(p.reader, 1.0)
    # A timeout loses nothing and can be repeated.
    _times_out_at(p.reader, 0.3)
    assert not p.reader.at_eof
    # Once the child is gone, the pipe ends and the reader says so.
    p.child.send_signal(signal.SIGKILL)
    assert p.readline() is None
    assert p.reader.at_eof


def test_trickle_without_newline_cannot_extend_the_deadline(piped: type[Piped]) -> None:
    # A child that keeps sending bytes but never a whole line: each byte wakes
    # the reader, and none of them may buy it more time.
    p = piped("while :; do printf x; sleep 0.05; done")
    _times_out_at(p.reader, 1.0)
    p.child.send_signal(signal.SIGKILL)
    # What arrived before the timeout was kept: the partial line comes back whole.
    rest = p.readline()
    assert rest is not None and len(rest) >= 5 and set(rest) == {"x"}, rest
    assert p.readline() is None


def test_partial_line_then_exit(piped: type[Piped]) -> None:
    p = piped("echo whole; printf 'no newline at the end'")
    assert p.readline() == "whole"
    assert p.readline() == "no newline at the end"
    assert p.readline() is None
    assert p.readline() is None  # and for ever after
    assert p.reader.at_eof
    assert _wait(p.child) == 0


def test_killed_mid_line_returns_the_partial_line(piped: type[Piped]) -> None:
    p = piped("printf 'half a li'; exec sleep 30")
    _times_out_at(p.reader, 0.5)
    p.child.send_signal(signal.SIGKILL)
    assert p.readline() == "half a li"
    assert p.readline() is None
    assert _wait(p.child) == -signal.SIGKILL


def test_lines_split_across_writes_are_joined(piped: type[Piped]) -> None:
    p = piped(
        "printf 'hel'; sleep 0.2; printf 'lo\\nwor'; sleep 0.2; printf 'ld\\n\\n'; sleep 0.2;"
        " printf '\\303'; sleep 0.2; printf '\\251t\\303\\251\\n'; printf last"
    )
    assert p.readline() == "hello"
    assert p.readline() == "world"
    assert p.readline() == ""
    assert p.readline() == "\u00e9t\u00e9"  # a UTF-8 character split between two writes
    assert p.readline() == "last"
    assert p.readline() is None


def test_many_lines_in_one_write_come_out_in_order(piped: type[Piped]) -> None:
    p = piped("seq 1 5000")
    got = []
    while (line := p.readline()) is not None:
        got.append(line)
    assert got == [str(i) for i in range(1, 5001)]


@pytest.mark.parametrize(
    "script",
    [
        "printf 'xxxxxxxxxxyyyyyyyyyyzzz\\n0123456789\\nok\\n'",
        # The same bytes in pieces: the lines must come out the same.
        "printf xxxxxxxxxx; sleep 0.2; printf yyyyyyyyyyzzz; sleep 0.2; printf '\\n0123456789';"
        " sleep 0.2; printf '\\nok\\n'",
        "printf xxxxxxxxxxyy; sleep 0.2; printf yyyyyyyyzzz; sleep 0.2; printf '\\n012345678';"
        " sleep 0.2; printf '9\\nok\\n'",
    ],
    ids=["one-write", "cut-at-boundaries", "cut-mid-piece"],
)
def test_overlong_line_is_cut_at_max_line(piped: type[Piped], script: str) -> None:
    p = piped(script, max_line=10)
    got = [p.readline() for _ in range(6)]
    # A line of exactly max_line characters is one line, not a line and an empty one.
    assert got == ["x" * 10, "y" * 10, "zzz", "0123456789", "ok", None]


def test_grandchild_holding_the_pipe_keeps_it_open_but_not_the_reader(
    piped: type[Piped],
) -> None:
    # The child exits; its background grandchild still holds the pipe, so
    # there is no end of file yet -- and the read must still end on time.
    p = piped("sleep 30 & echo $!")
    line = p.readline()
    assert line is not None
    grandchild = ProcessId.of(int(line))
    try:
        assert _wait(p.child) == 0
        _times_out_at(p.reader, 0.5)
    finally:
        grandchild.send_signal(signal.SIGKILL)
    assert p.readline() is None


def test_deadline_already_past(piped: type[Piped]) -> None:
    p = piped("printf 'one\\ntwo\\n'; exec sleep 30")
    assert p.readline() == "one"
    # A line already read in is handed out even with no time left...
    assert p.reader.readline(time.monotonic() - 1) == "two"
    # ...and with nothing buffered, a past deadline fails at once.
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        p.reader.readline(t0 - 1)
    assert time.monotonic() - t0 < LATE


def test_pty_end_is_end_of_file() -> None:
    # On a pty, the reader sees EIO (not an empty read) once the child is gone.
    master, slave = os.openpty()
    try:
        child = spawn(
            ["sh", "-c", "echo line; printf partial"],
            env=minimal_env(os.environ, tree_id=f"t-{uuid.uuid4().hex[:12]}"),
            stdout=slave,
        )
    finally:
        os.close(slave)
    try:
        reader = LineReader(master)
        first = reader.readline(time.monotonic() + 10)
        # A terminal turns "\n" into "\r\n"; the reader hands that "\r" on.
        assert first is not None and first.rstrip("\r") == "line"
        assert reader.readline(time.monotonic() + 10) == "partial"
        assert reader.readline(time.monotonic() + 10) is None
        assert _wait(child) == 0
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
            _wait(child)
        os.close(master)
