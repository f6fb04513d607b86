"""The system daemon's unit: the file in units/ is what ``hold daemon --install`` writes."""

from __future__ import annotations

import subprocess
from pathlib import Path

from conftest import HOLD, ROOT

from hold.daemon.sysunit import UNIT_NAME, render, this_hold


def test_the_unit_in_the_repository_is_the_one_installed() -> None:
    shipped = (ROOT / "units" / "systemd" / UNIT_NAME).read_text()
    assert shipped == render("/usr/local/bin/hold")
    assert "ExecStart=/usr/local/bin/hold daemon --system" in shipped
    assert "PrivateTmp" not in shipped.replace("(no PrivateTmp)", "")


def test_install_writes_the_unit_for_this_hold(tmp_path: Path) -> None:
    res = subprocess.run(
        [*HOLD, "daemon", "--install", "--no-start", "--unit-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    written = (tmp_path / UNIT_NAME).read_text()
    assert written == render(this_hold())
    assert (tmp_path / UNIT_NAME).stat().st_mode & 0o777 == 0o644
    # A symlink planted where the unit goes is refused, not written through.
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    (tmp_path / UNIT_NAME).unlink()
    (tmp_path / UNIT_NAME).symlink_to(victim)
    res = subprocess.run(
        [*HOLD, "daemon", "--install", "--no-start", "--unit-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 2 and "symlink" in res.stderr, res.stderr
    assert victim.read_text() == "mine\n"
