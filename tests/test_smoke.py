"""The README's main job, end to end."""

from __future__ import annotations

import subprocess

from conftest import HOLD, ROOT


def test_demo_escapee_is_stopped(cgroup_mode: str) -> None:
    res = subprocess.run(
        [*HOLD, "run", "-v", "--grace", "2s", "--", "python3", str(ROOT / "units/demo_escapee.py")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    pid = int(res.stdout.split()[1].rstrip(":"))
    assert f"via {cgroup_mode}" in res.stderr
    assert "1 stopped" in res.stderr and "survivor check empty" in res.stderr
    # The escapee is gone: not even a zombie with that start time remains alive.
    from conftest import alive

    assert not alive(pid)
