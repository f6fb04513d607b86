"""A stuck ticket daemon never blocks its callers past their deadline (issue 23, item 1).

The daemon runs for real (autostarted by a first ``npu-hold -- true``) and is
then stopped with SIGSTOP, as a daemon stalled on a disk or a lock looks
(always let go again with SIGCONT). Each client command is run with a bounded
subprocess timeout; the wall time is checked against the command's target
plus a margin for a loaded machine (these are deadlines, not benchmarks), and
so are the exit status, the message (the daemon, its state directory, how
long it was given) and the absence of a traceback. The daemon's answer time
(hold.client.connection.ANSWER_TIMEOUT) is 3 s; ``hold check``'s is 2 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import HOLD, LOADED, daemon_pid, wait_for, wait_in_line

NPU_HOLD = str(Path(sys.executable).parent / "npu-hold")
MARGIN = LOADED  # on top of each target


def state_dir() -> Path:
    return Path(os.environ["HOLD_STATE_DIR"])


@pytest.fixture
def stopped() -> Iterator[int]:
    """A daemon that served a ticket, then SIGSTOPped; its pid."""
    first = subprocess.run([NPU_HOLD, "--", "true"], capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    pid = daemon_pid(state_dir())
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGCONT)


def timed(argv: list[str], limit: float) -> tuple[subprocess.CompletedProcess[str], float]:
    """``argv`` run to its end (never past ``limit`` + 20 s), and its wall time."""
    start = time.monotonic()
    res = subprocess.run(argv, capture_output=True, text=True, timeout=limit + 20)
    took = time.monotonic() - start
    assert "Traceback" not in res.stderr, res.stderr
    return res, took


def names_daemon(text: str, pid: int, seconds: int) -> None:
    """The message names the daemon, its state directory and how long it was given."""
    assert f"the ticket daemon (pid {pid}, {state_dir()}) did not answer within {seconds} s" in (
        text
    ), text


@pytest.mark.parametrize("wait", [["--wait-timeout", "3s"], ["--no-wait"], []])
def test_npu_hold_ends_when_the_daemon_does_not_answer(stopped: int, wait: list[str]) -> None:
    """Before: 30.1 s (rc 125). The daemon did not answer: 125, not 75 (nothing
    waited in line), whatever the caller's wait."""
    res, took = timed([NPU_HOLD, *wait, "--", "true"], 5)
    assert took < 5 + MARGIN, took
    assert res.returncode == 125, res.stderr
    names_daemon(res.stderr, stopped, 3)
    assert "nothing was granted" in res.stderr


def test_hold_run_goes_on_without_a_guardian_and_says_so(stopped: int) -> None:
    """Before: 30 s, then on "without a guardian". A run with no device takes
    nothing from anyone: it runs, and stderr says the daemon did not answer."""
    res, took = timed([*HOLD, "run", "--", "sh", "-c", "echo ran"], 5)
    assert took < 5 + MARGIN, took
    assert res.returncode == 0, res.stderr
    assert res.stdout == "ran\n"
    names_daemon(res.stderr, stopped, 3)
    assert "without a guardian" in res.stderr


def test_hold_check_fails_closed(stopped: int) -> None:
    """Before: 10.1 s. Now a "no" (exit 1) within 2 s, saying why."""
    res, took = timed([*HOLD, "check"], 3)
    assert took < 3 + MARGIN, took
    assert res.returncode == 1
    assert "no npu lease covers this process" in res.stderr
    names_daemon(res.stderr, stopped, 2)


@pytest.mark.parametrize("cmd", [["status"], ["status", "--json"], ["metrics"]])
def test_status_and_metrics_say_so(stopped: int, cmd: list[str]) -> None:
    """Before: a TimeoutError traceback after 10 s."""
    res, took = timed([*HOLD, *cmd], 5)
    assert took < 5 + MARGIN, took
    assert res.returncode == 125
    assert res.stdout == ""
    names_daemon(res.stderr, stopped, 3)


def test_release_says_so(stopped: int) -> None:
    """Before: still waiting at 60 s."""
    res, took = timed([*HOLD, "release", "0123456789abcdef"], 5)
    assert took < 5 + MARGIN, took
    assert res.returncode == 125
    names_daemon(res.stderr, stopped, 3)
    assert "may not be released" in res.stderr


def test_report_is_read_from_the_history_file(stopped: int) -> None:
    """Before: still waiting at 60 s. The history file is ours: read here, said so."""
    res, took = timed([*HOLD, "report", "--json"], 5)
    assert took < 5 + MARGIN, took
    assert res.returncode == 0, res.stderr
    assert '"users"' in res.stdout
    names_daemon(res.stderr, stopped, 3)
    assert "read from its history file" in res.stderr


def test_a_daemon_that_stops_while_we_wait_in_line() -> None:
    """In line behind a holder, the daemon stops: without --wait-timeout the
    wait ends with 125 once it does not answer whether it still reads (3 s of
    silence, then 3 s to answer); with one that runs out first, 75."""
    holder = subprocess.Popen(
        [NPU_HOLD, "-l", "holder", "--", "sleep", "60"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    pid = None
    try:
        wait_for(lambda: (state_dir() / "npu-0.token").exists() or holder.poll() is not None, 20)
        assert holder.poll() is None
        pid = daemon_pid(state_dir())
        assert pid is not None
        waiters = {
            "none": subprocess.Popen(
                [NPU_HOLD, "--", "true"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            ),
            "2s": subprocess.Popen(
                [NPU_HOLD, "--wait-timeout", "2s", "--", "true"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        }
        wait_in_line("npu", 2)  # both asked, and answered "queued"
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        try:
            out = {k: p.communicate(timeout=30) for k, p in waiters.items()}
            took = time.monotonic() - start
        finally:
            os.kill(pid, signal.SIGCONT)
        assert waiters["2s"].returncode == 75, out["2s"][1]
        assert "not granted within 2s" in out["2s"][1]
        assert waiters["none"].returncode == 125, out["none"][1]
        names_daemon(out["none"][1], pid, 3)
        assert took < 6 + MARGIN, took
        for _, err in out.values():
            assert "Traceback" not in err, err
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        holder.terminate()
        holder.wait(30)


def test_the_end_of_a_lease_is_not_waited_for_forever() -> None:
    """The daemon stops while the command runs (the command stops it): the end
    of the lease is not confirmed; npu-hold says so and exits with the
    command's status, within 3 s of silence and 3 s to answer a ping."""
    subprocess.run([NPU_HOLD, "--", "true"], check=True, capture_output=True, timeout=60)
    pid = daemon_pid(state_dir())
    assert pid is not None
    try:
        res, took = timed([NPU_HOLD, "--", "sh", "-c", f"kill -STOP {pid}; exit 7"], 6)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert res.returncode == 7, res.stderr
    assert took < 6 + MARGIN, took
    names_daemon(res.stderr, pid, 3)
    assert "to end the lease" in res.stderr


def test_a_daemon_whose_backlog_is_full(stopped: int) -> None:
    """A stopped daemon accepts nothing: once its listen backlog is full, a
    connect would wait for ever; it is bounded like any answer."""
    import socket

    held = []
    try:
        for _ in range(1000):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(str(state_dir() / "daemon.sock"))
            except BlockingIOError:
                s.close()
                break
            held.append(s)
        else:
            pytest.fail("the daemon's backlog never filled")
        for argv, limit, code in (
            ([*HOLD, "status"], 5, 125),
            ([*HOLD, "check"], 3, 1),
            ([NPU_HOLD, "--", "true"], 5, 125),
        ):
            res, took = timed(argv, limit)
            assert took < limit + MARGIN, (argv, took)
            assert res.returncode == code, res.stderr
            assert f"the ticket daemon (pid {stopped}, {state_dir()}) did not accept a " in (
                res.stderr
            )
    finally:
        for s in held:
            s.close()
