"""Every way out of ``hold run``, through the real CLI, with real processes.

Each test shows what ends and that nothing survives: the pids the programs
recorded are dead, nobody holds the file they held, the port they listened on
is free (and the autouse leak check adds that no descendant of pytest is left).
"""

from __future__ import annotations

import fcntl
import functools
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from conftest import HOLD, LOADED, PROGS, Pty, alive, as_user, unpriv_python, wait_for

from hold_supervisor.proc import scan

RUN_TREE = str(PROGS / "run_tree.py")


def hold_run(
    args: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    # stdin is never pytest's: on a terminal it would make every run interactive.
    return subprocess.run(
        [*HOLD, "run", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
        cwd=cwd,
        env=env,
    )


def read_pids(base: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in (base / "pids").read_text().splitlines():
        role, pid = line.split()
        out[role] = int(pid)
    return out


def assert_gone(pids: dict[str, int] | list[int], device: Path, port: int) -> None:
    """Nothing recorded lives, nobody holds ``device``, nobody listens on ``port``.

    Checked at once, without waiting: ``hold run`` has returned, and it
    returns only after its survivor check.
    """
    pids = list(pids.values()) if isinstance(pids, dict) else pids
    assert pids
    living = [pid for pid in pids if alive(pid)]
    assert not living, f"still alive: {living}"
    node = scan.node_of_stat(os.stat(device), str(device))
    assert scan.holders_of([node], scan.pids()) == {}
    assert port not in {ln.port for ln in scan.listeners().values()}
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free: binding it again works


def end(proc: subprocess.Popen[str] | subprocess.Popen[bytes]) -> None:
    """After a test failed early: let hold run stop its tree (SIGTERM), then make sure."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_file(path: Path, timeout: float = 15.0) -> str:
    return wait_for(lambda: path.exists() and path.read_text(), timeout, what=str(path))


# --------------------------------------------------------------------------
# COMMAND exits: the rest of its tree is stopped; the exit status is its own.


@pytest.mark.parametrize(
    ("how", "expect"),
    [(["--exit", "0"], 0), (["--exit", "42"], 42), (["--kill", str(int(signal.SIGUSR1))], 138)],
    ids=["exit-0", "exit-42", "killed-by-SIGUSR1"],
)
def test_command_exits_and_what_it_left_is_stopped(
    tmp_path: Path, cgroup_mode: str, how: list[str], expect: int
) -> None:
    res = hold_run(["-v", "--grace", "0.5s", "--", sys.executable, RUN_TREE, str(tmp_path), *how])
    assert res.returncode == expect, res.stderr
    pids = read_pids(tmp_path)
    assert set(pids) == {"main", "child", "escapee"}
    # The report: the TERM-ignoring child and the setsid escapee were found and killed.
    assert f"via {cgroup_mode}" in res.stderr
    assert "2 stopped, 2 killed" in res.stderr and "survivor check empty" in res.stderr, res.stderr
    assert_gone(pids, tmp_path / "device", int((tmp_path / "port").read_text()))
    if cgroup_mode == "cgroup":
        from hold_supervisor.proc.cgroup import Hierarchy

        tree = re.search(r"tree ([0-9a-f]+):", res.stderr)
        assert tree is not None
        base = Hierarchy.find().base
        assert not [n for n in os.listdir(base) if n.startswith(f"hold-{tree.group(1)}.")]


# --------------------------------------------------------------------------
# The time limit.


def test_time_limit_stops_a_term_ignoring_tree_with_124(tmp_path: Path, cgroup_mode: str) -> None:
    device, port_file, ready = tmp_path / "device", tmp_path / "port", tmp_path / "ready"
    device.write_text("")
    t0 = time.monotonic()
    res = hold_run(
        [
            "-t",
            "2s",
            "--grace",
            "0.5s",
            "--",
            sys.executable,
            str(PROGS / "nasty_tree.py"),
            str(device),
            str(port_file),
            str(ready),
            "--forkers",
            "1",
            "--sleepers",
            "1",
        ],
    )
    took = time.monotonic() - t0
    assert res.returncode == 124, res.stderr
    assert "time limit of 2s reached" in res.stderr and "stopped" in res.stderr
    # Everything ignores TERM, so the whole grace is used: 2 s + 0.5 s, plus
    # start-up and the kill, bounded.
    assert 2.5 <= took < 2.5 + LOADED, took
    pids = [int(line.split()[1]) for line in ready.read_text().splitlines()]
    roles = {line.split()[0] for line in ready.read_text().splitlines()}
    assert roles == {"main", "child", "escapee", "forker", "sleeper"}, roles
    assert_gone(pids, device, int(port_file.read_text()))


# --------------------------------------------------------------------------
# Signals to hold run: forwarded to the command, then the tree is stopped.


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT])
def test_signal_to_hold_run_is_forwarded_then_tree_stopped(
    tmp_path: Path, cgroup_mode: str, sig: signal.Signals
) -> None:
    proc = subprocess.Popen(
        [
            *HOLD,
            "run",
            "-v",
            "--grace",
            "0.5s",
            "--",
            sys.executable,
            RUN_TREE,
            str(tmp_path),
            "--handle",
            "--stay",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_file(tmp_path / "ready")
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=20)
    finally:
        end(proc)
    # The command saw the very signal, and its own exit status is hold run's.
    assert (tmp_path / "got").read_text() == f"{int(sig)}\n"
    assert proc.returncode == 100 + sig, err
    # main took the signal and exited; the child and the escapee ignore it
    # and were killed after the grace.
    assert "3 stopped, 2 killed" in err and f"of {sig.name}" in err, err
    assert "survivor check empty" in err, err
    assert_gone(read_pids(tmp_path), tmp_path / "device", int((tmp_path / "port").read_text()))


# --------------------------------------------------------------------------
# An interactive shell under hold run, in a real terminal.


def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()  # [0] is field 3 (state)


def test_interactive_shell_keeps_the_terminal_and_ctrl_c(tmp_path: Path, cgroup_mode: str) -> None:
    bash = shutil.which("bash")
    shell = [bash, "--norc", "--noprofile", "--noediting", "-i"] if bash else ["sh", "-i"]
    # A non-interactive sh leads the terminal's session and runs hold run in
    # its own (foreground) process group, as a login shell's script would; after
    # hold run it reports the status and who has the terminal, and reads from it.
    script = (
        shlex.join([*HOLD, "run", "--grace", "1s", "--", *shell])
        + '; echo "RC=$?"; read _ _ _ _ pg _ _ tp _ < /proc/$$/stat; echo "BACK $pg $tp";'
        + ' read line; echo "GOT $line"'
    )
    master, slave = os.openpty()

    def take_terminal() -> None:
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    env = {**os.environ, "TERM": "dumb"}
    proc = subprocess.Popen(
        ["/bin/sh", "-c", script],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
        preexec_fn=take_terminal,
    )
    os.close(slave)
    term = Pty(master)
    try:
        # The shell is in its own process group, and that group has the terminal.
        term.write('read _ _ _ pp pg _ _ tp _ < /proc/$$/stat; echo "FG $$ $pp $pg $tp"\n')
        m = term.expect(r"FG (\d+) (\d+) (\d+) (\d+)$")
        shell_pid, hold_pid, pgrp, tpgid = map(int, m.groups())
        assert pgrp == shell_pid == tpgid
        parent = int(_stat_fields(hold_pid)[1])
        if cgroup_mode == "walk":  # hold run went on below its keeper, sh's child
            assert Path(f"/proc/{parent}/comm").read_text().strip() == "hold-keeper"
            assert int(_stat_fields(parent)[1]) == proc.pid
            assert int(_stat_fields(parent)[2]) == proc.pid  # the keeper in sh's group too
        else:
            assert parent == proc.pid  # hold run is sh's child...
        assert int(_stat_fields(hold_pid)[2]) == proc.pid != pgrp  # ...in sh's group
        assert "no job control" not in term.text and "process group" not in term.text

        # Ctrl-C interrupts the foreground job only: the shell and hold run live on.
        term.write("sleep 30\n")

        def sleeper() -> int | None:
            for st in scan.snapshot().values():
                if st.ppid == shell_pid and st.comm == "sleep" and not st.is_dead:
                    return st.pid
            return None

        sleep_pid = wait_for(sleeper, 10, what="sleep 30 in the shell")
        fields = _stat_fields(sleep_pid)
        assert fields[2] == fields[5]  # the job has the terminal (pgrp == tpgid)
        term.write("\x03")
        wait_for(lambda: not alive(sleep_pid), 20, what="Ctrl-C to end sleep 30")
        term.write('echo "al""ive $$"\n')
        term.expect(rf"alive {shell_pid}$")
        assert proc.poll() is None and alive(hold_pid) and alive(shell_pid)

        # exit 7 ends hold run with 7, and the terminal is handed back to sh's
        # group: sh can read from it again.
        term.write("exit 7\n")
        term.expect(r"RC=7$")
        back = term.expect(r"BACK (\d+) (\d+)$")
        assert int(back.group(1)) == int(back.group(2)) == proc.pid
        term.write("hello\n")
        term.expect(r"GOT hello$")
        assert proc.wait(timeout=10) == 0
        assert not alive(hold_pid) and not alive(shell_pid)
    finally:
        if proc.poll() is None:
            # Ours, by pid: every process still in the terminal's session.
            for st in scan.snapshot().values():
                if st.session == proc.pid and not st.is_dead:
                    os.kill(st.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        os.close(master)


# --------------------------------------------------------------------------
# Bad input: exit 2, a message naming the value, and nothing started.


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["-t", "5x"], "'5x'"),
        (["-t", "0"], "'0'"),
        (["--cpus", "0-"], "'0-'"),
        (["--cpus", "9999"], "'9999'"),
        (["--cpus", ""], "''"),
        (["--grace", "abc"], "'abc'"),
        (["--env", "NOEQUALS"], "'NOEQUALS'"),
        (["--signal", "KILL"], "'KILL'"),
        (["--bogus"], "--bogus"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_bad_option_is_refused_before_anything_starts(
    tmp_path: Path, args: list[str], named: str
) -> None:
    res = hold_run([*args, "--", "touch", "marker"], cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert named in res.stderr, res.stderr
    assert not (tmp_path / "marker").exists()
    assert res.stdout == ""


def test_empty_command_is_refused(tmp_path: Path) -> None:
    for args in (["--"], ["-t", "1m", "--"], []):
        res = hold_run(args, cwd=tmp_path)
        assert res.returncode == 2, res.stderr
        assert "no command given" in res.stderr


def test_bad_config_file_is_refused_naming_file_and_line(
    tmp_path: Path, isolated_hold: Path
) -> None:
    config = isolated_hold / "config.yaml"
    config.write_text("cgroups: off\nbogus: 1\n")
    res = hold_run(["--", "touch", "marker"], cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert f"{config}:2" in res.stderr and "'bogus'" in res.stderr, res.stderr
    assert not (tmp_path / "marker").exists()


def test_missing_command_is_127_and_non_executable_126(tmp_path: Path) -> None:
    res = hold_run(["--", "no-such-command-hold-test", "arg"])
    assert res.returncode == 127, res.stderr
    assert "no-such-command-hold-test: command not found" in res.stderr
    plain = tmp_path / "not-executable"
    plain.write_text("#!/bin/sh\ntouch marker\n")
    plain.chmod(0o644)
    res = hold_run(["--", str(plain)], cwd=tmp_path)
    assert res.returncode == 126, res.stderr
    assert f"{plain}: not executable" in res.stderr
    assert not (tmp_path / "marker").exists()


# --------------------------------------------------------------------------
# What the command gets: its CPU mask and its environment.


def test_cpus_are_applied(cgroup_mode: str) -> None:
    cpu = max(os.sched_getaffinity(0))
    res = hold_run(["--cpus", str(cpu), "--", "grep", "Cpus_allowed_list", "/proc/self/status"])
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["Cpus_allowed_list:", str(cpu)]


def test_env_and_pass_env_and_nothing_else(cgroup_mode: str) -> None:
    parent = {
        **os.environ,
        "AWS_SECRET_ACCESS_KEY": "s3cret",
        "HOLD_TEST_PASSED": "yes",
        "HOLD_TEST_NOT_PASSED": "no",
        "LC_HOLD_TEST": "lc",
    }
    res = hold_run(
        [
            "-e",
            "A=1",
            "--env",
            "B=x=y",
            "--env",
            "EMPTY=",
            "--pass-env",
            "HOLD_TEST_PASSED",
            "--",
            "env",
        ],
        env=parent,
    )
    assert res.returncode == 0, res.stderr
    seen = dict(line.split("=", 1) for line in res.stdout.splitlines())
    assert seen["A"] == "1" and seen["B"] == "x=y" and seen["EMPTY"] == ""
    assert seen["HOLD_TEST_PASSED"] == "yes" and seen["LC_HOLD_TEST"] == "lc"
    assert re.fullmatch(r"[0-9a-f]+", seen["HOLD_TREE"])
    assert "AWS_SECRET_ACCESS_KEY" not in seen and "s3cret" not in res.stdout
    # Exactly the allowlist, what was named, and the marker: nothing of the
    # parent's (HOLD_CONFIG, PYTEST_CURRENT_TEST, ...), nothing added on the way.
    allowed = {"PATH", "HOME", "LANG", "TERM", "USER", "TZ", "A", "B", "EMPTY"}
    allowed |= {"HOLD_TEST_PASSED", "HOLD_TREE"}
    extra = {k for k in seen if k not in allowed and not k.startswith("LC_")}
    assert not extra, extra
    for name in ("PATH", "HOME", "LANG", "TERM", "USER", "TZ"):
        assert seen.get(name) == os.environ.get(name)


# --------------------------------------------------------------------------
# As an ordinary user: no writable cgroup, so the walk; and what cannot be killed.


def shared_dir(tmp_path: Path, user: str) -> Path:
    """A directory under ``tmp_path`` that ``user`` may write.

    Also hands the test's state directory (``HOLD_STATE_DIR``, where hold run
    autostarts its daemon, which the fixtures stop afterwards) to ``user``.
    """
    for p in [tmp_path, *tmp_path.parents]:
        if p == Path("/"):
            break
        os.chmod(p, os.stat(p).st_mode | 0o055)
    pw = pwd.getpwnam(user)
    state = Path(os.environ["HOLD_STATE_DIR"])
    state.mkdir(mode=0o700)
    os.chown(state, pw.pw_uid, pw.pw_gid)
    work = tmp_path / "shared"
    work.mkdir()
    work.chmod(0o777)
    return work


@functools.cache
def user_python(user: str, runtime: Path) -> str:
    """A Python that ``user`` may run through :func:`as_user` (that is, via ``env -i``).

    conftest's ``unpriv_python`` checks by having setpriv exec the interpreter
    directly; here that passes for a path under /root (0700) that the user
    cannot reach once ``env`` execs it, so check the way the tests run it.
    """
    for cand in (unpriv_python(), "/usr/bin/python3"):
        ok = subprocess.run(
            as_user(user, [cand, "-c", "import hold.cli.run"], runtime, {}),
            capture_output=True,
            timeout=30,
        )
        if ok.returncode == 0:
            return cand
    pytest.skip(f"no Python here that {user} may run with the copied runtime")


def test_unprivileged_default_config_walks_and_stops_an_escapee(
    tmp_path: Path, unpriv_user: str, unpriv_runtime: Path
) -> None:
    if os.path.exists("/etc/hold/config.yaml"):
        pytest.skip("/etc/hold/config.yaml exists: not the embedded defaults")
    work = shared_dir(tmp_path, unpriv_user)
    py = user_python(unpriv_user, unpriv_runtime)
    prog = str(unpriv_runtime / "progs" / "run_tree.py")
    argv = [
        py,
        "-m",
        "hold",
        "run",
        "-v",
        "--grace",
        "0.5s",
        "--",
        py,
        prog,
        str(work),
        "--exit",
        "5",
    ]
    # No HOLD_CONFIG, and an empty XDG_CONFIG_HOME: the defaults (cgroups: auto).
    env = {"XDG_CONFIG_HOME": str(work / "xdg"), "HOLD_STATE_DIR": os.environ["HOLD_STATE_DIR"]}
    res = subprocess.run(
        as_user(unpriv_user, argv, unpriv_runtime, env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
        cwd=work,
    )
    assert res.returncode == 5, res.stderr
    assert "via walk" in res.stderr and "survivor check empty" in res.stderr, res.stderr
    assert "2 stopped, 2 killed" in res.stderr, res.stderr
    pids = read_pids(work)
    uid = pwd.getpwnam(unpriv_user).pw_uid
    assert os.stat(work / "pids").st_uid == uid  # it really ran as the user
    assert_gone(pids, work / "device", int((work / "port").read_text()))


def test_unprivileged_cgroups_required_is_refused(
    tmp_path: Path, unpriv_user: str, unpriv_runtime: Path
) -> None:
    work = shared_dir(tmp_path, unpriv_user)
    config = work / "config.yaml"
    config.write_text("cgroups: required\n")
    config.chmod(0o644)
    env = {"HOLD_CONFIG": str(config), "HOLD_STATE_DIR": os.environ["HOLD_STATE_DIR"]}
    argv = [user_python(unpriv_user, unpriv_runtime), "-m", "hold", "run", "--", "touch", "marker"]
    res = subprocess.run(
        as_user(unpriv_user, argv, unpriv_runtime, env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
        cwd=work,
    )
    assert res.returncode == 2, res.stderr
    assert "cgroups: required, but" in res.stderr and "not writable" in res.stderr, res.stderr
    assert not (work / "marker").exists()


# The process that cannot be killed: started from the tree, so it is found
# (its group, session and descent are readable by anyone), but it makes itself
# root through a setuid-root copy of Python that only the test user's group
# may run, so the user's hold run may not signal it.


def test_survivor_that_cannot_be_killed_is_named_with_exit_3(
    tmp_path: Path, unpriv_user: str, unpriv_runtime: Path
) -> None:
    work = shared_dir(tmp_path, unpriv_user)
    config = work / "config.yaml"
    config.write_text("cgroups: off\n")
    config.chmod(0o644)
    gid = pwd.getpwnam(unpriv_user).pw_gid
    suid_dir = tmp_path / "suid"
    suid_dir.mkdir(mode=0o750)
    os.chown(suid_dir, 0, gid)
    if os.statvfs(suid_dir).f_flag & os.ST_NOSUID:
        pytest.skip(f"{suid_dir} is on a nosuid file system")
    suid_py = suid_dir / "python"
    py = user_python(unpriv_user, unpriv_runtime)
    shutil.copy(os.path.realpath(py), suid_py)
    os.chown(suid_py, 0, gid)
    os.chmod(suid_py, 0o4750)
    pidfile, shpid = work / "survivor.pid", work / "sh.pid"
    script = 'echo $$ > "$2"; "$0" -I "$1" "$3" & exec sleep 60'
    prog = unpriv_runtime / "progs" / "unkillable_root.py"
    argv = [
        py,
        "-m",
        "hold",
        "run",
        "--grace",
        "0.5s",
        "--",
        "sh",
        "-c",
        script,
        str(suid_py),
        str(prog),
        str(shpid),
        str(pidfile),
    ]
    env = {"HOLD_CONFIG": str(config), "HOLD_STATE_DIR": os.environ["HOLD_STATE_DIR"]}
    # Output to a file, not a pipe: the survivor keeps hold run's stderr open,
    # so a pipe would never reach end of file.
    errfile = tmp_path / "stderr"
    with open(errfile, "w") as errf:
        proc = subprocess.Popen(
            as_user(unpriv_user, argv, unpriv_runtime, env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=errf,
            cwd=work,
        )
    survivor: int | None = None
    try:
        try:
            survivor = int(wait_file(pidfile))
        except AssertionError:
            raise AssertionError(f"no survivor; hold run said: {errfile.read_text()}") from None
        with open(f"/proc/{survivor}/status") as f:
            assert re.search(r"^Uid:\s+0\s+0\s+0\s+0$", f.read(), re.M)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        err = errfile.read_text()
        assert proc.returncode == 3, err
        assert "1 SURVIVED" in err and re.search(rf"pid {survivor} \([a-z+]+\): ", err), err
        assert alive(survivor)  # as reported
        # The rest of the tree (the sleep that sh became) was stopped.
        assert not alive(int(shpid.read_text()))
    finally:
        end(proc)
        if survivor is not None and alive(survivor):
            os.kill(survivor, signal.SIGKILL)
            wait_for(lambda: not alive(survivor), 20, what="the survivor to die")
        suid_py.unlink()
