"""Walk mode (no cgroup leaf): nothing outlives a SIGKILLed launcher either.

The escapee (``tests/progs/bare_escapee.py``) leaves the command's session by
a double fork and ``execve``s with an empty environment: no marker, no file,
no port; only the subreaper it is re-parented to knows it. Without a keeper,
a ``kill -9`` of the launcher hands it to init and it lives on (issue 23);
here either process of the pair is SIGKILLed -- the keeper (the pid the shell
knows) or the launcher below it -- and the whole tree must be gone within the
grace.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import shutil
import signal
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from conftest import HOLD, LOADED, PROGS, Pty, alive, update_config, wait_for

from hold_supervisor.proc import scan

NPU_HOLD = str(Path(sys.executable).parent / "npu-hold")
PY = sys.executable
ESCAPEE = str(PROGS / "bare_escapee.py")
GONE_WITHIN = 1.0 + LOADED  # the 1 s grace, and a loaded machine


@pytest.fixture(autouse=True)
def walk_mode(isolated_hold: Path) -> None:
    update_config(isolated_hold, cgroups="off")


def _ready(path: Path) -> dict[str, int]:
    wait_for(path.exists, 30, what="the command and its escapee")
    return {k: int(v) for k, v in (line.split() for line in path.read_text().splitlines())}


def _launcher_of(keeper: int) -> int:
    (pid,) = [st.pid for st in scan.snapshot().values() if st.ppid == keeper]
    return pid


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def _all_gone(pids: list[int]) -> None:
    wait_for(lambda: not any(alive(p) for p in pids), GONE_WITHIN, what=f"{pids} to end")


@pytest.mark.parametrize("victim", ["launcher", "keeper"])
@pytest.mark.parametrize("how", ["npu-hold", "hold run"])
def test_sigkill_of_either_leaves_nothing(tmp_path: Path, how: str, victim: str) -> None:
    ready = tmp_path / "ready"
    cmd = [NPU_HOLD] if how == "npu-hold" else [*HOLD, "run"]
    proc = subprocess.Popen(
        [*cmd, "--grace", "1s", "--", PY, ESCAPEE, str(ready)],
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        got = _ready(ready)
        launcher = _launcher_of(proc.pid)
        assert _comm(proc.pid) == "hold-keeper"
        # The name was the keeper's before the fork; the launcher took back its own.
        started_as = "npu-hold" if how == "npu-hold" else Path(sys.executable).name[:15]
        assert _comm(launcher) == started_as
        assert alive(got["escapee"]) and scan.stat_of(got["escapee"]).ppid == launcher  # type: ignore[union-attr]
        os.kill(launcher if victim == "launcher" else proc.pid, signal.SIGKILL)
        _all_gone([got["command"], got["escapee"], launcher])
        code = proc.wait(GONE_WITHIN)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The keeper killed: the shell sees that. The launcher killed: the keeper
    # ends the tree and says how the launcher ended (128+9, as a shell would).
    assert code == (-signal.SIGKILL if victim == "keeper" else 128 + signal.SIGKILL)


def test_the_keeper_passes_on_the_commands_status(tmp_path: Path) -> None:
    res = subprocess.run(
        [*HOLD, "run", "--", "sh", "-c", "exit 7"], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 7, res.stderr


def test_a_time_limit_still_stops_the_escapee(tmp_path: Path) -> None:
    """The launcher's own stop (no kill of anyone) finds the escapee re-parented to it."""
    ready = tmp_path / "ready"
    # 8 s: the limit must outlast the command's start-up and its escapee's (2 s ran
    # out before them beside two busy loops and four suites).
    proc = subprocess.Popen(
        [*HOLD, "run", "-t", "8s", "--grace", "1s", "--", PY, ESCAPEE, str(ready)],
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    got = _ready(ready)
    assert proc.wait(30) == 124, proc.stderr.read() if proc.stderr else ""
    _all_gone([got["command"], got["escapee"]])


@pytest.mark.parametrize("victim", ["launcher", "keeper"])
def test_sigkill_of_hold_up_leaves_nothing(tmp_path: Path, victim: str) -> None:
    ready = tmp_path / "ready"
    stack = tmp_path / "stack.yaml"
    stack.write_text(
        "name: kept\nunits:\n"
        f"  job:\n    cmd: [{PY}, {ESCAPEE}, {ready}]\n    stop: {{grace: 1s}}\n"
    )
    err = tmp_path / "up.stderr"
    with open(err, "w") as out:
        proc = subprocess.Popen(
            [*HOLD, "up", str(stack)], stdin=subprocess.DEVNULL, stdout=out, stderr=out
        )
    try:
        got = _ready(ready)
        launcher = _launcher_of(proc.pid)
        assert _comm(proc.pid) == "hold-keeper", err.read_text()
        os.kill(launcher if victim == "launcher" else proc.pid, signal.SIGKILL)
        _all_gone([got["command"], got["escapee"], launcher])
        proc.wait(GONE_WITHIN)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ctrl_z_stops_the_job_and_fg_continues_it(tmp_path: Path) -> None:
    """Job control through the keeper: an interactive bash runs ``hold run --
    sleep 30`` (walk mode, so hold run is the launcher below a keeper, and the
    command has the terminal). Ctrl-Z stops the command; the launcher stops
    itself and the keeper mirrors it, so bash sees the job stopped; ``fg``
    continues all three; Ctrl-C ends the command, and the job's status is 130."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash here")
    master, slave = os.openpty()

    def take_terminal() -> None:
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    shell = subprocess.Popen(
        [bash, "--norc", "--noprofile", "--noediting", "-i"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**os.environ, "TERM": "dumb", "PS1": "$ "},
        start_new_session=True,
        preexec_fn=take_terminal,
    )
    os.close(slave)
    term = Pty(master)
    try:
        term.write(f"{shlex.join([*HOLD, 'run', '--grace', '1s', '--', 'sleep', '30'])}\n")

        def sleeping() -> int | None:
            for st in scan.snapshot().values():
                if st.comm == "sleep" and st.session == shell.pid and not st.is_dead:
                    return st.pid
            return None

        sleep_pid = wait_for(sleeping, 20, what="sleep 30 under hold run")
        launcher = scan.stat_of(sleep_pid).ppid  # type: ignore[union-attr]
        keeper = scan.stat_of(launcher).ppid  # type: ignore[union-attr]
        assert _comm(keeper) == "hold-keeper"

        def has_the_terminal() -> bool:  # pgrp == tpgid: hold run has handed it over
            fields = Path(f"/proc/{sleep_pid}/stat").read_text().rsplit(")", 1)[1].split()
            return fields[2] == fields[5]

        wait_for(has_the_terminal, 10, what="the command to have the terminal")
        term.write("\x1a")  # Ctrl-Z
        term.expect(r"Stopped")
        for pid in (sleep_pid, launcher, keeper):
            assert scan.stat_of(pid).state == "T", pid  # type: ignore[union-attr]

        term.write("fg\n")
        wait_for(
            lambda: all(scan.stat_of(p).state != "T" for p in (sleep_pid, launcher, keeper)),  # type: ignore[union-attr]
            10,
            what="fg to continue the job",
        )
        term.write("\x03")  # Ctrl-C: the command's, as it has the terminal again
        wait_for(lambda: not alive(sleep_pid), 10, what="Ctrl-C to end sleep 30")
        term.write('echo "R""C=$?"\n')
        term.expect(r"RC=130$")
        assert not alive(launcher) and not alive(keeper)
        term.write("exit\n")
        assert shell.wait(10) == 0
    finally:
        if shell.poll() is None:
            for st in scan.snapshot().values():
                if st.session == shell.pid and not st.is_dead:
                    os.kill(st.pid, signal.SIGKILL)
            shell.wait(10)
        os.close(master)
