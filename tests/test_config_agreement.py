"""A client and its daemon read one configuration: replaced when idle, named
when busy, re-read on ``hold daemon --reload`` / SIGHUP (refused while a class
it would drop has live leases), and a broken file is an error with file:line
for every command, before anything starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from conftest import HOLD, PROGS, alive, daemon_pid, wait_for

GATED = str(PROGS / "gated.py")


def nodes(base: Path, name: str, count: int = 1) -> str:
    d = base / f"{name}-nodes"
    d.mkdir(exist_ok=True)
    for i in range(count):
        (d / f"{name}{i}").write_text("")
    return f'  {name}: {{nodes: ["{d}/{name}*"]}}\n'


def write(path: Path, *classes: str) -> Path:
    path.write_text("devices:\n" + "".join(classes))
    return path


def hold(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*HOLD, *args],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        env=env,
    )


def test_an_idle_daemon_with_another_configuration_is_replaced(tmp_path: Path) -> None:
    state = Path(os.environ["HOLD_STATE_DIR"])
    first = write(tmp_path / "a.yaml", nodes(tmp_path, "alpha"))
    env = {**os.environ, "HOLD_CONFIG": str(first)}
    assert hold("run", "-d", "alpha", "--", "true", env=env).returncode == 0
    old = daemon_pid(state)
    assert old is not None
    second = write(tmp_path / "b.yaml", nodes(tmp_path, "beta"))
    env["HOLD_CONFIG"] = str(second)
    res = hold("run", "-d", "beta", "--", "true", env=env)
    assert res.returncode == 0, res.stderr
    new = daemon_pid(state)
    assert new is not None and new != old and not alive(old)
    assert f'"config": "{second}"' in (state / "daemon.log").read_text()


def test_a_busy_daemon_with_another_configuration_is_named(tmp_path: Path) -> None:
    state = Path(os.environ["HOLD_STATE_DIR"])
    first = write(tmp_path / "a.yaml", nodes(tmp_path, "alpha"))
    env = {**os.environ, "HOLD_CONFIG": str(first)}
    work = tmp_path / "work"
    work.mkdir()
    holder = subprocess.Popen(
        [
            *HOLD,
            "run",
            "-d",
            "alpha",
            "-l",
            "A",
            "--",
            sys.executable,
            GATED,
            str(work),
            "A",
            "--wait",
        ],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: (work / "A.ready").exists(), 20, what="the holder")
        pid = daemon_pid(state)
        second = write(tmp_path / "b.yaml", nodes(tmp_path, "beta"))
        res = hold(
            "run", "-d", "beta", "--", "true", env={**os.environ, "HOLD_CONFIG": str(second)}
        )
        assert res.returncode == 2, res.stderr
        assert f"(pid {pid}) reads another configuration ({first}; this command reads" in (
            res.stderr
        )
        assert "alpha lease" in res.stderr and "cannot be replaced" in res.stderr
        assert daemon_pid(state) == pid and holder.poll() is None
    finally:
        (work / "A.go").write_text("")
        assert holder.wait(30) == 0


def test_reload_adds_a_class_and_refuses_to_drop_one_with_a_live_lease(tmp_path: Path) -> None:
    state = Path(os.environ["HOLD_STATE_DIR"])
    config = Path(os.environ["HOLD_CONFIG"])
    alpha = nodes(tmp_path, "alpha")
    write(config, alpha)
    work = tmp_path / "work"
    work.mkdir()
    holder = subprocess.Popen(
        [
            *HOLD,
            "run",
            "-d",
            "alpha",
            "-l",
            "A",
            "--",
            sys.executable,
            GATED,
            str(work),
            "A",
            "--wait",
        ],
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: (work / "A.ready").exists(), 20, what="the holder")
        pid = daemon_pid(state)
        assert pid is not None
        # Adding a class: re-read, the lease untouched.
        write(config, alpha, nodes(tmp_path, "beta", 2))
        res = hold("daemon", "--reload")
        assert res.returncode == 0, res.stderr
        assert "beta (2)" in res.stdout and "alpha (1)" in res.stdout
        assert hold("run", "-d", "beta:1", "--no-wait", "--", "true").returncode == 0
        # Dropping the leased class: refused, nothing changed.
        write(config, nodes(tmp_path, "beta", 2))
        res = hold("daemon", "--reload")
        assert res.returncode == 2, res.stderr
        assert "class alpha has live leases" in res.stderr
        # SIGHUP is the same (systemctl reload): refused, and logged.
        os.kill(pid, signal.SIGHUP)
        log = state / "daemon.log"
        wait_for(lambda: log.read_text().count("reload_refused") >= 2, 10, what="the refusal")
        assert daemon_pid(state) == pid and holder.poll() is None
        assert "alpha" in hold("status").stdout
    finally:
        (work / "A.go").write_text("")
        assert holder.wait(30) == 0
    # Once the lease is over, the same file is accepted.
    res = hold("daemon", "--reload")
    assert res.returncode == 0, res.stderr
    assert "alpha" not in res.stdout


def test_a_broken_configuration_is_an_error_with_file_and_line_everywhere(tmp_path: Path) -> None:
    config = Path(os.environ["HOLD_CONFIG"])
    config.write_text("devices:\n  npu:\n    nodes: [/dev/x]\n    node: [/dev/y]\n")
    ran = tmp_path / "ran"
    touch = ("--", "touch", str(ran))
    for args in (
        ("status",),
        ("run", *touch),
        ("check",),
        ("run", "-d", "npu", *touch),
        ("daemon", "--reload"),
    ):
        res = hold(*args)
        assert res.returncode == 2, (args, res.stderr)
        assert f"{config}:4" in res.stderr and "node" in res.stderr, (args, res.stderr)
        assert "Traceback" not in res.stderr
    assert not ran.exists()
    assert daemon_pid(Path(os.environ["HOLD_STATE_DIR"])) is None
