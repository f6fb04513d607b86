"""The time limit is the daemon's to enforce (issue 24): a lease whose client is
stopped (SIGSTOP) past its expiry does not keep the device. The daemon stops the
lease's tree after the grace, and lets go of the device's machine-wide lock
even though the stopped client still holds a descriptor of it (the copy it
keeps in case the daemon dies); the next in line is granted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import LOADED, alive, launcher_of, wait_for

NPU_HOLD = str(Path(sys.executable).parent / "npu-hold")


@pytest.mark.parametrize("asked", ["in line", "after the end"])
def test_a_stopped_client_does_not_keep_an_expired_lease(
    tmp_path: Path, cgroup_mode: str, asked: str
) -> None:
    """The next request is either in line before the expiry (the handoff) or
    comes once the expired lease's command is gone (nobody in line at the end)."""
    ready = tmp_path / "ready"
    first = subprocess.Popen(
        [
            NPU_HOLD,
            "-t",
            "1s",
            "--grace",
            "0.5s",
            "--",
            "sh",
            "-c",
            f"echo $$ > {ready}; exec sleep 60",
        ],
        stdin=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    stopped = None
    try:
        wait_for(lambda: ready.exists() and ready.read_text().strip(), 20, what="the first command")
        command = int(ready.read_text())
        stopped = launcher_of(first.pid)
        os.kill(stopped, signal.SIGSTOP)
        start = time.monotonic()
        if asked == "after the end":
            wait_for(lambda: not alive(command), 20, what="the expired lease's command to end")
        second = subprocess.run(
            [NPU_HOLD, "--wait-timeout", "20s", "--", "true"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
        )
        took = time.monotonic() - start
        assert second.returncode == 0, second.stderr
        # expiry (1 s) + grace (0.5 s) + the daemon's margin (2 s), and a loaded
        # machine; a second client left waiting would time out at 20 s (exit 75).
        assert took < 3.5 + LOADED, took
        assert not alive(command), "the expired lease's command still runs"
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        first.wait(30)
