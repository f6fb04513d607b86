"""hold beside PyPI's supervisord, in one fresh virtual environment, in either order.

supervisord's distribution (``supervisor``) installs a top-level package named
``supervisor``; ours installs its folder ``supervisor/`` as ``hold_supervisor``
(pyproject's ``package-dir``), so the two share no file. Installed into one
venv, both orders, every console script of both keeps working, and
uninstalling either leaves the other whole. Real wheels, real pip, real
console scripts; the index (or pip's cache) is needed once, to build the wheels.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import stop_daemon

# Real pip, seven times a test: about 8 s of CPU each, which a machine running two
# busy loops and four suites stretched past 110 s. Every step below has its own
# deadline; this one only replaces the suite's safety net (pyproject's timeout).
pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parent.parent
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This project's wheel, every dependency's, and supervisord's, in one folder."""
    out = tmp_path_factory.mktemp("wheels")
    for what in ([str(ROOT)], ["supervisor"]):
        r = subprocess.run(
            [*PIP, "wheel", "-q", "-w", str(out), *what],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if r.returncode != 0 and "Could not find a version" in r.stderr + r.stdout:
            pytest.skip(f"no package index reachable to build {what[0]}'s wheel")
        assert r.returncode == 0, r.stderr
    return out


def _venv(where: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    return where


def _pip(venv: Path, wheels: Path, *args: str) -> None:
    """This interpreter's pip, acting on ``venv`` (pip's ``--python``), offline."""
    opts = (
        ["--no-index", "--find-links", str(wheels), "--no-compile"]
        if args[0] == "install"
        else ["-y"]
    )
    r = subprocess.run(
        [*PIP, "--python", str(venv / "bin" / "python"), *args, "-q", *opts],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr


def _run(venv: Path, work: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "HOME": str(work),
        "HOLD_STATE_DIR": str(work / "state"),
        "HOLD_CONFIG": str(work / "config.yaml"),
        "HOLD_LOCK_DIR": str(work / "locks"),
    }
    return subprocess.run(
        [str(venv / "bin" / argv[0]), *argv[1:]],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=work,
    )


def _hold_works(venv: Path, work: Path) -> None:
    for script in ("hold", "npu-hold", "gpu-hold"):
        r = _run(venv, work, script, "--help")
        assert r.returncode == 0 and "Usage:" in r.stdout, (script, r.stderr)
    r = _run(venv, work, "hold", "run", "--", "sh", "-c", "echo inside")
    assert (r.returncode, r.stdout) == (0, "inside\n"), r.stderr


def _supervisord_works(venv: Path, work: Path) -> None:
    r = _run(venv, work, "supervisord", "--version")
    assert r.returncode == 0 and r.stdout.strip()[:1].isdigit(), r.stderr
    r = _run(venv, work, "supervisorctl", "help")
    assert r.returncode == 0 and "default commands" in r.stdout, r.stderr + r.stdout


def _files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return {n for n in z.namelist() if ".dist-info/" not in n}


def test_the_wheels_share_no_file(wheels: Path) -> None:
    (ours,) = wheels.glob("hold-*.whl")
    (theirs,) = wheels.glob("supervisor-*.whl")
    mine, others = _files(ours), _files(theirs)
    assert any(n.startswith("hold_supervisor/proc/") for n in mine)
    assert any(n.startswith("supervisor/") for n in others)
    assert not mine & others
    assert not any(n.startswith("supervisor/") for n in mine)


@pytest.mark.parametrize("first", ["hold", "supervisor"])
def test_either_order_both_work_and_either_uninstalls_alone(
    wheels: Path, tmp_path: Path, first: str
) -> None:
    (ours,) = wheels.glob("hold-*.whl")
    wheel = {"hold": str(ours), "supervisor": "supervisor"}
    second = "supervisor" if first == "hold" else "hold"
    venv = _venv(tmp_path / "venv")
    work = tmp_path / "work"
    (work / "locks").mkdir(parents=True, mode=0o1777)
    (work / "config.yaml").write_text("{}\n")  # the built-in device classes
    try:
        _pip(venv, wheels, "install", wheel[first])
        _pip(venv, wheels, "install", wheel[second])
        _hold_works(venv, work)
        _supervisord_works(venv, work)

        _pip(venv, wheels, "uninstall", first)
        (_supervisord_works if first == "hold" else _hold_works)(venv, work)
        _pip(venv, wheels, "install", wheel[first])
        _pip(venv, wheels, "uninstall", second)
        (_hold_works if first == "hold" else _supervisord_works)(venv, work)
        assert not os.path.exists(
            venv / "bin" / ("supervisord" if second == "supervisor" else "hold")
        )
    finally:
        stop_daemon(work / "state")  # hold run's, autostarted
