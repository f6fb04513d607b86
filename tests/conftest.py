"""Shared fixtures: an isolated state directory and configuration per test, real
unprivileged users, and the leak check that fails any test leaving a process.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from supervisor import procscan

ROOT = Path(__file__).resolve().parent.parent
PROGS = Path(__file__).resolve().parent / "progs"
HOLD = [sys.executable, "-m", "hold"]
T = TypeVar("T")


# --------------------------------------------------------------------------
# Isolation: every test gets its own HOLD_STATE_DIR and HOLD_CONFIG.


@pytest.fixture(autouse=True)
def isolated_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_process_left_behind: None
) -> Iterator[Path]:
    """Own state directory and configuration; afterwards, stop the test's daemon.

    Depends on the leak check so that it is torn down *before* it: a daemon
    the test started (clients autostart one) is stopped here, by its own
    SIGTERM path, and anything else still running is the test's leak.
    """
    state = tmp_path / "state"
    config = tmp_path / "config.yaml"
    config.write_text("cgroups: auto\n")
    monkeypatch.setenv("HOLD_STATE_DIR", str(state))
    monkeypatch.setenv("HOLD_CONFIG", str(config))
    yield tmp_path
    stop_daemon(state)


def daemon_pid(state: Path) -> int | None:
    """The pid of the live daemon serving ``state``, if any (from its lock file)."""
    try:
        text = (state / "daemon.lock").read_text().strip()
    except OSError:
        return None
    if not text.isdigit() or not alive(int(text)):
        return None
    return int(text)


def stop_daemon(state: Path, timeout: float = 5.0) -> None:
    pid = daemon_pid(state)
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    if alive(pid):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(params=["cgroup", "walk"])
def cgroup_mode(request: pytest.FixtureRequest, isolated_hold: Path) -> str:
    """Run the test once with cgroup leaves and once with the /proc walk."""
    mode: str = request.param
    if mode == "cgroup":
        from supervisor.cgroup import CgroupUnavailable, Hierarchy

        try:
            Hierarchy.find()
        except CgroupUnavailable as e:
            pytest.skip(f"no writable cgroup v2 here: {e}")
        (isolated_hold / "config.yaml").write_text("cgroups: required\n")
    else:
        (isolated_hold / "config.yaml").write_text("cgroups: off\n")
    return mode


# --------------------------------------------------------------------------
# The leak check.
#
# pytest makes itself a child subreaper, so every process a test starts stays
# its descendant however it detaches (setsid, double fork): orphans are
# re-parented to the nearest subreaper above them, never past pytest to init.
# "Left behind" is then exactly "a live descendant of pytest after the test",
# and tests running in parallel elsewhere on the machine are never mistaken
# for leaks (or killed).


def pytest_configure(config: pytest.Config) -> None:
    from supervisor.reaper import become_subreaper

    become_subreaper()


def _live_descendants() -> list[procscan.Stat]:
    procs = procscan.snapshot()
    return [
        procs[pid] for pid in procscan.descendants([os.getpid()], procs) if not procs[pid].is_dead
    ]


def _reap_adopted_zombies() -> None:
    me = os.getpid()
    for st in procscan.snapshot().values():
        if st.ppid == me and st.is_dead:
            try:
                os.waitpid(st.pid, os.WNOHANG)
            except ChildProcessError:
                pass


def _leaves() -> set[str]:
    """The cgroup leaves this project makes (``hold-*``) under our own cgroup."""
    from supervisor.cgroup import CgroupUnavailable, Hierarchy

    try:
        base = Hierarchy.find().base
    except CgroupUnavailable:
        return set()
    return {e.path for e in os.scandir(base) if e.name.startswith("hold-") and e.is_dir()}


@pytest.fixture(autouse=True)
def no_process_left_behind() -> Iterator[None]:
    before = {(st.pid, st.starttime) for st in _live_descendants()}
    leaves_before = _leaves()
    yield
    _check_processes(before)
    # A leaf left behind is a tree whose end nobody cleaned up.
    deadline = time.monotonic() + 2.0
    left = _leaves() - leaves_before
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = _leaves() - leaves_before
    for path in left:
        try:
            os.rmdir(path)
        except OSError:
            pass
    if left:
        pytest.fail(f"test left {len(left)} cgroup leaf(s) behind: {sorted(left)}")


def _check_processes(before: set[tuple[int, int]]) -> None:
    deadline = time.monotonic() + 2.0
    while True:
        _reap_adopted_zombies()
        leaked = [st for st in _live_descendants() if (st.pid, st.starttime) not in before]
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if leaked:
        desc = "; ".join(f"{st.pid} {procscan_cmd(st.pid)}" for st in leaked)
        for st in leaked:
            try:
                os.kill(st.pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.1)
        _reap_adopted_zombies()
        pytest.fail(f"test left {len(leaked)} process(es) behind: {desc}")


def procscan_cmd(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return "?"


# --------------------------------------------------------------------------
# Helpers for real commands.


def hold_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    return env


def wait_for(
    predicate: Callable[[], T], timeout: float = 5.0, interval: float = 0.01, what: str = "it"
) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def alive(pid: int) -> bool:
    st = procscan.stat_of(pid)
    return st is not None and not st.is_dead


# --------------------------------------------------------------------------
# Unprivileged users: a real account, and a copy of this package and its
# dependencies that the account may read (the checkout and the venv may sit
# under /root, which other users cannot enter).


def _ensure_user(name: str) -> str:
    try:
        pwd.getpwnam(name)
    except KeyError:
        res = subprocess.run(
            ["useradd", "--create-home", "--shell", "/bin/sh", name], capture_output=True
        )
        if res.returncode not in (0, 9):  # 9: created meanwhile by another run
            raise RuntimeError(f"useradd {name}: {res.stderr.decode()}") from None
    return name


@pytest.fixture(scope="session")
def unpriv_user() -> str:
    if os.geteuid() != 0:
        pytest.skip("creating a user needs root")
    return _ensure_user("holdtest")


@pytest.fixture(scope="session")
def other_user() -> str:
    """A second unprivileged account, for "another user's lease/process"."""
    if os.geteuid() != 0:
        pytest.skip("creating a user needs root")
    return _ensure_user("holdtest2")


@pytest.fixture(scope="session")
def unpriv_runtime(tmp_path_factory: pytest.TempPathFactory, unpriv_user: str) -> Path:
    """A world-readable directory holding ``hold``, ``supervisor`` and their dependencies."""
    base = tmp_path_factory.mktemp("unpriv-runtime")
    site = Path(sysconfig.get_paths()["purelib"])
    for pkg in ("hold", "supervisor"):
        shutil.copytree(ROOT / pkg, base / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for pkg in ("psutil", "yaml", "_yaml", "click", "filelock", "structlog"):
        src = site / pkg
        if src.is_dir():
            shutil.copytree(src, base / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(PROGS, base / "progs")
    for p in [base, *base.parents]:
        if p == Path("/"):
            break
        os.chmod(p, os.stat(p).st_mode | 0o055)
    subprocess.run(["chmod", "-R", "a+rX", str(base)], check=True)
    return base


def unpriv_python() -> str:
    """A Python the unprivileged user may execute: ours if reachable, else the system's."""
    for cand in (sys.executable, "/usr/bin/python3"):
        real = os.path.realpath(cand)
        # Checked the way as_user() runs it (through env -i), not by a direct exec.
        ok = subprocess.run(
            ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
             "env", "-i", real, "-c", "pass"],
            capture_output=True,
        )  # fmt: skip
        if ok.returncode == 0:
            return real
    pytest.skip("no Python interpreter here that an unprivileged user may run")


def as_user(user: str, argv: list[str], runtime: Path, env: dict[str, str]) -> list[str]:
    """The command line that runs ``argv`` as ``user`` with the copied runtime on sys.path."""
    pw = pwd.getpwnam(user)
    full = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": pw.pw_dir,
        "USER": user,
        "PYTHONPATH": str(runtime),
        "PYTHONDONTWRITEBYTECODE": "1",
        **env,
    }
    return [
        "setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--init-groups",
        "env", "-i", *[f"{k}={v}" for k, v in full.items()], *argv,
    ]  # fmt: skip
