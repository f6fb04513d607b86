"""Scratch directories: made fresh and private, removed through descriptors only,
never following a symlink or leaving the directory made; swept when the owner died."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hold_supervisor.spawn.scratch import Scratch, ScratchError, sweep


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    return victim


def test_fresh_private_and_removed(tmp_path: Path) -> None:
    root = tmp_path / "root"
    victim = _victim(tmp_path)
    with Scratch(str(root)) as s:
        path = Path(s.path)
        assert path.parent == root
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
        assert stat.S_IMODE(root.stat().st_mode) == 0o700
        (path / "a" / "b").mkdir(parents=True)
        (path / "a" / "b" / "f").write_text("x")
        (path / "a" / "ro").mkdir()
        (path / "a" / "ro" / "g").write_text("y")
        (path / "a" / "ro").chmod(0o500)  # root ignores it; a user's run would not
        # Planted links: to a directory and a file outside, and to the root itself.
        (path / "to_victim").symlink_to(victim)
        (path / "a" / "to_file").symlink_to(victim / "precious")
        (path / "to_root").symlink_to(root)
        (path / "dot").symlink_to(".")
    assert s.report is not None and s.report.clean, s.report.describe()
    assert not path.exists()
    assert root.is_dir() and list(root.iterdir()) == []
    assert (victim / "precious").read_text() == "keep me"


def test_a_name_swapped_for_a_symlink_is_not_followed(tmp_path: Path) -> None:
    root = tmp_path / "root"
    victim = _victim(tmp_path)
    s = Scratch(str(root))
    moved = tmp_path / "moved"
    os.rename(s.path, moved)
    os.symlink(victim, s.path)
    report = s.remove()
    # What we held open was emptied (it is the moved directory); the name now a
    # link is neither followed nor removed, and it is reported.
    assert (victim / "precious").read_text() == "keep me"
    assert os.path.islink(s.path)
    assert [why for _p, why in report.left] == ["the name is no longer the directory we made"]
    os.unlink(s.path)


def test_keep_renames_and_is_never_swept(tmp_path: Path) -> None:
    root = tmp_path / "root"
    s = Scratch(str(root), keep=True)
    (Path(s.path) / "out.txt").write_text("result")
    with s:
        pass
    kept = Path(s.path)
    assert kept.name.startswith("kept-")
    assert (kept / "out.txt").read_text() == "result"
    assert sweep(str(root)) == []
    assert kept.exists()


def test_min_free_refused_with_the_space_found(tmp_path: Path) -> None:
    with pytest.raises(ScratchError) as info:
        Scratch(str(tmp_path / "root"), min_free=1 << 60)
    assert "free in" in str(info.value) and "1048576.0 TiB required (min_free)" in str(info.value)
    assert info.value.exit_code == 2
    assert not (tmp_path / "root").exists()  # checked before anything is made


def test_sweep_removes_what_a_killed_owner_left(tmp_path: Path) -> None:
    root = tmp_path / "root"
    victim = _victim(tmp_path)
    code = (
        "import os, sys\n"
        "from hold_supervisor.spawn.scratch import Scratch\n"
        f"s = Scratch({str(root)!r})\n"
        f"os.symlink({str(victim)!r}, os.path.join(s.path, 'v'))\n"
        "open(os.path.join(s.path, 'f'), 'w').write('x')\n"
        "print(s.path, flush=True)\n"
        "sys.stdin.read()\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert owner.stdout is not None
    path = owner.stdout.readline().strip()
    try:
        # Alive: its lock is held, so the sweep leaves it.
        assert sweep(str(root)) == []
        assert os.path.isdir(path)
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        assert owner.stdin is not None
        owner.stdin.close()
        owner.stdout.close()
    reports = sweep(str(root))
    assert [r.path for r in reports] == [path] and reports[0].clean
    assert not os.path.exists(path)
    assert (victim / "precious").read_text() == "keep me"


def test_a_root_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(Exception, match="symlink"):
        Scratch(str(tmp_path / "link"))
    assert list(real.iterdir()) == []
