"""Process identity: (pid, start time); a stale or reused pid is never signalled."""

from __future__ import annotations

import json
import os
import pwd
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import alive, as_user, unpriv_python, wait_for

from hold_supervisor.proc import scan as procscan
from hold_supervisor.proc.cgroup import within
from hold_supervisor.proc.identity import (
    Handle,
    NoSuchProcess,
    ProcessId,
    read_cmdline,
    read_stat,
    user_name,
)


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A live process of ours that each test can aim at (and must leave unharmed),
    its exec done: Popen returns as the exec begins (close-on-exec), and until
    it ends /proc shows neither its command line nor its environment."""
    p = subprocess.Popen(["sleep", "60"])
    try:
        wait_for(lambda: read_stat(p.pid).comm == "sleep", 10, what="sleep's exec done")
        wait_for(lambda: not read_stat(p.pid).in_exec, 10, what="sleep's exec done")
        yield p
    finally:
        p.kill()
        p.wait(timeout=10)


def unharmed(p: subprocess.Popen[bytes]) -> bool:
    """Was nothing fatal sent to ``p`` so far? Asked by stopping it: once a
    fatal signal has been sent, the kernel drops a SIGSTOP (the process is
    exiting), so it either stops (unharmed) or dies. Continued afterwards."""

    def state() -> str:
        st = procscan.stat_of(p.pid)
        return "gone" if st is None else st.state

    os.kill(p.pid, signal.SIGSTOP)
    try:
        seen = wait_for(
            lambda: (s := state()) in ("T", "Z", "X", "gone") and s,
            10,
            what=f"{p.pid} to stop or die",
        )
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
    return seen == "T"


def _free_pid() -> int:
    """A pid that names no process now (one of ours, just reaped)."""
    p = subprocess.Popen(["true"])
    p.wait(timeout=10)
    return p.pid


def test_of_reads_the_start_time_of_that_process(sleeper: subprocess.Popen[bytes]) -> None:
    ident = ProcessId.of(sleeper.pid)
    with open(f"/proc/{sleeper.pid}/stat") as f:
        field22 = int(f.read().rsplit(")", 1)[1].split()[19])
    assert ident == ProcessId(sleeper.pid, field22)
    assert ident.matches() and ident.is_running()
    assert str(ident) == f"{sleeper.pid}@{field22}"
    assert read_stat(sleeper.pid).ppid == os.getpid()
    assert read_cmdline(sleeper.pid) == "sleep 60"


def test_stale_start_time_is_never_signalled(sleeper: subprocess.Popen[bytes]) -> None:
    real = ProcessId.of(sleeper.pid)
    for stale in (ProcessId(real.pid, real.starttime - 1), ProcessId(real.pid, real.starttime + 1)):
        assert not stale.matches()
        assert not stale.is_running()
        with pytest.raises(NoSuchProcess, match="reused"):
            stale.send_signal(signal.SIGKILL)
        with pytest.raises(NoSuchProcess):
            stale.open()
    # The live process that owns the number was not touched.
    assert unharmed(sleeper)
    assert sleeper.poll() is None and alive(sleeper.pid)
    assert real.is_running()


def test_gone_process_is_no_such_process() -> None:
    ident = ProcessId.of(os.getpid())
    gone = ProcessId(_free_pid(), ident.starttime)
    with pytest.raises(NoSuchProcess):
        ProcessId.of(gone.pid)
    with pytest.raises(NoSuchProcess):
        gone.send_signal(0)
    assert not gone.matches() and not gone.is_running()
    with pytest.raises(NoSuchProcess):
        read_cmdline(gone.pid)


def test_zombie_matches_but_is_not_running() -> None:
    p = subprocess.Popen(["true"])
    ident = ProcessId.of(p.pid)
    wait_for(lambda: read_stat(p.pid).is_dead, what="the child to become a zombie")
    assert ident.matches()  # the number is still this process's until reaped
    assert not ident.is_running()
    p.wait(timeout=10)
    assert not ident.matches()


def test_comm_with_parentheses_and_spaces(tmp_path: Path) -> None:
    # comm is chosen by the process and may contain ") " and "(", the
    # characters a naive split of /proc/PID/stat would trip over.
    name = "a) b (c) 1 2"
    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"open('/proc/self/comm','w').write({name!r});"
            "print('ok', flush=True); import time; time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert p.stdout is not None
        assert select.select([p.stdout], [], [], 10)[0], "the child never said ok"
        assert p.stdout.readline() == b"ok\n"
        st = read_stat(p.pid)
        assert st.comm == name[:15]  # the kernel keeps 15 characters
        assert st.ppid == os.getpid()
        assert st.pgrp == p.pid and st.session == p.pid
        assert st.state in ("S", "R")
        assert ProcessId.of(p.pid).starttime >= ProcessId.of(os.getpid()).starttime
    finally:
        p.kill()
        p.wait(timeout=10)
        assert p.stdout is not None
        p.stdout.close()


def _write_ns_last_pid(value: int) -> bool:
    try:
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(value))
        return True
    except OSError:
        return False


def test_real_pid_reuse_is_never_signalled() -> None:
    """Force the kernel to hand a dead process's pid to a new one, then aim at the old."""
    with open("/proc/sys/kernel/ns_last_pid") as f:
        last = int(f.read())
    if not _write_ns_last_pid(last):
        pytest.skip("cannot write /proc/sys/kernel/ns_last_pid (needs CAP_SYS_ADMIN)")
    old_proc = subprocess.Popen(["sleep", "60"])
    old = ProcessId.of(old_proc.pid)
    pinned = Handle.open(old)  # a pidfd opened while the old process lived
    try:
        # Start times are in clock ticks (since boot): wait until the clock is
        # past the old one's tick, or the new process could share its start
        # time and be indistinguishable.
        tick = os.sysconf("SC_CLK_TCK")
        wait_for(
            lambda: time.clock_gettime(time.CLOCK_BOOTTIME) * tick >= old.starttime + 2,
            what="the clock to pass the old start time",
        )
        old_proc.kill()
        old_proc.wait(timeout=10)
        new_proc: subprocess.Popen[bytes] | None = None
        # Other processes on the machine may take the number first: retry.
        for _ in range(100):
            assert _write_ns_last_pid(old.pid - 1)
            cand = subprocess.Popen(["sleep", "60"])
            if cand.pid == old.pid:
                new_proc = cand
                break
            cand.kill()
            cand.wait(timeout=10)
        if new_proc is None:
            pytest.skip(f"pid {old.pid} was taken by someone else on every try")
        try:
            new = ProcessId.of(new_proc.pid)
            assert new.pid == old.pid and new.starttime != old.starttime
            assert not old.matches() and not old.is_running()
            with pytest.raises(NoSuchProcess):
                old.send_signal(signal.SIGKILL)
            with pytest.raises(NoSuchProcess):
                old.open()
            # The pidfd opened on the old process still names only the old one.
            with pytest.raises(NoSuchProcess):
                pinned.send_signal(signal.SIGKILL)
            assert unharmed(new_proc)
            assert new_proc.poll() is None and new.is_running()
            # ...while the right identity does reach it.
            new.send_signal(signal.SIGTERM)
            assert new_proc.wait(timeout=10) == -signal.SIGTERM
        finally:
            new_proc.kill()
            new_proc.wait(timeout=10)
    finally:
        pinned.close()
        if old_proc.poll() is None:
            old_proc.kill()
            old_proc.wait(timeout=10)


def _user_python(user: str, runtime: Path) -> str:
    """A Python that ``user`` may run *through* :func:`as_user` (via ``env -i``).

    conftest's ``unpriv_python`` checks with setpriv exec'ing the interpreter
    directly, which here succeeds for a path under /root (0700) that the same
    user cannot reach through ``env``; so check the way the tests run it.
    """
    for cand in (unpriv_python(), "/usr/bin/python3"):
        ok = subprocess.run(
            as_user(user, [cand, "-c", "import hold_supervisor.proc.identity"], runtime, {}),
            capture_output=True,
            timeout=30,
        )
        if ok.returncode == 0:
            return cand
    pytest.skip(f"no Python here that {user} may run with the copied runtime")


# The script the unprivileged user runs: it aims at processes it names and
# reports, for each, which exception it got.
_PROBE = r"""
import json, signal, sys
from hold_supervisor.proc.identity import AccessDenied, NoSuchProcess, ProcessId
out = {}
for name, pid, start in json.loads(sys.argv[1]):
    try:
        ProcessId(pid, start).send_signal(signal.SIGTERM)
        out[name] = "signalled"
    except AccessDenied as e:
        out[name] = "AccessDenied: " + str(e)
    except NoSuchProcess as e:
        out[name] = "NoSuchProcess: " + str(e)
print(json.dumps(out))
"""


def test_no_such_process_and_access_denied_are_distinct(
    unpriv_user: str, unpriv_runtime: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    root_proc = ProcessId.of(sleeper.pid)
    assert os.stat(f"/proc/{sleeper.pid}").st_uid == 0
    # A process of the unprivileged user's own, which it may signal.
    own = subprocess.Popen(as_user(unpriv_user, ["sleep", "60"], unpriv_runtime, {}))
    try:
        # setpriv and env exec in place: wait until the pid runs sleep itself.
        wait_for(lambda: read_cmdline(own.pid) == "sleep 60", what="the user's sleep")
        own_id = ProcessId.of(own.pid)
        targets = [
            ("root", root_proc.pid, root_proc.starttime),
            ("root_stale", root_proc.pid, root_proc.starttime + 1),
            ("gone", _free_pid(), root_proc.starttime),
            ("own", own_id.pid, own_id.starttime),
        ]
        python = _user_python(unpriv_user, unpriv_runtime)
        res = subprocess.run(
            as_user(unpriv_user, [python, "-c", _PROBE, json.dumps(targets)], unpriv_runtime, {}),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout)
        assert out["root"].startswith("AccessDenied"), out
        assert out["root_stale"].startswith("NoSuchProcess"), out
        assert out["gone"].startswith("NoSuchProcess"), out
        assert out["own"] == "signalled", out
        assert own.wait(timeout=10) == -signal.SIGTERM
        # The root process it was denied is unharmed.
        assert sleeper.poll() is None and root_proc.is_running()
    finally:
        own.kill()
        own.wait(timeout=10)


def test_stat_of_is_read_stat_or_none(sleeper: subprocess.Popen[bytes]) -> None:
    """One reader of /proc/PID/stat: read_stat raises, procscan.stat_of says None."""
    st = procscan.stat_of(sleeper.pid)
    assert st is not None
    assert st._replace(state="S") == read_stat(sleeper.pid)._replace(state="S")  # running or not
    gone = _free_pid()
    with pytest.raises(NoSuchProcess):
        read_stat(gone)
    assert procscan.stat_of(gone) is None


def test_ancestors_live_and_from_a_snapshot_agree() -> None:
    """The same processes (pid and start time): their state may change between
    the two reads (a parent that runs, then sleeps)."""
    live = [(st.pid, st.starttime) for st in procscan.ancestors(os.getpid())]
    assert live and live[0][0] == os.getppid()
    snap = procscan.ancestors(os.getpid(), procscan.snapshot())
    assert [(st.pid, st.starttime) for st in snap] == live
    assert procscan.ancestors(os.getpid(), {}) == []


def test_fds_lists_this_process_descriptors(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_RDONLY | os.O_CLOEXEC)
    try:
        mine = dict(procscan.fds("self"))
        assert os.readlink(mine[fd]) == str(tmp_path / "f")
        assert dict(procscan.fds(os.getpid())).keys() >= {0, 1, 2, fd}
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        procscan.fds(_free_pid())


def test_user_name() -> None:
    assert user_name(0) == "root"
    unknown = next(u for u in range(2**31 - 2, 0, -1) if not _has_name(u))
    assert user_name(unknown) == str(unknown)


def _has_name(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def test_within_is_by_whole_components() -> None:
    assert within("/sys/fs/cgroup/a/b", "/sys/fs/cgroup/a/b")
    assert within("/sys/fs/cgroup/a/b/call-1", "/sys/fs/cgroup/a/b")
    assert not within("/sys/fs/cgroup/a/b-2", "/sys/fs/cgroup/a/b")
    assert not within("/sys/fs/cgroup/a", "/sys/fs/cgroup/a/b")


def test_the_environment_is_read_after_an_execve_under_way() -> None:
    """Between the two halves of an execve a process's environment reads empty
    (its new memory has none placed yet), though its parent may already have
    seen the exec succeed; a marker read then was missed, and a stop missed a
    member just spawned (seen under load). And an exec found done is not
    enough: in a chain of execs the next may begin before the read that
    follows. Read over and over for 3 s while children exec ``env`` thirty
    times each, every read finds the marker. A plain read of /proc/PID/environ
    in the same loop misses in nearly every run; a read that trusted the first
    look after an exec missed about 1 read in 2,000 beside two busy loops (1 in
    53 once on a 16-core host)."""
    entry = b"HOLD_TREE=t-execwindow"
    env = {"PATH": os.environ["PATH"], "HOLD_TREE": "t-execwindow"}
    chain = [shutil.which("env") or "/usr/bin/env"] * 30 + ["sleep", "60"]
    reads = missed = chains = 0
    until = time.monotonic() + 3
    while chains < 5 or time.monotonic() < until:
        child = subprocess.Popen(chain, env=env)
        chains += 1
        try:
            deadline = time.monotonic() + 10
            while True:
                reads += 1
                missed += not procscan.environ_has(child.pid, entry)
                st = procscan.stat_of(child.pid)
                assert st is not None
                if st.comm == "sleep" and not st.in_exec:
                    break
                if time.monotonic() > deadline:
                    pytest.fail("the chain of execs did not reach sleep in 10 s")
            reads += 1
            missed += not procscan.environ_has(child.pid, entry)
            assert procscan.environ_value(child.pid, b"HOLD_TREE") == "t-execwindow"
        finally:
            child.kill()
            child.wait(timeout=10)
    assert missed == 0, f"{missed} of {reads} reads missed the marker ({chains} chains)"


def test_a_process_with_no_environment_is_not_taken_for_one_in_exec() -> None:
    """``env -i``: an empty environment that no exec will fill. Its stat places
    the environment (empty) in memory, so it is not waited for as an exec under
    way, and it reads empty."""
    p = subprocess.Popen(["env", "-i", "sleep", "60"])
    try:

        def asleep() -> bool:
            st = procscan.stat_of(p.pid)
            return st is not None and st.comm == "sleep" and st.state == "S"

        wait_for(asleep, what="env -i to exec sleep")
        st = procscan.stat_of(p.pid)
        assert st is not None and st.env_end != 0 and not st.in_exec
        assert procscan.environ(p.pid) == b""
        assert procscan.environ_has(p.pid, b"PATH=/usr/bin") is False
    finally:
        p.kill()
        p.wait(timeout=10)
