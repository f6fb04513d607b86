"""The leak check itself must be able to fail: a test that leaks is caught."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

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
