"""Spawn: what the child gets from its first instruction -- mask, descriptors,
environment, session, cgroup -- and how a start that cannot happen is refused.

Every child here reports what it sees itself (its own /proc/self/...), not what
the parent reads about it afterwards.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from conftest import fresh_leaf

from hold_supervisor.environ import FALLBACK_PATH, MARKER, minimal_env
from hold_supervisor.parse import format_cpus
from hold_supervisor.proc import scan as procscan
from hold_supervisor.proc.cgroup import CgroupUnavailable, Hierarchy, Leaf, own_cgroup, v2_mount
from hold_supervisor.spawn.child import Child, SpawnError, owned_pids, spawn

CPUS = frozenset(os.sched_getaffinity(0))
needs_two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="needs at least 2 usable CPUs")

# Python that reports which descriptors it has open, touching nothing else
# first (fstat opens nothing, unlike listing /proc/self/fd).
LIST_FDS = (
    "import os\n"
    "fds = []\n"
    "for fd in range(4096):\n"
    "    try:\n"
    "        os.fstat(fd)\n"
    "    except OSError:\n"
    "        continue\n"
    "    fds.append(fd)\n"
    "print(' '.join(map(str, fds)))\n"
)


def _tree_id() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def _env(**extra: str) -> dict[str, str]:
    return minimal_env(os.environ, tree_id=_tree_id(), extra=extra)


@pytest.fixture
def leaf(cgroup_mode: str) -> Iterator[Leaf | None]:
    """A fresh cgroup leaf in cgroup mode, None in walk mode; removed afterwards."""
    if cgroup_mode == "walk":
        yield None
        return
    with fresh_leaf() as lf:
        yield lf


def _wait(child: Child, timeout: float = 10.0) -> int:
    """The child's status, waiting at most ``timeout`` (then kill it and fail)."""
    poller = select.poll()
    poller.register(child.pidfd, select.POLLIN)
    poller.poll(timeout * 1000)
    rc = child.poll()
    if rc is None:
        child.send_signal(signal.SIGKILL)
        child.wait()
        raise AssertionError(f"{child.argv} did not exit within {timeout}s")
    return rc


def _read_all(fd: int, timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    out = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no end of output within {timeout}s (so far: {out!r})")
        if not poller.poll(left * 1000):
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return out
        out += chunk


def run(argv: list[str], *, timeout: float = 10.0, **kw: Any) -> tuple[int, bytes]:
    """Spawn ``argv`` with its stdout on a pipe; its status and everything it printed."""
    kw.setdefault("env", _env())
    r, w = os.pipe()
    try:
        try:
            child = spawn(argv, stdout=w, **kw)
        finally:
            os.close(w)
        out = _read_all(r, timeout)
    finally:
        os.close(r)
    return _wait(child, timeout), out


def _mask_line(out: bytes) -> str:
    line = out.decode().strip()
    assert line.startswith("Cpus_allowed_list:"), line
    return line.split(":", 1)[1].strip()


FIRST_READ = ["grep", "Cpus_allowed_list", "/proc/self/status"]

# --------------------------------------------------------------------------
# CPU mask


@needs_two_cpus
def test_first_read_of_own_status_shows_the_mask(leaf: Leaf | None) -> None:
    before = os.sched_getaffinity(0)
    for cpu in sorted(CPUS)[:4]:
        rc, out = run(FIRST_READ, cpus=frozenset({cpu}), cgroup=leaf)
        assert rc == 0
        assert _mask_line(out) == str(cpu)
    two = frozenset(sorted(CPUS)[:2])
    rc, out = run(FIRST_READ, cpus=two, cgroup=leaf)
    assert rc == 0 and _mask_line(out) == format_cpus(two)
    # No mask: the child runs where the caller runs.
    rc, out = run(FIRST_READ, cgroup=leaf)
    assert rc == 0 and _mask_line(out) == format_cpus(CPUS)
    assert os.sched_getaffinity(0) == before


@needs_two_cpus
def test_mask_is_verified_and_recorded_on_the_child() -> None:
    cpu = max(CPUS)
    child = spawn(["sleep", "30"], env=_env(), cpus=frozenset({cpu}))
    try:
        assert child.cpus == frozenset({cpu})
        with open(f"/proc/{child.pid}/status") as f:
            line = next(ln for ln in f if ln.startswith("Cpus_allowed_list:"))
        assert line.split(":", 1)[1].strip() == str(cpu)
    finally:
        child.send_signal(signal.SIGKILL)
        assert _wait(child) == -signal.SIGKILL


@needs_two_cpus
def test_caller_thread_mask_is_unchanged() -> None:
    """Spawning from a thread with a mask of its own leaves that mask, and every
    other thread's, as it was."""
    lo, hi = min(CPUS), max(CPUS)
    main_before = os.sched_getaffinity(0)
    result: dict[str, Any] = {}

    def worker() -> None:
        try:
            os.sched_setaffinity(0, {lo})
            rc, out = run(FIRST_READ, cpus=frozenset({hi}))
            result["child"] = (rc, _mask_line(out))
            result["after"] = os.sched_getaffinity(0)
            # With no mask the child inherits this thread's own narrowed mask.
            rc, out = run(FIRST_READ)
            result["inherit"] = (rc, _mask_line(out))
        except BaseException as e:
            result["error"] = e

    t = threading.Thread(target=worker)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive()
    if "error" in result:
        raise result["error"]
    assert result["child"] == (0, str(hi))
    assert result["after"] == {lo}
    assert result["inherit"] == (0, str(lo))
    assert os.sched_getaffinity(0) == main_before


@needs_two_cpus
def test_concurrent_spawns_each_get_their_own_mask() -> None:
    """Threads released together, each spawning repeatedly with its own mask
    (or none): every child sees exactly what its own thread asked for."""
    choices: list[frozenset[int] | None] = [frozenset({c}) for c in sorted(CPUS)[:4]]
    choices.append(None)
    n_threads, rounds = 8, 6
    barrier = threading.Barrier(n_threads, timeout=20)
    seen: dict[int, list[tuple[str, str]]] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        mask = choices[i % len(choices)]
        want = format_cpus(mask if mask is not None else CPUS)
        got: list[tuple[str, str]] = []
        try:
            barrier.wait()
            for _ in range(rounds):
                rc, out = run(FIRST_READ, cpus=mask)
                assert rc == 0
                got.append((want, _mask_line(out)))
            got.append(("thread", format_cpus(frozenset(os.sched_getaffinity(0)))))
        except BaseException as e:
            errors.append(e)
        seen[i] = got

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    for got in seen.values():
        *children, (_, thread_mask) = got
        assert len(children) == rounds
        for want, mask in children:
            assert mask == want, got
        # Each thread's own mask was put back.
        assert thread_mask == format_cpus(CPUS)
    assert frozenset(os.sched_getaffinity(0)) == CPUS


def test_empty_mask_is_refused() -> None:
    before, owned = os.sched_getaffinity(0), owned_pids()
    with pytest.raises(SpawnError, match="empty CPU mask") as info:
        spawn(["true"], env=_env(), cpus=frozenset())
    assert info.value.exit_code == 2
    assert os.sched_getaffinity(0) == before
    assert owned_pids() == owned


@pytest.mark.parametrize(
    "cpus",
    [frozenset({4095}), frozenset({min(CPUS), 4095}), frozenset({min(CPUS), 9999, 10000})],
    ids=["only-impossible", "one-impossible", "range-impossible"],
)
def test_mask_naming_an_unusable_cpu_is_refused(cpus: frozenset[int]) -> None:
    # The kernel would quietly pin to the usable part of a mixed mask; that
    # is "not the mask asked for", and must be refused, naming the CPU.
    before, owned = os.sched_getaffinity(0), owned_pids()
    try:
        with pytest.raises(SpawnError) as info:
            child = spawn(["true"], env=_env(), cpus=cpus)
            _wait(child)  # (reached only when the mask was wrongly accepted)
    finally:
        assert os.sched_getaffinity(0) == before
    assert info.value.exit_code == 2
    msg = str(info.value)
    assert format_cpus(cpus) in msg, msg
    assert owned_pids() == owned


# --------------------------------------------------------------------------
# Descriptors


def _inheritable_clutter(tmp_path: Path) -> list[int]:
    """Many descriptors without close-on-exec, including a high one and sockets."""
    fds: list[int] = []
    for i in range(40):
        fd = os.open(tmp_path / f"f{i}", os.O_RDWR | os.O_CREAT, 0o600)
        os.set_inheritable(fd, True)
        fds.append(fd)
    r, w = os.pipe()
    os.set_inheritable(r, True)
    os.set_inheritable(w, True)
    fds += [r, w]
    s1, s2 = socket.socketpair()
    for s in (s1, s2):
        fd = s.detach()
        os.set_inheritable(fd, True)
        fds.append(fd)
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen()
    fd = lst.detach()
    os.set_inheritable(fd, True)
    fds.append(fd)
    high = os.dup2(fds[0], 1000, inheritable=True)
    fds.append(high)
    return fds


def test_child_sees_only_0_1_2(tmp_path: Path, leaf: Leaf | None) -> None:
    clutter = _inheritable_clutter(tmp_path)
    try:
        assert all(os.get_inheritable(fd) for fd in clutter)
        rc, out = run([sys.executable, "-c", LIST_FDS], cgroup=leaf)
        assert rc == 0
        assert out.decode().split() == ["0", "1", "2"]
        # The parent's descriptors are untouched.
        assert all(os.get_inheritable(fd) for fd in clutter)
    finally:
        for fd in clutter:
            os.close(fd)


def test_named_descriptors_arrive_at_the_same_number(tmp_path: Path, leaf: Leaf | None) -> None:
    clutter = _inheritable_clutter(tmp_path)
    # One named descriptor without close-on-exec, one with it (the default).
    r1, w1 = os.pipe()
    os.set_inheritable(w1, True)
    r2, w2 = os.pipe()
    w2 = os.dup2(w2, 777, inheritable=False)
    try:
        prog = LIST_FDS + f"os.write({w1}, b'one'); os.write({w2}, b'two')\n"
        rc, out = run([sys.executable, "-c", prog], pass_fds=(w1, w2), cgroup=leaf)
        assert rc == 0
        assert out.decode().split() == [str(fd) for fd in sorted({0, 1, 2, w1, w2})]
        assert os.read(r1, 100) == b"one"
        assert os.read(r2, 100) == b"two"
        # close-on-exec in the parent is as it was
        assert os.get_inheritable(w1) and not os.get_inheritable(w2)
    finally:
        for fd in [*clutter, r1, w1, r2, w2]:
            os.close(fd)


def test_stdin_stdout_stderr_go_where_asked(tmp_path: Path) -> None:
    src = tmp_path / "in"
    src.write_text("from stdin\n")
    inp = os.open(src, os.O_RDONLY)
    out = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT, 0o600)
    err = os.open(tmp_path / "err", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        child = spawn(
            ["sh", "-c", "cat; echo to-err >&2"], env=_env(), stdin=inp, stdout=out, stderr=err
        )
        assert _wait(child) == 0
    finally:
        for fd in (inp, out, err):
            os.close(fd)
    assert (tmp_path / "out").read_text() == "from stdin\n"
    assert (tmp_path / "err").read_text() == "to-err\n"


# --------------------------------------------------------------------------
# Environment


def _child_env(leaf: Leaf | None, env: Mapping[str, str]) -> dict[str, str]:
    rc, out = run(["env", "-0"], env=env, cgroup=leaf)
    assert rc == 0
    pairs = [item.split("=", 1) for item in out.decode().split("\0") if item]
    return {k: v for k, v in pairs}


def test_environment_is_allowlist_plus_named_plus_marker(
    monkeypatch: pytest.MonkeyPatch, leaf: Leaf | None
) -> None:
    parent = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": "/home/someone",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "LC_TIME": "en_GB.UTF-8",
        "TERM": "xterm-256color",
        "USER": "someone",
        "TZ": "Europe/Berlin",
        "AWS_SECRET_ACCESS_KEY": "hunter2",
        "AWS_ACCESS_KEY_ID": "AKIA-not-for-children",
        "GITHUB_TOKEN": "ghp_secret",
        "LD_PRELOAD": "/tmp/evil.so",
        "PYTHONPATH": "/somewhere",
        "PASS_ME": "passed on by name",
        "HOLD_TREE": "the-parent's-own-tree",
        "XLC_ALL": "not a locale variable",
    }
    for k in list(os.environ):
        monkeypatch.delenv(k)
    for k, v in parent.items():
        monkeypatch.setenv(k, v)
    tid = _tree_id()
    env = minimal_env(
        os.environ,
        tree_id=tid,
        pass_names=["PASS_ME", "NOT_SET_ANYWHERE"],
        extra={"EXTRA": "a value with spaces = and equals", MARKER: "forged"},
    )
    seen = _child_env(leaf, env)
    expected = {
        k: parent[k]
        for k in ("PATH", "HOME", "LANG", "LC_ALL", "LC_TIME", "TERM", "USER", "TZ", "PASS_ME")
    }
    expected["EXTRA"] = "a value with spaces = and equals"
    expected[MARKER] = tid  # the marker cannot be overridden, nor inherited
    assert seen == expected


def test_environment_leaves_out_unset_allowlist_names(
    monkeypatch: pytest.MonkeyPatch, leaf: Leaf | None
) -> None:
    for k in list(os.environ):
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2")
    monkeypatch.setenv("HOME", "/root")
    tid = _tree_id()
    seen = _child_env(leaf, minimal_env(os.environ, tree_id=tid))
    # No PATH in the parent: the child still gets a safe one, as execvp would assume.
    assert seen == {"HOME": "/root", "PATH": FALLBACK_PATH, MARKER: tid}


def test_marker_is_in_the_child_process_environment() -> None:
    tid = _tree_id()
    child = spawn(["sleep", "30"], env=minimal_env(os.environ, tree_id=tid))
    try:
        # Read as every marker check reads it (an exec under way reads empty).
        env = procscan.environ(child.pid)
        assert env is not None
        entries = env.split(b"\0")
        assert f"{MARKER}={tid}".encode() in entries
        assert not any(e.startswith(b"AWS_") for e in entries)
    finally:
        child.send_signal(signal.SIGKILL)
        _wait(child)


# --------------------------------------------------------------------------
# Session, group, cgroup, signals


def _own_stat(out: bytes) -> tuple[int, int, int]:
    head, _, rest = out.decode().rpartition(")")
    f = rest.split()
    return int(head.split()[0]), int(f[2]), int(f[3])  # pid, pgrp, session


def test_own_session(leaf: Leaf | None) -> None:
    r, w = os.pipe()
    try:
        child = spawn(["cat", "/proc/self/stat"], env=_env(), stdout=w, cgroup=leaf)
        os.close(w)
        out = _read_all(r, 10)
    finally:
        os.close(r)
    assert _wait(child) == 0
    pid, pgrp, sid = _own_stat(out)
    assert pid == child.pid
    assert pgrp == pid and sid == pid


def test_own_group_in_the_callers_session(leaf: Leaf | None) -> None:
    r, w = os.pipe()
    try:
        child = spawn(
            ["cat", "/proc/self/stat"], env=_env(), stdout=w, cgroup=leaf, new_session=False
        )
        os.close(w)
        out = _read_all(r, 10)
    finally:
        os.close(r)
    assert _wait(child) == 0
    pid, pgrp, sid = _own_stat(out)
    assert pid == child.pid
    assert pgrp == pid
    assert sid == os.getsid(0) and sid != pid


def test_cgroup_from_the_first_instruction(leaf: Leaf | None) -> None:
    rc, out = run(["cat", "/proc/self/cgroup"], cgroup=leaf)
    assert rc == 0
    lines = out.decode().splitlines()
    v2 = [ln for ln in lines if ln.startswith("0::")]
    assert len(v2) == 1, lines
    if leaf is None:
        assert v2[0] == f"0::{own_cgroup()}"
    else:
        mount = v2_mount()
        assert mount is not None
        rel = os.path.relpath(leaf.path, mount)
        assert v2[0] == f"0::/{rel}", (v2, leaf.path)
        # The child is gone, and the leaf is empty again.
        assert leaf.wait_empty(5.0)


def test_through_the_stub_spawn_returns_with_the_child_in_its_leaf() -> None:
    """From a threaded process the child is not cloned into its leaf: a shell
    stub writes itself there after posix_spawn has returned. spawn returns
    only once it has -- a stop that reads the leaf at once finds it (before,
    under load, the leaf read empty and the child ran on outside it)."""
    try:
        Hierarchy.find()
    except CgroupUnavailable as e:
        pytest.skip(f"no cgroup leaf here: {e}")
    other = threading.Event()
    thread = threading.Thread(target=other.wait)  # a second thread: no clone into the leaf
    thread.start()
    try:
        with fresh_leaf() as leaf:
            for _ in range(20):
                child = spawn(["sleep", "60"], env=_env(), cgroup=leaf)
                try:
                    assert child.pid in leaf.pids()
                finally:
                    child.send_signal(signal.SIGKILL)
                    child.wait()
    finally:
        other.set()
        thread.join()


def test_cgroup_holds_what_the_child_starts(leaf: Leaf | None) -> None:
    """A grandchild that calls setsid and leaves is still in the leaf."""
    if leaf is None:
        pytest.skip("cgroup mode only")
    r, w = os.pipe()
    child = spawn(
        ["sh", "-c", "setsid sh -c 'echo $$; exec sleep 30' & wait"],
        env=_env(),
        stdout=w,
        cgroup=leaf,
    )
    os.close(w)
    try:
        line = b""
        deadline = time.monotonic() + 10
        while not line.endswith(b"\n") and time.monotonic() < deadline:
            if select.select([r], [], [], 0.5)[0]:
                line += os.read(r, 100)
        grandchild = int(line)
        assert grandchild in leaf.pids() and child.pid in leaf.pids()
        assert os.getsid(grandchild) == grandchild
    finally:
        os.close(r)
        leaf.kill()
        assert _wait(child) == -signal.SIGKILL
        assert leaf.wait_empty(5.0)


def test_signal_mask_and_dispositions_are_reset(leaf: Leaf | None) -> None:
    # The caller blocks one signal and ignores another; Python itself ignores
    # SIGPIPE. The child must start with nothing blocked and nothing ignored.
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    old_usr2 = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN
        rc, out = run(["grep", "-E", "^Sig(Blk|Ign):", "/proc/self/status"], cgroup=leaf)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        signal.signal(signal.SIGUSR2, old_usr2)
    assert rc == 0
    fields = dict(ln.split(":\t") for ln in out.decode().splitlines())
    assert int(fields["SigBlk"], 16) == 0, fields
    # glibc's posix_spawn leaves its two internal signals (32, 33: SIGCANCEL,
    # SIGSETXID) at SIG_IGN in every child it starts, past the exec; they are
    # outside signal.valid_signals() and out of this API's reach. Every signal
    # a program can name must be at its default.
    ignored = {n + 1 for n in range(64) if int(fields["SigIgn"], 16) >> n & 1}
    assert not ignored & set(signal.valid_signals()), ignored


# --------------------------------------------------------------------------
# Starts that cannot happen, and reaping


def _assert_nothing_started(leaf: Leaf | None, owned_before: frozenset[int]) -> None:
    assert owned_pids() == owned_before
    if leaf is not None:
        assert leaf.pids() == []


@pytest.mark.parametrize("name", ["hold-test-no-such-command", "/nonexistent/dir/prog"])
def test_missing_command_is_127(name: str, leaf: Leaf | None) -> None:
    owned = owned_pids()
    with pytest.raises(SpawnError) as info:
        spawn([name, "arg"], env=_env(), cgroup=leaf)
    assert info.value.exit_code == 127
    assert name in str(info.value) and "not found" in str(info.value)
    _assert_nothing_started(leaf, owned)


def test_command_not_on_the_childs_path_is_127(tmp_path: Path) -> None:
    # Resolved with the *child's* PATH, not the caller's.
    prog = tmp_path / "only-here"
    prog.write_text("#!/bin/sh\necho found\n")
    prog.chmod(0o755)
    with pytest.raises(SpawnError) as info:
        spawn(["only-here"], env=_env(PATH="/usr/bin:/bin"))
    assert info.value.exit_code == 127
    rc, out = run(["only-here"], env=_env(PATH=f"/usr/bin:{tmp_path}"))
    assert (rc, out) == (0, b"found\n")


def test_not_executable_is_126(tmp_path: Path, leaf: Leaf | None) -> None:
    script = tmp_path / "script"
    script.write_text("#!/bin/sh\necho ran\n")
    script.chmod(0o644)
    (tmp_path / "adir").mkdir()
    owned = owned_pids()
    for argv, env in (
        ([str(script)], _env()),
        (["script"], _env(PATH=str(tmp_path))),
        ([str(tmp_path / "adir")], _env()),
        (["adir"], _env(PATH=str(tmp_path))),
    ):
        with pytest.raises(SpawnError) as info:
            spawn(argv, env=env, cgroup=leaf)
        assert info.value.exit_code == 126, (argv, str(info.value))
        assert argv[0] in str(info.value)
        _assert_nothing_started(leaf, owned)


def test_no_command_is_refused() -> None:
    with pytest.raises(SpawnError) as info:
        spawn([], env=_env())
    assert info.value.exit_code == 2


def test_child_is_reaped_by_its_owner_only() -> None:
    child = spawn(["sh", "-c", "exit 7"], env=_env())
    assert child.pid in owned_pids()
    assert _wait(child) == 7
    assert child.pid not in owned_pids()
    assert child.poll() == 7 and child.wait() == 7  # repeatable, no second reap
    killed = spawn(["sleep", "30"], env=_env())
    assert killed.poll() is None
    killed.send_signal(signal.SIGTERM)
    assert _wait(killed) == -signal.SIGTERM
    killed.send_signal(signal.SIGKILL)  # after the reap: a no-op, never another process


# --------------------------------------------------------------------------
# Working directory


def test_cwd_is_entered_before_the_program_and_finds_relative_programs(tmp_path: Path) -> None:
    work = tmp_path / "work dir"
    work.mkdir()
    script = work / "show.sh"
    script.write_text("#!/bin/sh\npwd -P\n")
    script.chmod(0o755)
    code, out = run(["./show.sh"], cwd=str(work))
    assert (code, out.decode()) == (0, f"{work.resolve()}\n")


@pytest.mark.parametrize("pwd", [True, False])
def test_pwd_follows_cwd_only_if_the_caller_gave_one(tmp_path: Path, pwd: bool) -> None:
    env = _env()
    if pwd:
        env["PWD"] = "/somewhere/else"
    else:
        env.pop("PWD", None)
    show = "import os; print(os.getcwd()); print(os.environ.get('PWD', 'unset'))"
    code, out = run([sys.executable, "-c", show], env=env, cwd=str(tmp_path))
    assert code == 0
    assert out.decode().splitlines() == [str(tmp_path), str(tmp_path) if pwd else "unset"]


def test_a_missing_cwd_is_refused_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(SpawnError) as info:
        spawn(["true"], env=_env(), cwd=str(tmp_path / "none"))
    assert info.value.exit_code == 2 and "no such directory" in str(info.value)


def test_a_child_that_exits_at_once_is_never_reaped_as_an_orphan() -> None:
    """Children that exit at once, spawned while another thread reaps adopted
    orphans in a loop (a stack's loop does on each SIGCHLD, beside its units' job
    threads spawning readiness probes): each is reaped by its own Child, with its
    status, and spawn never fails. Before the spawned pids were written down
    under a lock, the reaper could take one for an orphan and reap it between
    the fork and the note (the spawn then failed with NoSuchProcess)."""
    from hold_supervisor.proc.reaper import reap_adopted

    env = minimal_env(os.environ, tree_id=f"t-reap-{uuid.uuid4().hex[:12]}")
    stop = threading.Event()

    def reap_all_the_time() -> None:
        while not stop.is_set():
            reap_adopted(owned_pids())

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads change places as often as they can
    reaper = threading.Thread(target=reap_all_the_time)
    reaper.start()
    problems: list[str] = []
    try:
        for _ in range(300):
            try:
                child = spawn(["/bin/sh", "-c", "exit 3"], env=env)
                code = child.wait()
            except Exception as e:
                problems.append(repr(e))
                continue
            if code != 3:
                problems.append(f"status {code}")
    finally:
        stop.set()
        reaper.join()
        sys.setswitchinterval(old)
    assert problems == []
