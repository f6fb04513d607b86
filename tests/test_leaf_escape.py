"""A process of a tree that leaves its cgroup leaf, its session and its marker at
once (issue 24: the root of a ``hold run`` or of a stack unit, in cgroup mode,
that moved itself to another cgroup, called ``setsid`` and cleared its
environment survived the stop, and the survivor check said "empty").

The program (tests/progs/cgroup_escape.py) really does it, as root, into a cgroup
it makes under the test's own cgroup. The stop must end it -- found as the root,
as a child of a member outside the leaf, or as an orphan of the launcher, which is a
subreaper in cgroup mode too -- and the survivor check says "unknown", not "empty":
what an escapee started outside the leaf is not provably gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import HOLD, PROGS, alive, update_config, wait_for

PROG = str(PROGS / "cgroup_escape.py")


@pytest.fixture
def away(isolated_hold: Path) -> Iterator[str]:
    """A cgroup path (not made yet) under the test's own cgroup, removed afterwards."""
    from hold_supervisor.proc.cgroup import CgroupUnavailable, Hierarchy, Leaf

    if os.geteuid() != 0:
        pytest.skip("leaving a leaf for another cgroup takes root")
    try:
        base = Hierarchy.find().base
    except CgroupUnavailable as e:
        pytest.skip(f"no writable cgroup v2 here: {e}")
    update_config(isolated_hold, cgroups="required")
    path = f"{base}/holdtest-escape-{uuid.uuid4().hex[:12]}"
    yield path
    if os.path.isdir(path):
        leaf = Leaf(path)
        leaf.kill()  # the escapee, if the stop failed (the test has failed then)
        leaf.wait_empty(5.0)
        os.rmdir(path)


def _escapee(ready: Path) -> int:
    line = wait_for(lambda: ready.exists() and ready.read_text(), 30, what="the escape")
    return int(line.split()[1])


@pytest.mark.parametrize("mode", ["self", "child"])
def test_hold_run_stops_a_process_that_left_its_leaf_and_says_unknown(
    tmp_path: Path, away: str, mode: str
) -> None:
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [*HOLD, "run", "-v", "--grace", "0.5s", "--", sys.executable, PROG, mode, away, str(ready)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pid = _escapee(ready)
        # It really left: in the other cgroup, its own session, no marker.
        with open(f"{away}/cgroup.procs") as f:
            assert f.read().split() == [str(pid)]
        assert os.getsid(pid) == pid
        assert b"HOLD_TREE=" not in Path(f"/proc/{pid}/environ").read_bytes()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert not alive(pid), err
    assert "survivor check unknown: 1 left the cgroup leaf" in err, err
    assert f"({pid} " in err and "survivor check empty" not in err, err


@pytest.mark.parametrize("mode", ["self", "child"])
def test_a_stack_unit_that_left_its_leaf_is_stopped_and_said_unknown(
    tmp_path: Path, away: str, mode: str
) -> None:
    ready = tmp_path / "ready"
    stack = tmp_path / "stack.yaml"
    stack.write_text(
        "name: escapes\n"
        "units:\n"
        "  leaver:\n"
        f"    cmd: [{sys.executable}, {PROG}, {mode}, {away}, {ready}]\n"
        "    stop: {grace: 0.5s}\n"
    )
    up = subprocess.run(
        [*HOLD, "up", "--detach", str(stack)], capture_output=True, text=True, timeout=60
    )
    assert up.returncode == 0, up.stderr
    try:
        pid = _escapee(ready)
        with open(f"{away}/cgroup.procs") as f:
            assert f.read().split() == [str(pid)]
    finally:
        down = subprocess.run(
            [*HOLD, "down", "escapes"], capture_output=True, text=True, timeout=60
        )
    assert not alive(pid), down.stderr
    log = (tmp_path / "state").rglob("*.log")
    said = down.stdout + down.stderr + "".join(p.read_text(errors="replace") for p in log)
    assert "survivor check unknown" in said and f"{pid} (leaver)" in said, said[-3000:]
