"""The leak check itself must be able to fail: a test that leaks is caught."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import conftest
import pytest
from conftest import alive, wait_for

HERE = Path(__file__).resolve().parent
# Each test runs a whole child pytest (20 s beside two busy loops and four suites)
# whose leak check then waits out its LOADED seconds before it fails the leak.
pytestmark = pytest.mark.timeout(240)


def child_pytest(tests: Path) -> list[str]:
    """A child pytest of the tests in ``tests``, with a base directory of its own
    beside them: with pytest's default it would make ``/tmp/pytest-of-root``
    0700 again, and the other xdist worker's tests that hand a file under it
    to an unprivileged user would lose their way to it."""
    base = tests.parent / f"{tests.name}-child"
    options = ["-q", "-p", "no:cacheprovider", f"--basetemp={base}"]
    return [sys.executable, "-m", "pytest", *options, str(tests)]


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
        child_pytest(tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "left 1 process(es) behind" in out and "sleep 30" in out, out
    # ...and it was killed, not just reported.
    assert not alive(int((tmp_path / "pid").read_text()))


def test_signals_check_catches_a_blocked_signal_and_an_ignored_one(tmp_path: Path) -> None:
    """A test that flips SIGUSR1's blocking and SIGINT's disposition fails, and the
    next test of the same process starts with both as they were.

    "As they were" is what the child inherited, not Python's defaults: a
    run started from a background job of a script (``cmd &``) or under
    ``nohup`` inherits SIGINT ignored, and Python then leaves it so."""
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_signals.py").write_text(
        "import signal\n"
        "MASK = signal.pthread_sigmask(signal.SIG_BLOCK, ())\n"
        "INT = signal.getsignal(signal.SIGINT)\n"
        "def test_a_leaves_them():\n"
        "    signal.pthread_sigmask(signal.SIG_SETMASK, MASK ^ {signal.SIGUSR1})\n"
        "    other = signal.SIG_DFL if INT is signal.SIG_IGN else signal.SIG_IGN\n"
        "    signal.signal(signal.SIGINT, other)\n"
        "def test_b_finds_them_back():\n"
        "    assert signal.pthread_sigmask(signal.SIG_BLOCK, ()) == MASK\n"
        "    assert signal.getsignal(signal.SIGINT) is INT\n"
    )
    res = subprocess.run(
        child_pytest(tmp_path), capture_output=True, text=True, timeout=180, cwd=tmp_path
    )
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "the test left its signals changed" in out and "SIGINT" in out, out
    assert "2 passed, 1 error" in out, out  # b passed: it found both put back


def _need_cgroup() -> str:
    """The cgroup this test runs in (its own, made by conftest), or skip."""
    from hold_supervisor.proc.cgroup import CgroupUnavailable, Hierarchy

    try:
        return Hierarchy.find().base
    except CgroupUnavailable as e:
        pytest.skip(f"no writable cgroup v2 here: {e}")


def _subgroups(path: str) -> set[str]:
    return {e.name for e in os.scandir(path) if e.is_dir(follow_symlinks=False)}


def test_leak_check_catches_a_cgroup_leaf(tmp_path: Path) -> None:
    here = _need_cgroup()
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_leaks.py").write_text(
        "from pathlib import Path\n"
        "from hold_supervisor.proc.cgroup import Hierarchy\n"
        "def test_leaks():\n"
        "    leaf = Hierarchy.find().create('hold-leakcheck0001')\n"
        f"    Path({str(tmp_path / 'leaf')!r}).write_text(leaf.path)\n"
    )
    res = subprocess.run(
        child_pytest(tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "left 1 cgroup leaf(s) behind" in out and "hold-leakcheck0001" in out, out
    # ...and it was removed, not just reported, with the child's own cgroup.
    assert not os.path.exists((tmp_path / "leaf").read_text())
    assert _subgroups(here) == set()


def test_leak_check_neither_counts_nor_removes_a_leaf_someone_else_made(tmp_path: Path) -> None:
    """While a child pytest runs, another ``hold`` user living in the same cgroup
    (this test, which is no descendant of the child) makes a leaf where its own
    ``hold`` would: beside the child pytest, under the cgroup it was started in.
    The child's check passes a test that made no leaf, fails one that did (naming
    that leaf alone), and leaves the other user's (empty) leaf where it is."""
    from hold_supervisor.proc.cgroup import Hierarchy

    here = _need_cgroup()
    ready, made = tmp_path / "ready", tmp_path / "made"
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_others.py").write_text(
        "import time\n"
        "from pathlib import Path\n"
        "from hold_supervisor.proc.cgroup import Hierarchy\n"
        "def test_1_meanwhile_someone_else_makes_a_leaf():\n"
        f"    Path({str(ready)!r}).write_text(Hierarchy.find().base)\n"
        "    deadline = time.monotonic() + 20\n"
        f"    while not Path({str(made)!r}).exists():\n"
        "        assert time.monotonic() < deadline, 'the other leaf never came'\n"
        "        time.sleep(0.01)  # poll interval, under the deadline above\n"
        "def test_2_and_this_one_leaves_its_own():\n"
        "    Hierarchy.find().create('hold-mine0002')\n"
    )
    child = subprocess.Popen(
        child_pytest(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    other = None
    try:
        # Its text, not the file: write_text makes the file before it writes.
        base = wait_for(lambda: ready.exists() and ready.read_text(), 30, what="the child's test")
        # The child's test runs in a cgroup of its own, below ours.
        assert os.path.dirname(base) == here
        other = Hierarchy(here).create("hold-someoneelse0001")
        made.write_text("")
        out, _ = child.communicate(timeout=180)
        assert child.returncode == 1, out
        # The check fails the second test at its teardown, and only that one...
        assert "2 passed, 1 error" in out, out
        assert "ERROR test_others.py::test_2_and_this_one_leaves_its_own" in out, out
        # ...counting only its own leaf...
        assert "left 1 cgroup leaf(s) behind" in out and "hold-mine0002" in out, out
        assert "hold-someoneelse0001" not in out, out
        # ...the other user's is still there, and nothing of the child's is.
        assert _subgroups(here) == {os.path.basename(other.path)}
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if other is not None:
            os.rmdir(other.path)


def test_alive_means_the_process_first_seen_at_that_pid() -> None:
    """``alive`` (conftest) answers for the process a test first saw at a pid:
    once it has exited, a later process given the same pid is not it. Pid
    reuse cannot be ordered on demand, so the later process is stood in for
    by this one, with its first sighting made earlier than it started."""
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert alive(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not alive(child.pid)

    me = os.getpid()
    assert alive(me)
    conftest._FIRST_SEEN[me] -= 1  # what a first sighting of an earlier process leaves
    assert not alive(me)
