"""``~/NPU-TOKEN`` by default: a guard written the seed's way passes inside a ticket
and fails outside (issue 23, item 2).

The guard (``progs/seed_guard.sh``, ``progs/seed_guard.py``) reads the first
line of ``~/NPU-TOKEN``, takes the pid after ``pid`` and walks its own parents
in ``/proc``. Every test here runs it inside ``npu-hold`` (or ``hold run``),
outside (from the test, while the lease is live), and after the lease.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    HOLD,
    PROGS,
    _ensure_user,
    as_user,
    unpriv_python,
    update_config,
    wait_for,
    write_config,
)

NPU_HOLD = str(Path(sys.executable).parent / "npu-hold")
DATE = r"\w{3} \w{3} \d{2} \d{2}:\d{2}:\d{2} \S+ \d{4}"
GUARDS = {
    "sh": ["sh", str(PROGS / "seed_guard.sh")],
    "python": [sys.executable, str(PROGS / "seed_guard.py")],
}
# A label that, written as it is, would hand a reader of the line pid 1.
FORGING = "run pid 1 of 3"


def wait_text(path: Path, timeout: float = 20.0) -> str:
    return wait_for(
        lambda: path.read_text().strip() if path.exists() and path.read_text() else "",
        timeout,
        what=str(path),
    )


def script(guard: list[str], work: Path, *steps: str, cls: str = "NPU") -> str:
    """A shell command: for each step, run the guard (for ``~/CLS-TOKEN``), write
    its status to ``work/STEP``, then wait for ``work/STEP.go``."""
    g = " ".join(guard)
    return "; ".join(
        f"{g} {cls}; echo $? > {work}/{step}; while [ ! -e {work}/{step}.go ]; do sleep 0.02; done"
        for step in steps
    )


def outside(guard: list[str], cls: str = "NPU", **env: str) -> int:
    return subprocess.run([*guard, cls], env={**os.environ, **env}, timeout=30).returncode


@pytest.mark.parametrize("kind", sorted(GUARDS))
def test_seed_guard_passes_inside_npu_hold_and_fails_outside(tmp_path: Path, kind: str) -> None:
    guard = GUARDS[kind]
    home = Path(os.environ["HOME"])
    token = home / "NPU-TOKEN"
    work = tmp_path / "work"
    work.mkdir()
    assert outside(guard) == 1  # no token at all
    p = subprocess.Popen(
        [NPU_HOLD, "-l", FORGING, "--", "sh", "-c", script(guard, work, "inside")],
        stdin=subprocess.DEVNULL,
    )
    try:
        assert wait_text(work / "inside") == "0"
        first = token.read_text().split("\n")[0]
        # The seed's one line; the label one word that cannot forge "pid".
        assert re.fullmatch(rf"npu-hold run%20pid%201%20of%203 pid {p.pid} {DATE}", first), first
        st = token.lstat()
        assert st.st_uid == os.getuid() and st.st_mode & 0o777 == 0o644
        assert outside(guard) == 1  # the holder is no ancestor of the test
    finally:
        (work / "inside.go").touch()
        assert p.wait(30) == 0
    assert not token.exists()  # removed when the lease ended
    assert outside(guard) == 1


def test_the_switch_turns_it_off_and_leaves_the_users_file(tmp_path: Path) -> None:
    update_config(tmp_path, compat={"home_tokens": False})
    token = Path(os.environ["HOME"]) / "NPU-TOKEN"
    token.write_text("mine\n")
    work = tmp_path / "work"
    work.mkdir()
    cmd = script(GUARDS["sh"], work, "inside")
    p = subprocess.Popen([NPU_HOLD, "--", "sh", "-c", cmd], stdin=subprocess.DEVNULL)
    try:
        assert wait_text(work / "inside") == "1"
        assert token.read_text() == "mine\n"
    finally:
        (work / "inside.go").touch()
        assert p.wait(30) == 0
    assert token.read_text() == "mine\n"


def test_two_leases_of_one_user_newest_line_first(tmp_path: Path) -> None:
    """The rule: one line per live lease, the newest first; when it ends, the
    other's line is first again; the file goes with the last lease."""
    for i in (0, 1):
        (tmp_path / f"duo{i}").write_text("")
    update_config(tmp_path, devices={"duo": {"nodes": [f"{tmp_path}/duo*"]}})
    token = Path(os.environ["HOME"]) / "DUO-TOKEN"
    work = tmp_path / "work"
    work.mkdir()
    guard = GUARDS["python"]
    hold_run = [*HOLD, "run", "--device", "duo"]
    a = subprocess.Popen(
        [*hold_run, "-l", "A", "--", "sh", "-c", script(guard, work, "a1", "a2", "a3", cls="DUO")],
        stdin=subprocess.DEVNULL,
    )
    b: subprocess.Popen[bytes] | None = None
    try:
        assert wait_text(work / "a1") == "0"
        assert token.read_text().splitlines()[0].split()[:4] == ["duo-hold", "A", "pid", str(a.pid)]
        b = subprocess.Popen(
            [*hold_run, "-l", "B", "--", "sh", "-c", script(guard, work, "b1", cls="DUO")],
            stdin=subprocess.DEVNULL,
        )
        assert wait_text(work / "b1") == "0"  # a guard at its command's start passes
        lines = token.read_text().splitlines()
        assert [ln.split()[:4] for ln in lines] == [
            ["duo-hold", "B", "pid", str(b.pid)],
            ["duo-hold", "A", "pid", str(a.pid)],
        ], lines
        # A guard of the older lease that checks again while the newer one
        # lives fails: closed, never open (the README says so).
        (work / "a1.go").touch()
        assert wait_text(work / "a2") == "1"
        (work / "b1.go").touch()
        assert b.wait(30) == 0
        assert [ln.split()[3] for ln in token.read_text().splitlines()] == [str(a.pid)]
        (work / "a2.go").touch()
        assert wait_text(work / "a3") == "0"  # A's line is first again
    finally:
        for step in ("a1", "a2", "a3", "b1"):
            (work / f"{step}.go").touch()
        assert a.wait(30) == 0
        if b is not None:
            b.wait(30)
    assert not token.exists()


# --------------------------------------------------------------------------
# Unprivileged users: their own daemon, and the system daemon (root) writing
# in their home.


def _open_up(tmp_path: Path) -> None:
    for p in [tmp_path, *tmp_path.parents]:
        if p == Path("/"):
            break
        os.chmod(p, os.stat(p).st_mode | 0o055)


@pytest.mark.parametrize("kind", sorted(GUARDS))
def test_unprivileged_per_user_daemon_writes_the_users_home(
    tmp_path: Path, unpriv_user: str, unpriv_runtime: Path, kind: str
) -> None:
    pw = pwd.getpwnam(unpriv_user)
    _open_up(tmp_path)
    state = Path(os.environ["HOLD_STATE_DIR"])
    state.mkdir(mode=0o700)
    os.chown(state, pw.pw_uid, pw.pw_gid)
    # The user's HOME: a directory of theirs (their own /home is shared by
    # every run of the suite on this machine; this one is the test's).
    home = tmp_path / "uhome"
    home.mkdir(mode=0o700)
    os.chown(home, pw.pw_uid, pw.pw_gid)
    work = tmp_path / "shared"
    work.mkdir()
    work.chmod(0o777)
    if os.path.exists("/etc/hold/config.yaml"):
        pytest.skip("/etc/hold/config.yaml exists: not the embedded defaults")
    py = unpriv_python()
    guard = (
        ["sh", str(unpriv_runtime / "progs" / "seed_guard.sh")]
        if kind == "sh"
        else [py, str(unpriv_runtime / "progs" / "seed_guard.py")]
    )
    # The defaults (no HOLD_CONFIG, an empty XDG_CONFIG_HOME): home tokens on.
    env = {
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(work / "xdg"),
        "HOLD_STATE_DIR": str(state),
        "HOLD_LOCK_DIR": os.environ["HOLD_LOCK_DIR"],
    }
    argv = [py, "-m", "hold", "run", "--device", "npu", "-l", FORGING, "--", "sh", "-c"]
    p = subprocess.Popen(
        as_user(unpriv_user, [*argv, script(guard, work, "inside")], unpriv_runtime, env),
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    token = home / "NPU-TOKEN"
    try:
        assert wait_text(work / "inside") == "0", p.stderr
        st = token.lstat()
        assert (st.st_uid, st.st_gid) == (pw.pw_uid, pw.pw_gid)
        first = token.read_text().split("\n")[0]
        assert first.split()[:3] == ["npu-hold", "run%20pid%201%20of%203", "pid"], first
        # Outside, as the same user with the same HOME: refused.
        res = subprocess.run(as_user(unpriv_user, guard, unpriv_runtime, env), timeout=30)
        assert res.returncode == 1
    finally:
        (work / "inside.go").touch()
        _, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert not token.exists()


@contextlib.contextmanager
def _suite_lock(name: str) -> Iterator[None]:
    """One test at a time, machine-wide, over a real home that several runs of
    this suite on one machine would share."""
    with open(f"/tmp/hold-test-{name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def test_system_daemon_writes_the_holders_home_as_theirs_never_through_a_link(
    unpriv_runtime: Path,
) -> None:
    user = _ensure_user("holdtoken")  # a home only this test writes in
    pw = pwd.getpwnam(user)
    home = Path(pw.pw_dir)
    token = home / "NPU-TOKEN"
    base = Path(tempfile.mkdtemp(prefix="hold-hometok-", dir="/tmp"))
    daemon: subprocess.Popen[bytes] | None = None
    with _suite_lock(user):
        try:
            base.chmod(0o755)
            state, config, work = base / "state", base / "config.yaml", base / "work"
            state.mkdir()
            state.chmod(0o755)
            work.mkdir()
            work.chmod(0o777)
            (base / "locks").mkdir()
            (base / "locks").chmod(0o1777)
            write_config(base, state={"shared": True})
            config.chmod(0o644)
            env = {
                "HOLD_STATE_DIR": str(state),
                "HOLD_CONFIG": str(config),
                "HOLD_LOCK_DIR": str(base / "locks"),
            }
            daemon = subprocess.Popen([*HOLD, "daemon"], env={**os.environ, **env})
            wait_for(lambda: (state / "daemon.sock").exists(), 20, what="the system daemon")
            shutil.copy(PROGS / "seed_guard.sh", work / "guard.sh")
            guard = ["sh", str(work / "guard.sh")]

            def lease(step: str) -> subprocess.Popen[str]:
                argv = [unpriv_python(), "-m", "hold", "run", "--device", "npu", "--"]
                cmd = [*argv, "sh", "-c", script(guard, work, step)]
                return subprocess.Popen(
                    as_user(user, cmd, unpriv_runtime, env),  # HOME: the user's own
                    stdin=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )

            token.unlink(missing_ok=True)
            p = lease("inside")
            try:
                assert wait_text(work / "inside") == "0", p.stderr
                st = token.lstat()
                # Written by root, but the user's file.
                assert (st.st_uid, st.st_gid) == (pw.pw_uid, pw.pw_gid)
                assert st.st_mode & 0o777 == 0o644
                assert token.read_text().split()[3] == str(p.pid)
            finally:
                (work / "inside.go").touch()
                _, err = p.communicate(timeout=30)
            assert p.returncode == 0, err
            assert not token.exists()

            # A symlink the user planted at ~/NPU-TOKEN: never written through.
            victim = base / "victim"
            victim.write_text("root's\n")
            subprocess.run(
                as_user(user, ["ln", "-s", str(victim), str(token)], unpriv_runtime, {}),
                check=True,
            )
            p = lease("linked")
            try:
                assert wait_text(work / "linked") == "1", p.stderr
            finally:
                (work / "linked.go").touch()
                _, err = p.communicate(timeout=30)
            assert p.returncode == 0, err
            assert token.is_symlink() and victim.read_text() == "root's\n"
            assert victim.stat().st_uid == 0
            log = (state / "daemon.log").read_text()
            assert "home_token_failed" in log and f"{token} is a symlink" in log, log
        finally:
            token.unlink(missing_ok=True)
            if daemon is not None and daemon.poll() is None:
                daemon.terminate()
                daemon.wait(15)
            shutil.rmtree(base, ignore_errors=True)
