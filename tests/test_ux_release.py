"""A lease ended by ``hold release``: the holder exits 6 (documented), whatever its
command made of the polite signal -- a command that exits 0 on SIGTERM must not
make a cut-short run look done.

Real holders (``npu-hold``) under the test's own daemon (conftest).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HOLD, alive, wait_for

from hold.daemon.tokens import read_record
from hold_supervisor.exitcodes import RELEASED

BIN = Path(sys.executable).parent
NPU_HOLD = str(BIN / "npu-hold")

# Writes its pid, then loops until a signal; with "trap", SIGTERM makes it exit 0.
COMMANDS = {
    "killed by TERM": 'echo $$ > "$1"; while :; do sleep 0.05; done',
    "exits 0 on TERM": 'trap "exit 0" TERM; echo $$ > "$1"; while :; do sleep 0.05; done',
}


def _hold(tmp_path: Path, how: str) -> tuple[subprocess.Popen[bytes], int, str]:
    """``npu-hold`` running a command of COMMANDS: the holder, its command's pid, the lease."""
    pidfile = tmp_path / "pid"
    with open(tmp_path / "H.stderr", "w") as err:
        h = subprocess.Popen(
            [
                NPU_HOLD,
                "-l",
                "job",
                "--grace",
                "5s",
                "--",
                "sh",
                "-c",
                COMMANDS[how],
                "sh",
                str(pidfile),
            ],
            stdin=subprocess.DEVNULL,
            stdout=err,
            stderr=err,
        )
    try:
        pid = int(
            wait_for(
                lambda: pidfile.exists() and pidfile.read_text().strip(),
                20,
                what="the command's pid",
            )
        )
        token = os.path.join(os.environ["HOLD_STATE_DIR"], "npu-0.token")
        lease = wait_for(lambda: (r := read_record(token)) and r["lease"], 20, what="the token")
    except BaseException:
        h.kill()
        h.wait()
        raise
    return h, pid, lease


def _release(lease: str) -> None:
    res = subprocess.run(
        [*HOLD, "release", lease],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("how", list(COMMANDS))
def test_released_lease_exits_6(tmp_path: Path, how: str) -> None:
    h, pid, lease = _hold(tmp_path, how)
    try:
        _release(lease)
        assert h.wait(30) == RELEASED == 6
    finally:
        if h.poll() is None:
            h.kill()
            h.wait()
    said = (tmp_path / "H.stderr").read_text()
    assert "npu-hold: lease released by root" in said, said
    assert not alive(pid)


@pytest.mark.parametrize("how", list(COMMANDS))
def test_a_holder_that_wakes_after_its_command_was_stopped_exits_6(
    tmp_path: Path, how: str
) -> None:
    """The daemon says "released" before it stops the command. A holder the
    machine runs late (here: stopped until the command is gone) wakes to both at
    once, and the reason wins: 6, not the command's own 143 -- or 0, which would
    make a cut-short run look done. Found beside a second suite and two busy loops."""
    h, pid, lease = _hold(tmp_path, how)
    os.kill(h.pid, signal.SIGSTOP)
    try:
        _release(lease)
        wait_for(lambda: not alive(pid), 20, what="the command stopped by the daemon")
        os.kill(h.pid, signal.SIGCONT)
        assert h.wait(30) == RELEASED
    finally:
        if h.poll() is None:
            os.kill(h.pid, signal.SIGCONT)
            h.kill()
            h.wait()
    said = (tmp_path / "H.stderr").read_text()
    assert "npu-hold: lease released by root" in said, said
