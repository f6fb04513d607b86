"""``hold down`` of a stack that is still starting (here: waiting in line for
its ticket) stops it and waits for it, instead of answering "not running"."""

from __future__ import annotations

import json
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
    holder = subprocess.Popen(
        [NPU_HOLD, "-l", "first", "--", sys.executable, GATED, str(work), "A", "--wait"],
        stderr=subprocess.DEVNULL,
    )
    up_err = tmp_path / "up.err"
    up: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: (work / "A.ready").exists(), 20, what="the holder")
        with open(up_err, "w") as err:
            up = subprocess.Popen([*HOLD, "up", str(stack)], stdin=subprocess.DEVNULL, stderr=err)
        wait_for(lambda: "waiting for npu" in up_err.read_text(), 20, what="up to wait")
        res = subprocess.run([*HOLD, "down", "waiting"], capture_output=True, text=True, timeout=60)
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


FORBIDDEN = ("hold_supervisor.stackfile.schema", "yaml", "click", "structlog")


def test_the_background_supervisor_imports_no_validation_nor_cli() -> None:
    """What ``hold.cli.upchild`` loads before it reads its stack (everything its run
    needs): none of the stack file's validators, the YAML reader, click or structlog
    (issue 13: they would be most of a supervisor's memory, for the stack's life)."""
    code = (
        "import os, sys\n"
        "from hold.cli import upchild\n"
        "r, w = os.pipe(); os.close(w)\n"
        "assert upchild.main([str(r), '2']) == 0\n"  # an empty stack: it ends
        f"print(sorted(set(sys.modules) & set({FORBIDDEN!r})))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_down_answers_once_the_stack_has_let_go_of_its_name(tmp_path: Path) -> None:
    """The detached supervisor is the light one (no YAML reader in its memory), and
    ``hold down`` is answered without waiting for that process to end: the record
    already says stopped, the socket is gone and the name is free for a new run."""
    pidfile = tmp_path / "pid"
    stack = tmp_path / "stack.yaml"
    stack.write_text(
        "name: light\nunits:\n  one:\n"
        f'    cmd: [sh, -c, "echo $$ > {pidfile}; exec sleep 60"]\n'
        f'    ready: {{file: "{pidfile}"}}\n'
    )
    run_dir = Path(os.environ["HOLD_STATE_DIR"]) / "stacks" / "light"
    for _ in range(2):  # the second: at once after the first's down
        res = subprocess.run(
            [*HOLD, "up", "--detach", str(stack)], capture_output=True, text=True, timeout=60
        )
        assert res.returncode == 0, res.stderr
        ps = subprocess.run([*HOLD, "ps", "light", "--json"], capture_output=True, text=True)
        supervisor = json.loads(ps.stdout)["pid"]
        maps = Path(f"/proc/{supervisor}/maps").read_text()
        assert "_yaml" not in maps
        unit = int(pidfile.read_text())
        res = subprocess.run([*HOLD, "down", "light"], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0 and "stack light stopped" in res.stderr, res.stderr
        assert not alive(unit)
        assert json.loads((run_dir / "stack.json").read_text())["state"] == "stopped"
        assert not (run_dir / "control.sock").exists()
        wait_for(lambda s=supervisor: not alive(s), 10, what="the supervisor's exit")
        pidfile.unlink()
