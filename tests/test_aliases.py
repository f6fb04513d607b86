"""One device named by two classes (issue 24): ``npu: [a0]`` and ``other:
[alias0]``, where ``alias0`` is a hard link to ``a0``. A device is one device,
whatever class or path names it: one holder at a time, and a waiter of either
class is granted once the other's lease ends (it waited for ever at "other is
being checked for the next holder")."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import HOLD, holds_node, update_config, wait_for, wait_in_line


def _run(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*HOLD, "run", *args], stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


@pytest.fixture
def a0(isolated_hold: Path, tmp_path: Path) -> Path:
    """The node ``a0`` in class ``npu``, and its hard link ``alias0`` in class ``other``."""
    a0 = tmp_path / "a0"
    a0.write_text("")
    os.link(a0, tmp_path / "alias0")
    update_config(
        isolated_hold,
        devices={"npu": {"nodes": [str(a0)]}, "other": {"nodes": [str(tmp_path / "alias0")]}},
    )
    return a0


def test_a_device_named_by_two_classes_passes_between_them(a0: Path, tmp_path: Path) -> None:
    first = tmp_path / "first"
    holder = _run("--device", "npu", "--", "sh", "-c", f"touch {first}; sleep 2")
    try:
        wait_for(first.exists, 20, what="the npu lease's command")
        start = time.monotonic()
        busy = subprocess.run(
            [*HOLD, "run", "--device", "other", "--no-wait", "--", "true"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert busy.returncode == 75, busy.stderr  # one device: not both at once
        others = [_run("--device", "other", "--wait-timeout", "20s", "--", "true") for _ in (1, 2)]
        again = _run("--device", "npu", "--wait-timeout", "20s", "--", "true")
        codes = [p.wait(40) for p in [*others, again]]
        assert codes == [0, 0, 0], [p.stderr.read() if p.stderr else "" for p in others]
        assert time.monotonic() - start < 25
    finally:
        holder.wait(30)


def test_a_stray_on_a_device_of_two_classes_is_waited_out_by_either(a0: Path) -> None:
    """A process outside any lease holds ``a0``: ``npu`` is refused (the device
    is held), and a waiter of ``other`` is granted once the stray ends -- its
    end is the daemon's event for every class that names the device, not only
    for the class whose scan found it."""
    stray = subprocess.Popen(["sh", "-c", f'exec sleep 120 3<"{a0}"'])
    try:
        wait_for(lambda: holds_node(stray.pid, a0), 10, what="the stray to hold a0")
        busy = subprocess.run(
            [*HOLD, "run", "--device", "npu", "--no-wait", "--", "true"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert busy.returncode == 75 and str(stray.pid) in busy.stderr, busy.stderr
        waiter = _run("--device", "other", "--wait-timeout", "30s", "--", "true")
        wait_in_line("other", 1)
        stray.kill()
        stray.wait(10)
        code = waiter.wait(40)
        assert code == 0, waiter.stderr.read() if waiter.stderr else ""
    finally:
        if stray.poll() is None:
            stray.kill()
            stray.wait(10)
