"""A user's delegated cgroup subtree, and what the walk cannot do without one (issue 10).

``hold run`` in walk mode lost a descendant that called ``setsid``, double-forked
and cleared ``HOLD_TREE`` when ``hold run`` itself was SIGKILLed: nothing a walk
of /proc can follow is left (no session, group, parent or marker), and the
daemon logged "survivors: []" while it ran on. Where the system gives the user
a delegated cgroup subtree (systemd's ``user@UID.service``, ``Delegate=yes``)
``hold run`` uses it, and a leaf cannot be left. These tests delegate a subtree
to a test user as systemd does (the directory and its ``cgroup.procs``,
``cgroup.subtree_control`` and ``cgroup.threads`` chowned), move a shell of that
user into it as root, and let the shell exec ``hold run``. Where no cgroup can
be had, ``hold run -v`` says once that the walk has this limit.

The subtree is made in the test's own cgroup (conftest) and removed by the
test; every process is ended by pid, and the leak check proves it.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import HOLD, alive, as_user, exec_done, stop_daemon, unpriv_python, wait_for

from hold_supervisor.proc.cgroup import CgroupUnavailable, Hierarchy, Leaf, own_cgroup, v2_mount

DELEGATED_FILES = ("cgroup.procs", "cgroup.subtree_control", "cgroup.threads")


def _open_to_others(path: Path) -> None:
    for p in [path, *path.parents]:
        if p == Path("/"):
            break
        os.chmod(p, os.stat(p).st_mode | 0o055)


class Delegation:
    """A cgroup subtree delegated to ``user`` under the test's cgroup; removed at the end."""

    def __init__(self, base: str, user: str) -> None:
        pw = pwd.getpwnam(user)
        self.base = base
        self.path = f"{base}/holdtest-deleg-{uuid.uuid4().hex[:10]}"
        os.mkdir(self.path)
        for target in [self.path, *(f"{self.path}/{f}" for f in DELEGATED_FILES)]:
            if os.path.exists(target):
                os.chown(target, pw.pw_uid, pw.pw_gid)

    def inner(self) -> str:
        """A cgroup below the delegation that stays root's (not delegated itself)."""
        path = f"{self.path}/inner"
        os.mkdir(path)
        return path

    def remove(self) -> None:
        # Only this test's processes can be in it: the user's shell and what it ran.
        top = Leaf(self.path)
        top.kill()
        if not top.wait_empty(5.0):
            raise AssertionError(f"{self.path} still populated")
        top.remove(self.base)
        assert not os.path.exists(self.path), f"{self.path} was not removed"


@pytest.fixture
def delegation(unpriv_user: str) -> Iterator[Delegation]:
    try:
        base = Hierarchy.find().base
    except CgroupUnavailable as e:
        pytest.skip(f"no writable cgroup v2 here: {e}")
    try:
        d = Delegation(base, unpriv_user)
    except OSError as e:
        pytest.skip(f"cannot make a cgroup to delegate here: {e}")
    try:
        yield d
    finally:
        d.remove()


def _shared(tmp_path: Path, user: str) -> Path:
    """A work directory ``user`` may write, and the test's state directory handed to it."""
    _open_to_others(tmp_path)
    pw = pwd.getpwnam(user)
    state = Path(os.environ["HOLD_STATE_DIR"])
    state.mkdir(mode=0o700)
    os.chown(state, pw.pw_uid, pw.pw_gid)
    work = tmp_path / "work"
    work.mkdir()
    work.chmod(0o777)
    return work


def _pids(work: Path) -> dict[str, int]:
    try:
        text = (work / "pids").read_text()
    except FileNotFoundError:
        return {}
    return {role: int(pid) for role, pid in (line.split() for line in text.splitlines())}


def _cgroup_of(pid: int) -> str:
    mount, rel = v2_mount(), own_cgroup(pid)
    assert mount is not None and rel is not None
    return os.path.normpath(mount + rel)


def _events(state: Path) -> list[dict[str, Any]]:
    lines = (state / "daemon.log").read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def _user_python(user: str, runtime: Path) -> str:
    for cand in (unpriv_python(), "/usr/bin/python3"):
        ok = subprocess.run(
            as_user(user, [cand, "-c", "import hold.cli.run"], runtime, {}),
            capture_output=True,
            timeout=30,
        )
        if ok.returncode == 0:
            return cand
    pytest.skip(f"no Python here that {user} may run with the copied runtime")


@pytest.mark.parametrize("where", ["own", "below"])
def test_sigkilled_hold_run_in_a_delegated_subtree_leaves_no_vanished_descendant(
    tmp_path: Path, unpriv_user: str, unpriv_runtime: Path, delegation: Delegation, where: str
) -> None:
    """The user's ``hold run`` lives in a delegated cgroup (``own``: in the
    delegated directory itself; ``below``: in a cgroup below it that is not
    the user's, so the leaf goes to the nearest writable ancestor). Its
    command's descendant vanishes from every walk (setsid, double fork, an
    empty environment); ``hold run`` is SIGKILLed; the daemon (the user's own,
    autostarted) stops the leaf, and the descendant with it."""
    work = _shared(tmp_path, unpriv_user)
    py = _user_python(unpriv_user, unpriv_runtime)
    config = work / "config.yaml"
    config.write_text("cgroups: required\n")  # no walk to fall back on: a leaf, or exit 2
    config.chmod(0o644)
    fifo = work / "go"
    os.mkfifo(fifo, 0o644)
    prog = str(unpriv_runtime / "progs" / "vanishing_tree.py")
    hold_run = [py, "-m", "hold", "run", "-v", "--grace", "0.5s", "--", py, prog, str(work)]
    argv = ["sh", "-c", 'read go < "$0"; exec "$@"', str(fifo), *hold_run]
    env = {"HOLD_CONFIG": str(config), "HOLD_STATE_DIR": os.environ["HOLD_STATE_DIR"]}
    state = Path(os.environ["HOLD_STATE_DIR"])
    home = delegation.path if where == "own" else delegation.inner()
    errfile = tmp_path / "stderr"
    with open(errfile, "w") as errf:
        # Output to a file: the escapee keeps hold run's stderr open.
        proc = subprocess.Popen(
            as_user(unpriv_user, argv, unpriv_runtime, env),
            stdin=subprocess.DEVNULL,
            stdout=errf,
            stderr=errf,
            cwd=work,
        )
    escapee: int | None = None
    try:
        # As systemd does for a user's service: root puts the process in place.
        with open(f"{home}/cgroup.procs", "w") as f:
            f.write(str(proc.pid))
        with open(fifo, "w") as f:
            f.write("go\n")

        def started() -> dict[str, int]:
            if proc.poll() is not None:
                raise AssertionError(f"hold run ended ({proc.returncode}): {errfile.read_text()}")
            roles = _pids(work)
            return roles if {"main", "escapee"} <= roles.keys() else {}

        roles = wait_for(started, 20, 0.02, "the command's tree")
        escapee = roles["escapee"]
        err = errfile.read_text()
        assert "no cgroup for this command" not in err, err
        # The escapee really vanished from every walk (once its exec is done:
        # it writes its pid down before, and read at once it may still be python)...
        wait_for(lambda: exec_done(escapee), 20, 0.02, "the escapee's exec of sleep")
        with open(f"/proc/{escapee}/environ", "rb") as f:
            assert f.read() == b""
        with open(f"/proc/{escapee}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        ppid, session = int(fields[1]), int(fields[3])
        assert ppid != roles["main"] and session not in (roles["main"], proc.pid)
        # ... and sits in a leaf of the delegation, made by the user's hold run
        # (which itself stayed where root put it).
        assert _cgroup_of(proc.pid) == home
        leaf = _cgroup_of(escapee)
        assert os.path.dirname(leaf) == delegation.path, (leaf, delegation.path)
        assert re.fullmatch(r"hold-[0-9a-f]+\.\d+\.\d+", os.path.basename(leaf)), leaf
        assert os.stat(leaf).st_uid == pwd.getpwnam(unpriv_user).pw_uid

        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

        pid = escapee
        wait_for(lambda: not alive(pid), 15, 0.02, f"the escapee {pid} to be stopped by the daemon")
        wait_for(lambda: not alive(roles["main"]), 5, 0.02, "the command to be stopped")
        # The daemon stopped the tree (both processes, through the leaf) and
        # removed the leaf.
        stops = wait_for(
            lambda: [e for e in _events(state) if e["event"] == "tree_stopped"],
            10,
            0.02,
            "the daemon's report of the stop",
        )
        (stop,) = stops
        assert stop["survivors"] == [] and stop["stopped"] == 2, stop
        wait_for(lambda: not os.path.exists(leaf), 20, 0.02, f"{leaf} to be removed")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        stop_daemon(state)
        if escapee is not None and alive(escapee):
            with contextlib.suppress(OSError):
                os.kill(escapee, signal.SIGKILL)


# --------------------------------------------------------------------------
# Without a cgroup: the limit, said once at -v.

NOTE = "no cgroup for this command"


def test_without_a_cgroup_hold_run_v_says_once_what_the_walk_cannot_follow(
    tmp_path: Path, unpriv_user: str, unpriv_runtime: Path
) -> None:
    """An ordinary user outside every delegation (the test's cgroup is root's):
    the default ``cgroups: auto`` walks, and ``-v`` says so once, with why."""
    work = _shared(tmp_path, unpriv_user)
    py = _user_python(unpriv_user, unpriv_runtime)
    env = {"XDG_CONFIG_HOME": str(work / "xdg"), "HOLD_STATE_DIR": os.environ["HOLD_STATE_DIR"]}
    if os.path.exists("/etc/hold/config.yaml"):
        pytest.skip("/etc/hold/config.yaml exists: not the embedded defaults")
    res = subprocess.run(
        as_user(unpriv_user, [py, "-m", "hold", "run", "-v", "--", "true"], unpriv_runtime, env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
        cwd=work,
    )
    assert res.returncode == 0, res.stderr
    assert res.stderr.count(NOTE) == 1, res.stderr
    line = next(ln for ln in res.stderr.splitlines() if NOTE in ln)
    assert "not writable by this user" in line and "via walk" in res.stderr, res.stderr
    for words in ("leaves the session", "clears HOLD_TREE", "a keeper above it"):
        assert words in line, line
    # Without -v: nothing of it.
    res = subprocess.run(
        as_user(unpriv_user, [py, "-m", "hold", "run", "--", "true"], unpriv_runtime, env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
        cwd=work,
    )
    assert res.returncode == 0 and NOTE not in res.stderr, res.stderr


@pytest.mark.parametrize("cgroups", ["off", "required"])
def test_hold_run_v_names_the_walk_only_when_it_walks(isolated_hold: Path, cgroups: str) -> None:
    if cgroups == "required":
        try:
            Hierarchy.find()
        except CgroupUnavailable as e:
            pytest.skip(f"no writable cgroup v2 here: {e}")
    config = isolated_hold / "config.yaml"
    doc = yaml.safe_load(config.read_text()) or {}
    config.write_text(yaml.safe_dump({**doc, "cgroups": cgroups}, sort_keys=False))
    res = subprocess.run(
        [*HOLD, "run", "-v", "--", sys.executable, "-c", "pass"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    if cgroups == "off":
        assert res.stderr.count(NOTE) == 1 and "(cgroups: off)" in res.stderr, res.stderr
        assert "via walk" in res.stderr, res.stderr
    else:
        assert NOTE not in res.stderr and "via cgroup" in res.stderr, res.stderr
