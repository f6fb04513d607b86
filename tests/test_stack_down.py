"""``hold down`` of a stack that is still starting (here: waiting in line for
its ticket) stops it and waits for it, instead of answering "not running"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import HOLD, PROGS, alive, wait_for

NPU_HOLD = str(Path(sys.executable).parent / "npu-hold")
GATED = str(PROGS / "gated.py")


def test_down_stops_a_stack_waiting_for_its_ticket(tmp_path: Path) -> None:
    (tmp_path / "accel0").write_text("")
    Path(os.environ["HOLD_CONFIG"]).write_text(
        f'devices:\n  npu:\n    nodes: ["{tmp_path}/accel*"]\n'
    )
    work = tmp_path / "work"
    work.mkdir()
    started = tmp_path / "unit-started"
    stack = tmp_path / "stack.yaml"
    stack.write_text(
        "name: waiting\nhold: {device: npu}\nunits:\n  one:\n"
        f'    cmd: [sh, -c, "touch {started}; exec sleep 60"]\n'
    )
    holder = subprocess.Popen([NPU_HOLD, "-l", "first", "--", sys.executable, GATED, str(work),
                               "A", "--wait"], stderr=subprocess.DEVNULL)  # fmt: skip
    up_err = tmp_path / "up.err"
    up: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: (work / "A.ready").exists(), 20, what="the holder")
        with open(up_err, "w") as err:
            up = subprocess.Popen([*HOLD, "up", str(stack)], stdin=subprocess.DEVNULL,
                                  stderr=err)  # fmt: skip
        wait_for(lambda: "waiting for npu" in up_err.read_text(), 20, what="up to wait")
        res = subprocess.run([*HOLD, "down", "waiting"], capture_output=True, text=True,
                             timeout=60)  # fmt: skip
        assert res.returncode == 0, res.stderr
        assert "is starting" in res.stderr and "stack waiting stopped" in res.stderr
        # When down returns, up is gone (it held the stack's lock until its exit).
        assert up.wait(5) == 143, up_err.read_text()
        assert "stopped while starting" in up_err.read_text()
        assert not started.exists()
        assert holder.poll() is None
        res = subprocess.run([*HOLD, "down", "waiting"], capture_output=True, text=True)
        assert res.returncode == 0 and "not running" in res.stderr
    finally:
        (work / "A.go").write_text("")
        assert holder.wait(30) == 0
        if up is not None and up.poll() is None:
            up.kill()
            up.wait()
    assert up is not None and not alive(up.pid)
