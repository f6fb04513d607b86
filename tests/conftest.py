"""Shared fixtures: an isolated state directory and configuration per test, real
unprivileged users, and the leak check that fails any test leaving a process.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import itertools
import json
import os
import pwd
import random
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from hold_supervisor.proc import scan
from hold_supervisor.proc.cgroup import Hierarchy, Leaf

ROOT = Path(__file__).resolve().parent.parent
PROGS = Path(__file__).resolve().parent / "progs"
HOLD = [sys.executable, "-m", "hold"]
# A CPU this process may use, whatever its mask (taskset, a cpuset): what a
# stack file under test pins to, never CPU 0 by habit.
CPU = min(os.sched_getaffinity(0))
T = TypeVar("T")


# --------------------------------------------------------------------------
# Isolation: every test gets its own HOLD_STATE_DIR and HOLD_CONFIG, and its
# own ``npu`` and ``gpu`` classes over device nodes in its own directory.


@pytest.fixture(autouse=True)
def isolated_hold(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    no_process_left_behind: None,
) -> Iterator[Path]:
    """Own state directory and configuration; afterwards, stop the test's daemon.

    Depends on the leak check so that it is torn down *before* it: a daemon
    the test started (clients autostart one) is stopped here, by its own
    SIGTERM path, and anything else still running is the test's leak.

    The configuration redefines ``npu`` and ``gpu`` over nodes of this test
    (see :func:`own_device_classes`), so every ticket goes through the
    daemon's scan of real nodes; a test marked ``real_devices`` keeps the
    built-in classes (the machine's own GPUs, say).
    """
    state = tmp_path / "state"
    own_nodes = request.node.get_closest_marker("real_devices") is None
    with contextlib.ExitStack() as stack:
        if not own_nodes:
            stack.enter_context(_machine_devices_to_ourselves())
        yield from _isolated(tmp_path, state, own_nodes, monkeypatch)


# What a loaded machine may add to a bounded step: two busy loops and four suites
# on 2 cores made a 0.3 s grace take 3.7 s and a Python start-up 2-3 s. A test's
# upper bound on a time separates bounded from unbounded, or from a wait of 30 s
# or more; it never tells one short time from another (that is a benchmark's).
LOADED = 15.0

# How long a test on the machine's own devices may wait for them (see
# _machine_devices_to_ourselves); its timeout is longer by as much.
DEVICES_WAIT = 240.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("real_devices") is None:
            continue
        mark = item.get_closest_marker("timeout")
        own = mark.args[0] if mark is not None and mark.args else item.config.getini("timeout")
        own = float(own)
        item.add_marker(pytest.mark.timeout(own + DEVICES_WAIT), append=False)


@contextlib.contextmanager
def _machine_devices_to_ourselves(timeout: float = DEVICES_WAIT) -> Iterator[None]:
    """One test at a time on the machine's own devices, across every run of this
    suite on the machine. Each test's daemon has a lock directory of its own,
    so two suites' daemons could lease one real GPU at once; and when a lease
    ends its daemon stops whoever started on the device since the grant -- the
    other suite's CUDA process too (the lent host, 8 suites on one GPU: once
    in 8 runs an audit found no stray where its test had just started one)."""
    with _turn("real-devices", "the machine's devices", timeout):
        yield


@contextlib.contextmanager
def _turn(name: str, what: str, timeout: float) -> Iterator[None]:
    """``what`` to this test alone, across every run of this suite on the machine
    (a file lock in the temporary directory, named by ``name``)."""
    from filelock import FileLock, Timeout

    lock = FileLock(os.path.join(tempfile.gettempdir(), f"hold-tests-{name}.lock"), mode=0o666)
    try:
        lock.acquire(timeout=timeout)
    except Timeout:
        pytest.fail(f"another run of this suite kept {what} for {timeout:.0f} s")
    try:
        yield
    finally:
        lock.release()


def _isolated(
    tmp_path: Path, state: Path, own_nodes: bool, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Path]:
    write_config(tmp_path, node_classes=own_nodes)
    monkeypatch.setenv("HOLD_STATE_DIR", str(state))
    monkeypatch.setenv("HOLD_CONFIG", str(tmp_path / "config.yaml"))
    # The machine-wide device locks too: a test's own directory (sticky and
    # world-writable, as /run/lock is), so that tests never meet each other or
    # real users of this machine on a lock (tests/test_multiuser.py uses the
    # real one, with keys no one else has).
    locks = tmp_path / "locks"
    locks.mkdir(mode=0o1777)
    locks.chmod(0o1777)
    monkeypatch.setenv("HOLD_LOCK_DIR", str(locks))
    # A home of its own too: a daemon writes ~/NPU-TOKEN for its own user
    # in its $HOME (hold.daemon.records.home_of), and a test's leases must not meet
    # another test's there, nor leave lines in root's real home.
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
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
        from hold_supervisor.proc.cgroup import CgroupUnavailable, Hierarchy

        try:
            Hierarchy.find()
        except CgroupUnavailable as e:
            pytest.skip(f"no writable cgroup v2 here: {e}")
        update_config(isolated_hold, cgroups="required")
    else:
        update_config(isolated_hold, cgroups="off")
    return mode


# --------------------------------------------------------------------------
# The configuration file, and the device nodes behind ``npu`` and ``gpu``.
#
# Nodes are character device nodes where this process may make them (root,
# and no device cgroup in the way), regular files otherwise. A node's device
# number is its identity machine-wide (the arbiters' locks are named by it),
# so each node gets a (major, minor) that no driver here registers (a major
# missing from /proc/devices, from the top of the 12-bit range) and that
# another test, or another run of this suite, is most unlikely to draw (the
# minor is random over 20 bits): nothing on the machine holds such a node,
# and no other test's lease excludes it. Nobody can open one either (ENXIO):
# a test that needs a holder uses a class of regular files (``fake``).
# Regular files are unique by inode anyway.

DEV_NODES = {"npu": ["accel0"], "gpu": ["nvidia0"]}
GPU_SHARED = "nvidiactl"
GPU_VISIBLE_ENV = ["CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"]


def _registered_char_majors() -> set[int]:
    out: set[int] = set()
    try:
        text = Path("/proc/devices").read_text()
    except OSError:
        return out
    section = text.split("Block devices:")[0]
    for line in section.splitlines():
        first = line.split(maxsplit=1)[0] if line.strip() else ""
        if first.isdigit():
            out.add(int(first))
    return out


def _make_node(path: Path, rng: random.Random, taken: set[tuple[int, int]]) -> str:
    """A node at ``path``, 0666: ``"chr"`` for a character node, ``"file"`` for a file."""
    registered = _registered_char_majors()  # once: not once per candidate (4,096 reads a test)
    majors = [m for m in range(3072, 4096) if m not in registered]
    if os.geteuid() == 0 and majors:
        num = (rng.choice(majors), rng.randrange(1 << 20))
        while num in taken:
            num = (rng.choice(majors), rng.randrange(1 << 20))
        try:
            os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(*num))
        except OSError:
            pass
        else:
            taken.add(num)
            os.chmod(path, 0o666)  # not narrowed by the umask
            return "chr"
    path.write_bytes(b"")
    os.chmod(path, 0o666)
    return "file"


@contextlib.contextmanager
def fresh_leaf() -> Iterator[Leaf]:
    """A new cgroup leaf of this test's, killed, emptied and removed afterwards;
    :class:`~hold_supervisor.proc.cgroup.CgroupUnavailable` where none can be made."""
    hier = Hierarchy.find()
    leaf = hier.create(f"holdtest-{uuid.uuid4().hex[:12]}")
    try:
        yield leaf
    finally:
        leaf.kill()
        leaf.wait_empty(5.0)
        leaf.remove(hier.base)


# /dev/full: a real character device anyone may open and nobody here holds, for
# the tests of holders through another node of it (a container's own /dev,
# tests/test_occupancy_containers.py, the container soak). Device numbers are
# machine-wide, so those tests take turns across every run of this suite here.
FULL = os.makedev(1, 7)


def _holders_of_full() -> list[int]:
    """Pids with /dev/full's device open (any node of it), read from /proc."""
    return [
        pid
        for pid in scan.pids()
        if any(stat.S_ISCHR(st.st_mode) and st.st_rdev == FULL for st in open_files(pid))
    ]


@pytest.fixture
def dev_full() -> Iterator[None]:
    """/dev/full to this test alone (a file lock shared by every run of the suite),
    checked free of anyone else's holders first (skipped where it is not)."""
    with _turn("dev-full", "/dev/full", DEVICES_WAIT):
        others = _holders_of_full()
        if others:
            pytest.skip(f"/dev/full is held by pid(s) {others}, not this test's")
        yield


def open_files(pid: int) -> Iterator[os.stat_result]:
    """What each descriptor of ``pid`` names (nothing where it may not be read)."""
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return
    for name in names:
        try:
            yield os.stat(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue


def holds_node(pid: int, node: Path) -> bool:
    """Whether ``pid`` has ``node`` open (a descriptor to the same file), read from /proc."""
    want = os.stat(node)
    return any((st.st_dev, st.st_ino) == (want.st_dev, want.st_ino) for st in open_files(pid))


def own_device_classes(base: Path) -> dict[str, dict[str, list[str]]]:
    """``npu`` (one device) and ``gpu`` (one device and a shared control node) over
    nodes in ``base/dev`` (made on first use; the directory may be traversed and
    the nodes opened by anyone, for tests that run as another user)."""
    d = base / "dev"
    if not d.is_dir():
        d.mkdir()
        d.chmod(0o755)
        rng, taken = random.SystemRandom(), set[tuple[int, int]]()
        for name in [*DEV_NODES["npu"], *DEV_NODES["gpu"], GPU_SHARED]:
            _make_node(d / name, rng, taken)
    return {
        "npu": {"nodes": [f"{d}/accel*"]},
        "gpu": {
            "nodes": [f"{d}/nvidia[0-9]*"],
            "shared_nodes": [f"{d}/{GPU_SHARED}"],
            "visible_env": list(GPU_VISIBLE_ENV),
        },
    }


def write_config(
    base: Path,
    *,
    cgroups: str = "auto",
    devices: dict[str, Any] | None = None,
    node_classes: bool = True,
    **top: Any,
) -> Path:
    """Write ``base/config.yaml``: ``cgroups``, the test's own ``npu`` and ``gpu``
    (unless ``node_classes`` is false), the classes in ``devices`` (which may
    replace them), and any other top-level keys (``busy_devices="warn"``)."""
    doc: dict[str, Any] = {"cgroups": cgroups}
    classes = {**(own_device_classes(base) if node_classes else {}), **(devices or {})}
    if classes:
        doc["devices"] = classes
    doc.update(top)
    path = base / "config.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def update_config(base: Path, *, devices: dict[str, Any] | None = None, **top: Any) -> Path:
    """Change ``base/config.yaml`` and keep the rest: classes in ``devices`` are
    added (or replace one of the same name), other keys are set."""
    path = base / "config.yaml"
    doc: dict[str, Any] = yaml.safe_load(path.read_text()) or {}
    if devices:
        doc["devices"] = {**(doc.get("devices") or {}), **devices}
    doc.update(top)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


# --------------------------------------------------------------------------
# The leak check.
#
# pytest makes itself a child subreaper, so every process a test starts stays
# its descendant however it detaches (setsid, double fork): orphans are
# re-parented to the nearest subreaper above them, never past pytest to init.
# "Left behind" is then exactly "a live descendant of pytest after the test",
# and tests running in parallel elsewhere on the machine are never mistaken
# for leaks (or killed).
#
# Cgroup leaves. ``hold`` makes a tree's leaf under the cgroup its own process
# lives in (``Hierarchy.find().base``), and so does every other ``hold`` user
# who lives in that cgroup too (another run of this suite, someone's job): a
# leaf's name says nothing about who made it. So each test runs in a cgroup
# of its own: pytest moves itself into a fresh child of its cgroup
# (``pytest-PID-N``) for the test and back afterwards. A process enters a
# cgroup only by being forked inside it or by an explicit move, so what lives
# in the test's cgroup is pytest and its descendants, and every leaf made
# there (by ``hold`` or the test itself, through ``Hierarchy.find()``) was
# made by the test. The rule: the test's leaves are exactly the directories
# in its own cgroup; they are counted, and removed, and nothing else on the
# machine is looked at. Where pytest cannot make or enter such a cgroup, the
# test's processes cannot make leaves either (the same write access is
# needed), and there is nothing to check.


_BASETEMP: list[Path] = []  # this run's pytest base directory, once known


def pytest_configure(config: pytest.Config) -> None:
    from hold_supervisor.proc.reaper import become_subreaper

    become_subreaper()
    config.addinivalue_line(
        "markers", "real_devices: keep the built-in device classes (the machine's own nodes)"
    )


def _live_descendants() -> list[scan.Stat]:
    procs = scan.snapshot()
    return [procs[pid] for pid in scan.descendants([os.getpid()], procs) if not procs[pid].is_dead]


def _reap_adopted_zombies() -> None:
    me = os.getpid()
    for st in scan.snapshot().values():
        if st.ppid == me and st.is_dead:
            try:
                os.waitpid(st.pid, os.WNOHANG)
            except ChildProcessError:
                pass


_test_cgroups = itertools.count(1)


class TestCgroup:
    """The cgroup one test runs in (a child of pytest's own), while it runs."""

    __test__ = False  # not a test class

    def __init__(self, parent: str, path: str) -> None:
        self.parent, self.path = parent, path

    @classmethod
    def enter(cls) -> TestCgroup | None:
        """Make a cgroup for this test and move pytest into it; None if it cannot be."""
        from hold_supervisor.proc.cgroup import CgroupUnavailable, Hierarchy

        try:
            parent = Hierarchy.find().base
        except CgroupUnavailable:
            return None
        path = f"{parent}/pytest-{os.getpid()}-{next(_test_cgroups)}"
        try:
            os.mkdir(path)
        except OSError:
            return None
        try:
            _move_self(path)
        except OSError:
            os.rmdir(path)
            return None
        return cls(parent, path)

    def leaves(self) -> set[str]:
        """Every cgroup directly in the test's cgroup: each one the test made."""
        try:
            return {e.path for e in os.scandir(self.path) if e.is_dir(follow_symlinks=False)}
        except FileNotFoundError:
            return set()

    def leave(self) -> str | None:
        """Move pytest back and remove the test's cgroup; what went wrong, if anything."""
        from hold_supervisor.proc.cgroup import Leaf

        _move_self(self.parent)
        own = Leaf(self.path)
        if not own.wait_empty(2.0):
            # Only the test's processes can be in it (see above).
            own.kill()
            own.wait_empty(2.0)
        try:
            own.remove(self.parent)
        except (OSError, ValueError) as e:
            return f"cannot remove the test's cgroup {self.path}: {e}"
        return None


def _move_self(cgroup: str) -> None:
    with open(f"{cgroup}/cgroup.procs", "w") as f:
        f.write(str(os.getpid()))


# The signals whose handling a test may change in this process (a foreground
# run, a stack's loop, a forked scan) and must give back: a blocked or ignored
# SIGINT left behind is inherited by every process a later test starts.
_KEPT_SIGNALS = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGCHLD,
    signal.SIGPIPE,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGTSTP,
    signal.SIGTTIN,
    signal.SIGTTOU,
)


@pytest.fixture(autouse=True)
def signals_given_back() -> Iterator[None]:
    """Fails a test that leaves this process's signal mask or a handler changed
    (and puts them back, so that the next test does not inherit it)."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    handlers = {s: signal.getsignal(s) for s in _KEPT_SIGNALS}
    yield
    now_mask = signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    changed = [f"blocked {sorted(now_mask ^ mask)}"] if now_mask != mask else []
    for s, h in handlers.items():
        if signal.getsignal(s) != h and h is not None:
            changed.append(f"{signal.Signals(s).name}: {signal.getsignal(s)!r}, was {h!r}")
            signal.signal(s, h)
    if changed:
        pytest.fail("the test left its signals changed: " + "; ".join(changed))


@pytest.fixture(autouse=True)
def no_process_left_behind() -> Iterator[None]:
    _FIRST_SEEN.clear()
    before = {(st.pid, st.starttime) for st in _live_descendants()}
    cgroup = TestCgroup.enter()
    try:
        yield
    finally:
        # Back to pytest's cgroup whatever happens below (a failed check, too).
        try:
            _check_processes(before)
            if cgroup is not None:
                _check_leaves(cgroup)
        finally:
            trouble = cgroup.leave() if cgroup is not None else None
    if trouble:
        pytest.fail(trouble)


def _check_leaves(cgroup: TestCgroup) -> None:
    """A leaf left behind is a tree whose end nobody cleaned up: removed, and failed."""
    from hold_supervisor.proc.cgroup import Leaf

    deadline = time.monotonic() + LOADED  # as for processes, below
    left = cgroup.leaves()
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = cgroup.leaves()
    for path in left:
        try:
            Leaf(path).remove(cgroup.path)
        except (OSError, ValueError):
            pass
    if left:
        pytest.fail(f"test left {len(left)} cgroup leaf(s) behind: {sorted(left)}")


def _check_processes(before: set[tuple[int, int]]) -> None:
    # A process on its way out (a launcher's survivor check and clean-up after
    # its units ended) took over 2 s on a loaded machine; one that stays is a
    # leak however long this waits, and an empty check costs nothing.
    deadline = time.monotonic() + LOADED
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


def launcher_of(pid: int) -> int:
    """The process that runs a command for ``pid`` (a ``hold run``, ``npu-hold`` or
    ``hold up`` the test started): ``pid`` itself, or in walk mode the launcher
    that went on below it when ``pid`` stayed behind as its keeper
    (``hold_supervisor.spawn.keeper``)."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return pid
    if comm != "hold-keeper":
        return pid
    (child,) = [st.pid for st in scan.snapshot().values() if st.ppid == pid and not st.is_dead]
    return child


def hold_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    return env


def wait_for(
    predicate: Callable[[], T], timeout: float = 20.0, interval: float = 0.01, what: str = "it"
) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def in_line(cls: str) -> int:
    """How many clients wait in line for ``cls`` (``hold status --json``)."""
    res = subprocess.run(
        [*HOLD, "status", "--json"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    return len(json.loads(res.stdout)["classes"][cls]["queue"])


def audit_clean(stdout: str) -> int:
    """The exit status of a ``hold audit`` that found no stray (or stopped every one)
    and printed ``stdout``: 0 where it read every process, 7 (INCOMPLETE) where
    it says it could not read some -- as on a machine whose init even root may
    not read (a sandbox's), or for a user who may not read root's processes."""
    try:
        n = int(json.loads(stdout)["not_inspected"])
    except ValueError:
        m = re.search(r"not inspected: (\d+)", stdout)
        n = int(m.group(1)) if m else 0
    return 7 if n else 0


def grant_checks(state: Path) -> list[str]:
    """What proved the device empty for each grant so far, in order (the log of
    the daemon of ``state``): ``scan`` or ``count``."""
    out = []
    for line in (state / "daemon.log").read_text().splitlines():
        if not line.startswith("{"):
            continue  # the daemon's stderr shares its log (a message before it served)
        ev = json.loads(line)
        if ev.get("event") == "granted":
            out.append(ev["check"])
    return out


def wait_in_line(cls: str, n: int, timeout: float = 20) -> None:
    """Until ``n`` clients wait in line for ``cls``: they have asked and been
    answered "queued", so each has set up its signal handling by then."""
    wait_for(lambda: in_line(cls) == n, timeout, 0.05, f"{n} waiting for {cls}")


# A pid names a process only until the pid is reused, and on a machine whose
# pid_max is 32,768, with suites forking beside each other, it comes round
# again within minutes: a process a test saw alive and then waits to see gone
# can be "alive" again as someone else's. So ``alive`` keeps, for the test
# that asks, the start time of the process it first saw at each pid (cleared
# as each test starts, by ``no_process_left_behind``); a later process at
# that pid is not the one asked about. (A test that holds a ``ProcessId``
# compares the start time itself.)
_FIRST_SEEN: dict[int, int] = {}


def alive(pid: int) -> bool:
    """Whether the process this test first saw at ``pid`` still runs (not a zombie)."""
    st = scan.stat_of(pid)
    if st is None:
        return False
    return _FIRST_SEEN.setdefault(pid, st.starttime) == st.starttime and not st.is_dead


def exec_done(pid: int, comm: str = "sleep") -> bool:
    """Has ``pid`` finished its ``execve`` of ``comm`` with an empty environment?

    A test program writes an escapee's pid down before the exec (after it, the
    program is ``sleep``), so read at once the pid may still be python, with
    the old environment: a test that asserts the new image waits on this."""
    if (st := scan.stat_of(pid)) is None or st.comm != comm:
        return False
    return scan.environ(pid) == b""


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
def unpriv_runtime(tmp_path_factory: pytest.TempPathFactory, unpriv_user: str) -> Iterator[Path]:
    """A world-readable directory holding ``hold``, ``hold_supervisor`` and their dependencies.

    Not under pytest's base directory: every pytest that starts on this machine
    (another user's run, a test's child pytest) makes ``/tmp/pytest-of-root``
    0700 again, and the unprivileged user could no longer reach the copy. (That
    directory and the session's are still opened here, as they always were, for
    tests that hand their ``tmp_path`` to the user without opening its parents.)
    """
    _BASETEMP[:] = [tmp_path_factory.getbasetemp()]
    _open_to_all(_BASETEMP[0])
    base = Path(tempfile.mkdtemp(prefix="hold-runtime-"))
    try:
        yield _fill_runtime(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _fill_runtime(base: Path) -> Path:
    # The folder supervisor/ imports as hold_supervisor (pyproject's package-dir).
    for folder, pkg in (("hold", "hold"), ("supervisor", "hold_supervisor")):
        shutil.copytree(ROOT / folder, base / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    # Each dependency from wherever this Python imports it: a venv's own
    # site-packages, or one it reaches through a .pth (the lent GPU machine's
    # venv over the image's packages).
    for name in ("psutil", "yaml", "_yaml", "click", "filelock", "structlog", "typing_extensions"):
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue  # optional here (_yaml: PyYAML built without libyaml)
        origin = Path(spec.origin)
        if spec.submodule_search_locations:
            shutil.copytree(
                origin.parent, base / name, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy(origin, base / origin.name)
    shutil.copytree(PROGS, base / "progs")
    _open_to_all(base)
    subprocess.run(["chmod", "-R", "a+rX", str(base)], check=True)
    return base


def _open_to_all(path: Path) -> None:
    """Let anyone list and enter ``path`` and the directories above it."""
    for p in [path, *path.parents]:
        if p == Path("/"):
            break
        if os.stat(p).st_mode & 0o055 != 0o055:
            os.chmod(p, os.stat(p).st_mode | 0o055)


def unpriv_python() -> str:
    """A Python the unprivileged user may execute: ours if reachable, else the system's."""
    for cand in (sys.executable, "/usr/bin/python3"):
        real = os.path.realpath(cand)
        # Checked the way as_user() runs it (through env -i), not by a direct exec.
        ok = subprocess.run(
            [
                "setpriv",
                "--reuid=nobody",
                "--regid=nogroup",
                "--clear-groups",
                "env",
                "-i",
                real,
                "-c",
                "pass",
            ],
            capture_output=True,
        )
        if ok.returncode == 0:
            return real
    pytest.skip("no Python interpreter here that an unprivileged user may run")


def as_user(user: str, argv: list[str], runtime: Path, env: dict[str, str]) -> list[str]:
    """The command line that runs ``argv`` as ``user`` with the copied runtime on sys.path.

    This run's base directory is opened to the user again first: any pytest
    that starts on the machine meanwhile (another run, a test's child pytest)
    makes ``/tmp/pytest-of-root`` 0700 again, and a test's files under it
    would be out of the user's reach (seen under -n 2, with pytest's own base).
    """
    if _BASETEMP:
        _open_to_all(_BASETEMP[0])
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
        "setpriv",
        f"--reuid={pw.pw_uid}",
        f"--regid={pw.pw_gid}",
        "--init-groups",
        "env",
        "-i",
        *[f"{k}={v}" for k, v in full.items()],
        *argv,
    ]


# --------------------------------------------------------------------------
# A terminal, for tests of what a person at one sees.


class Pty:
    """The master side of a pty, read with deadlines (never a bare blocking read)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.text = ""  # everything read, for messages
        self._pending = ""
        os.set_blocking(fd, False)

    def write(self, data: str) -> None:
        os.write(self.fd, data.encode())

    def expect(self, pattern: str, timeout: float = 10.0) -> re.Match[str]:
        """Wait for ``pattern`` (multiline) in what was read since the last match."""
        rx = re.compile(pattern, re.M)
        deadline = time.monotonic() + timeout
        while True:
            m = rx.search(self._pending)
            if m:
                self._pending = self._pending[m.end() :]
                return m
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {pattern!r} within {timeout}s; terminal:\n{self.text}")
            if select.select([self.fd], [], [], left)[0]:
                try:
                    chunk = os.read(self.fd, 4096).decode(errors="replace")
                except BlockingIOError:
                    continue
                except OSError as e:  # EIO: every slave side is closed
                    if e.errno != errno.EIO:
                        raise
                    chunk = ""
                if not chunk:
                    raise AssertionError(f"terminal closed before {pattern!r}:\n{self.text}")
                chunk = chunk.replace("\r", "")
                self.text += chunk
                self._pending += chunk


def holder_roles(out: Path, proc: subprocess.Popen[bytes]) -> dict[str, int]:
    """The roles and pids ``progs/node_holder.py`` wrote to ``out`` once it holds
    its node ("holder PID", ...); fails at once if ``proc`` ended first."""

    def ready() -> dict[str, int]:
        assert proc.poll() is None, f"{proc.args} ended with {proc.returncode}"
        if not out.exists():
            return {}
        roles = dict(line.split() for line in out.read_text().splitlines())
        return {r: int(p) for r, p in roles.items()} if "holder" in roles else {}

    found: dict[str, int] = wait_for(ready, 20, 0.02, f"holder {proc.args}")
    return found
