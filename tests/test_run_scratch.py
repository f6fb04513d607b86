"""``hold run --scratch``: a fresh private directory for the command, removed on every
way out of the run (exit, time limit, Ctrl-C, SIGTERM), kept with ``--keep-scratch``;
a run killed with SIGKILL leaves it, and the next run sweeps it. A symlink planted in
it is never followed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HOLD, wait_for

PY = sys.executable


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "cache").mkdir()  # XDG_CACHE_HOME must be an existing directory of ours
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "hold" / "scratch"


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep")
    return victim


# The command: says where its scratch is, fills it, plants links out of it.
FILL = (
    "import os, sys, time\n"
    "s = os.environ['HOLD_SCRATCH']\n"
    "open(sys.argv[1], 'w').write(s)\n"
    "os.makedirs(os.path.join(s, 'd', 'e'))\n"
    "open(os.path.join(s, 'd', 'e', 'f'), 'w').write('x')\n"
    "os.symlink(sys.argv[2], os.path.join(s, 'd', 'victim'))\n"
    "os.symlink('/', os.path.join(s, 'root'))\n"
    "time.sleep(float(sys.argv[3]))\n"
)


def _run(tmp_path: Path, *opts: str, sleep: str = "0") -> tuple[subprocess.Popen[str], Path]:
    where = tmp_path / "where"
    victim = tmp_path / "victim"
    proc = subprocess.Popen(
        [*HOLD, "run", "--scratch", *opts, "--", PY, "-c", FILL, str(where), str(victim), sleep],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, where


@pytest.mark.parametrize(
    ("how", "opts", "code"),
    [
        ("exit", (), 0),
        # 8 s: the limit must outlast the command's start-up on a loaded machine.
        ("time limit", ("-t", "8s"), 124),
        ("SIGINT", (), 128 + signal.SIGINT),
        ("SIGTERM", (), 128 + signal.SIGTERM),
    ],
)
def test_removed_on_every_way_out(
    tmp_path: Path, cache: Path, how: str, opts: tuple[str, ...], code: int
) -> None:
    victim = _victim(tmp_path)
    proc, where = _run(tmp_path, *opts, sleep="0" if how == "exit" else "60")
    wait_for(lambda: where.exists() and where.read_text(), 20, what="the command's scratch")
    scratch = Path(where.read_text())
    assert scratch.parent == cache
    if how != "exit":  # still running: its scratch is there, private
        wait_for(lambda: (scratch / "root").is_symlink(), 20, what="the command's links")
        assert oct(scratch.stat().st_mode & 0o777) == "0o700"
    if how.startswith("SIG"):
        wait_for(lambda: (scratch / "root").is_symlink(), 20, what="the command's links")
        proc.send_signal(getattr(signal, how))
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err
    assert not scratch.exists(), err
    assert (victim / "precious").read_text() == "keep"
    assert list(cache.iterdir()) == []


def test_kept_with_keep_scratch(tmp_path: Path, cache: Path) -> None:
    _victim(tmp_path)
    proc, _ = _run(tmp_path, "--keep-scratch")
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    kept = Path(err.split("scratch kept: ", 1)[1].split()[0])
    assert kept.parent == cache and kept.name.startswith("kept-")
    assert (kept / "d" / "e" / "f").read_text() == "x"


def test_a_killed_run_is_swept_by_the_next(tmp_path: Path, cache: Path) -> None:
    victim = _victim(tmp_path)
    proc, where = _run(tmp_path, sleep="60")
    wait_for(lambda: where.exists() and where.read_text(), 20, what="the command's scratch")
    scratch = Path(where.read_text())
    wait_for(lambda: (scratch / "root").is_symlink(), 20, what="the command's links")
    os.kill(proc.pid, signal.SIGKILL)  # hold run itself: its guardian stops the command
    proc.communicate(timeout=30)
    assert scratch.exists()  # nobody removed it: its lock is free now
    where.unlink()
    proc2, _ = _run(tmp_path)
    _out, err = proc2.communicate(timeout=30)
    assert proc2.returncode == 0, err
    assert not scratch.exists() and list(cache.iterdir()) == []
    assert (victim / "precious").read_text() == "keep"
