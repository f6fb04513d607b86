"""``hold daemon`` in the foreground (issue 14): where it serves and what it read,
then its events as readable lines (colour at a terminal only); the log file
stays JSON lines.

The daemon runs for real, on the test's own state directory and configuration
(conftest), with its stderr on a pty (a terminal) or a pipe; a ticket
(``npu-hold -- true``) makes it log a grant and an end.
"""

from __future__ import annotations

import fcntl
import json
import os
import pwd
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from conftest import HOLD, daemon_pid, update_config, wait_for

NPU_HOLD = str(Path(sys.executable).parent / "npu-hold")
ESC = "\x1b["


def state_dir() -> Path:
    return Path(os.environ["HOLD_STATE_DIR"])


def serving(proc: subprocess.Popen[bytes]) -> None:
    wait_for(
        lambda: (
            (daemon_pid(state_dir()) == proc.pid and (state_dir() / "daemon.sock").exists())
            or proc.poll() is not None
        ),
        20,
        what="the daemon",
    )
    assert proc.poll() is None


def a_ticket() -> None:
    res = subprocess.run(
        [NPU_HOLD, "-l", "uxd", "--", "true"], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    proc.wait(20)


def read_until(fd: int, want: str, timeout: float = 20.0) -> str:
    """What the pty says until ``want`` appears in it (or the time is up)."""
    out = b""
    deadline = time.monotonic() + timeout
    while want.encode() not in out and time.monotonic() < deadline:
        if select.select([fd], [], [], 0.1)[0]:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the other end closed
                break
            if not chunk:
                break
            out += chunk
    return out.decode(errors="replace")


def check_banner(text: str, base: Path) -> None:
    lines = [ln for ln in text.splitlines() if ln.startswith("hold daemon: ")]
    assert lines[0].startswith(f"hold daemon: socket {state_dir() / 'daemon.sock'} ")
    assert "per-user arbiter" in lines[0] and "pid " in lines[0]
    assert f"hold daemon: configuration {os.environ['HOLD_CONFIG']}" in lines
    by_class = {ln.split()[3].rstrip(":"): ln for ln in lines if ln.split()[2] == "class"}
    assert set(by_class) == {"npu", "gpu"}
    assert f"npu:0 {base / 'dev' / 'accel0'}" in by_class["npu"]
    assert f"shared nodes {base / 'dev' / 'nvidiactl'}" in by_class["gpu"]


def check_log_file() -> None:
    """The file stays JSON lines, whatever the terminal saw."""
    lines = (state_dir() / "daemon.log").read_text().splitlines()
    events = [json.loads(ln)["event"] for ln in lines]
    assert "granted" in events and "session_ended" in events


def test_at_a_terminal_readable_lines_in_colour(isolated_hold: Path) -> None:
    master, slave = os.openpty()
    try:
        proc = subprocess.Popen(
            [*HOLD, "daemon"], stdin=subprocess.DEVNULL, stdout=slave, stderr=slave
        )
    finally:
        os.close(slave)
    try:
        serving(proc)
        a_ticket()
        text = read_until(master, "session_ended")
    finally:
        stop(proc)
        os.close(master)
    check_banner(text, isolated_hold)
    granted = [ln for ln in text.splitlines() if "granted" in ln]
    assert len(granted) == 1 and ESC in granted[0]  # colour: a terminal
    plain = granted[0]
    while ESC in plain:  # without its colours, a line a person reads: time, level, event
        head, _, rest = plain.partition(ESC)
        plain = head + rest.partition("m")[2]
    assert "[info" in plain and "label=uxd" in plain and not plain.lstrip().startswith("{")
    check_log_file()


def test_piped_no_colour(isolated_hold: Path, tmp_path: Path) -> None:
    err = tmp_path / "daemon.err"
    with open(err, "wb") as f:  # a file, read once the daemon ended: as a pipe, no terminal
        proc = subprocess.Popen(
            [*HOLD, "daemon"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=f
        )
    try:
        serving(proc)
        a_ticket()
        wait_for(lambda: "session_ended" in err.read_text(), 20, what="the end in stderr")
    finally:
        stop(proc)
    text = err.read_text()
    check_banner(text, isolated_hold)
    assert ESC not in text
    assert any("granted" in ln and "label=uxd" in ln for ln in text.splitlines())
    check_log_file()


def test_through_a_real_pipe_no_colour(isolated_hold: Path) -> None:
    proc = subprocess.Popen(
        [*HOLD, "daemon"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        serving(proc)
        a_ticket()
    finally:
        stop(proc)
    assert proc.stderr is not None
    text = proc.stderr.read().decode()
    proc.stderr.close()
    assert "hold daemon: socket " in text and "granted" in text
    assert ESC not in text


def test_detached_says_nothing_of_it(tmp_path: Path) -> None:
    """The autostarted daemon (``--detach``) keeps to its log file."""
    out = tmp_path / "detached.out"
    with open(out, "wb") as f:  # a file: the daemon keeps what it was given
        res = subprocess.run(
            [*HOLD, "daemon", "--detach"], stdin=subprocess.DEVNULL, stdout=f, stderr=f, timeout=30
        )
    assert res.returncode == 0, out.read_text()
    a_ticket()
    assert "hold daemon:" not in out.read_text() and "granted" not in out.read_text()


def test_a_console_nobody_reads_never_stops_the_grants(isolated_hold: Path) -> None:
    """Its stderr a pipe that is never read: the lines past the pipe's buffer are
    dropped, and every ticket is still granted (the loop never waits on the console)."""
    proc = subprocess.Popen(
        [*HOLD, "daemon"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert proc.stderr is not None
    # The smallest pipe (one page), before the daemon has said much: full in a
    # few tickets (150 tickets to fill 64 KiB took over a minute beside two
    # busy loops).
    fcntl.fcntl(proc.stderr.fileno(), fcntl.F_SETPIPE_SZ, 4096)
    label = "x" * 200  # each event's line carries it
    tickets = 30
    try:
        serving(proc)
        for _ in range(tickets):
            res = subprocess.run(
                [NPU_HOLD, "-l", label, "--", "true"], capture_output=True, text=True, timeout=30
            )
            assert res.returncode == 0, res.stderr
        unread = struct.unpack("i", fcntl.ioctl(proc.stderr.fileno(), termios.FIONREAD, b"0000"))[0]
        assert unread > 4096 - 2 * len(label), f"the pipe never filled: {unread} bytes in it"
    finally:
        stop(proc)
        proc.stderr.close()
    log = (state_dir() / "daemon.log").read_text().splitlines()
    assert sum('"event": "granted"' in ln for ln in log) == tickets


@pytest.mark.parametrize(
    ("shared", "said"), [(True, "shared daemon of"), (False, "per-user daemon of")]
)
def test_status_says_which_kind_of_daemon_serves(
    isolated_hold: Path, shared: bool, said: str
) -> None:
    """A daemon other users may use (``state: {shared: true}``) is not called
    "per-user" (issue 25)."""
    update_config(isolated_hold, state={"shared": shared})
    res = subprocess.run([*HOLD, "status"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    first = res.stdout.splitlines()[0]
    assert first.startswith(f"arbiter: {said} {pwd.getpwuid(os.geteuid()).pw_name} "), first


def test_an_autostarted_daemon_is_announced_at_a_terminal(isolated_hold: Path) -> None:
    """A command that starts a daemon says so, once, where a person reads it (as
    root with no system daemon, it is the machine's, in /run/hold, for 10
    minutes: issue 25); piped, nothing is said."""
    master, slave = os.openpty()
    try:
        res = subprocess.run(
            [str(Path(sys.executable).parent / "npu-hold"), "--", "true"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=slave,
            timeout=60,
        )
    finally:
        os.close(slave)
    try:
        said = read_until(master, "nothing to do")
    finally:
        os.close(master)
    assert res.returncode == 0
    pid = daemon_pid(isolated_hold / "state")
    state = isolated_hold / "state"
    assert f"started the ticket daemon for {state} (pid {pid})" in said, said
    again = subprocess.run(
        [str(Path(sys.executable).parent / "npu-hold"), "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 0 and "started the ticket daemon" not in again.stderr


def test_status_and_a_refusal_say_the_configuration_changed(
    isolated_hold: Path, tmp_path: Path
) -> None:
    """The file edited after the daemon read it (issue 25): ``hold status`` says
    so, and a command the busy daemon cannot serve names the file and the
    reload, not "another configuration"."""
    config = isolated_hold / "config.yaml"
    ready = tmp_path / "ready"
    npu_hold = str(Path(sys.executable).parent / "npu-hold")
    holder = subprocess.Popen(
        [npu_hold, "--", "sh", "-c", f"touch {ready}; exec sleep 30"],
        stdin=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(ready.exists, 20, what="the holder's command")
        before = subprocess.run([*HOLD, "status"], capture_output=True, text=True, timeout=60)
        assert f", reads {config}" in before.stdout.splitlines()[0], before.stdout
        assert "changed since" not in before.stdout
        with open(config, "a") as f:
            f.write("# edited\n")
        after = subprocess.run([*HOLD, "status"], capture_output=True, text=True, timeout=60)
        first = after.stdout.splitlines()[0]
        assert "changed since it read it (hold daemon --reload)" in first, first
        busy = subprocess.run(
            [npu_hold, "--no-wait", "--", "true"], capture_output=True, text=True, timeout=60
        )
        assert busy.returncode == 2, busy.stderr
        assert f"read {config} before the file changed" in busy.stderr, busy.stderr
        assert "hold daemon --reload" in busy.stderr and "another configuration" not in busy.stderr
    finally:
        holder.terminate()
        holder.wait(30)
