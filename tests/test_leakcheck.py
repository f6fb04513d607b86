"""The leak check itself must be able to fail: a test that leaks is caught."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import alive

HERE = Path(__file__).resolve().parent


def test_leak_check_catches_a_detached_escapee(tmp_path: Path) -> None:
    # A child pytest, with this conftest, runs a test that leaves a sleeper
    # behind that has left its session and been orphaned.
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_leaks.py").write_text(
        "import subprocess\n"
        "def test_leaks(tmp_path):\n"
        "    subprocess.run(['setsid', 'sh', '-c', 'sleep 30 & echo $! > %s'], check=True)\n"
        % (tmp_path / "pid")
    )
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "left 1 process(es) behind" in out and "sleep 30" in out, out
    # ...and it was killed, not just reported.
    assert not alive(int((tmp_path / "pid").read_text()))


def test_leak_check_catches_a_cgroup_leaf(tmp_path: Path) -> None:
    from supervisor.cgroup import CgroupUnavailable, Hierarchy

    try:
        Hierarchy.find()
    except CgroupUnavailable as e:
        pytest.skip(f"no writable cgroup v2 here: {e}")
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_leaks.py").write_text(
        "from supervisor.cgroup import Hierarchy\n"
        "def test_leaks():\n"
        "    Hierarchy.find().create('hold-leakcheck0001')\n"
    )
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "cgroup leaf(s) behind" in out and "hold-leakcheck0001" in out, out
    # ...and it was removed, not just reported.
    assert not os.path.exists(os.path.join(Hierarchy.find().base, "hold-leakcheck0001"))
