"""A ticket daemon that fails (to start, or on one request) is said as what failed and
where to read more, never as an exception's repr (issue 24: an autostarted daemon
whose device lock directory was missing answered every client
``bad request: FileNotFoundError(2, 'No such file or directory')``).

Each failure is real: the daemon is started by the client's autostart and meets a
missing directory, a name it may not replace, or a state file it may not write.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from conftest import HOLD, daemon_pid, hold_env, stop_daemon, wait_for

# A repr of an exception: ``FileNotFoundError(2, ...)``, ``KeyError('x')``.
REPR = re.compile(r"\b[A-Z]\w*(Error|Exception)\(")


def npu_hold(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*HOLD, "run", "--device", "npu", "--", "true"],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_autostart_with_a_missing_lock_directory_says_which_and_where(
    isolated_hold: Path,
) -> None:
    state = isolated_hold / "state"
    missing = isolated_hold / "no-such-locks"
    res = npu_hold(hold_env(HOLD_LOCK_DIR=str(missing)))
    assert res.returncode == 125, res.stderr
    assert "failed to start" in res.stderr, res.stderr
    assert f"HOLD_LOCK_DIR '{missing}' is not valid" in res.stderr, res.stderr
    assert str(state / "daemon.log") in res.stderr, res.stderr
    assert not REPR.search(res.stderr), res.stderr
    # It did not stay to fail every grant.
    wait_for(lambda: daemon_pid(state) is None, 10, what="the failed daemon's exit")


def test_a_daemon_that_cannot_make_its_socket_says_why(isolated_hold: Path) -> None:
    state = isolated_hold / "state"
    state.mkdir(mode=0o700)
    (state / "daemon.sock").mkdir()  # not a socket: the daemon never replaces it
    res = npu_hold(hold_env())
    assert res.returncode == 125, res.stderr
    assert "failed to start" in res.stderr, res.stderr
    assert "daemon.sock exists and is not a socket" in res.stderr, res.stderr
    assert not REPR.search(res.stderr), res.stderr
    wait_for(lambda: daemon_pid(state) is None, 10, what="the failed daemon's exit")


def test_a_grant_the_daemon_cannot_record_is_refused_and_the_daemon_stays(
    isolated_hold: Path,
) -> None:
    state = isolated_hold / "state"
    first = subprocess.run([*HOLD, "status"], capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    pid = daemon_pid(state)
    assert pid is not None
    # Its ledger's name taken by a directory: the grant's save fails in the daemon.
    (state / "state.json").unlink(missing_ok=True)
    (state / "state.json").mkdir()
    res = npu_hold(hold_env())
    assert res.returncode == 125, res.stderr
    assert "the ticket daemon cannot record the lease" in res.stderr, res.stderr
    assert f"{state / 'state.json'} is a directory" in res.stderr, res.stderr
    assert f"pid {pid}" in res.stderr and str(state / "daemon.log") in res.stderr
    assert "bad request" not in res.stderr and not REPR.search(res.stderr), res.stderr
    # One request failed, not the daemon: it still answers.
    again = subprocess.run([*HOLD, "status"], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and daemon_pid(state) == pid, again.stderr
    stop_daemon(state)


def test_a_state_directory_too_long_for_a_socket_is_refused_before_anything(
    isolated_hold: Path,
) -> None:
    long = isolated_hold / ("d" * 60) / ("e" * 60)
    res = subprocess.run(
        [*HOLD, "status"],
        env=hold_env(HOLD_STATE_DIR=str(long)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2, res.stderr
    assert "HOLD_STATE_DIR" in res.stderr and "bytes" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and not REPR.search(res.stderr), res.stderr
    assert not long.exists()  # nothing made
