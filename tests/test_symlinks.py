"""Nothing written (or read) through a path we did not make (issue 10).

For every file ``hold`` keeps in its directories -- the daemon's log, lock and
state, a detached stack's ``supervisor.log``, a unit's log, a stack's lock and
record, a token -- a symlink (and a hard link) to a victim file is planted
before a real CLI run. Each run must end with exit 2 and a message naming the
path, nothing started, and the victim unchanged (the autouse leak check adds
that nothing is left running). Then :mod:`hold_supervisor.safefile` itself, the one
helper every one of those opens goes through.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import HOLD, LOADED, PROGS, daemon_pid

from hold_supervisor import safefile
from hold_supervisor.parse import allowed_cpus
from hold_supervisor.safefile import UnsafePath

PY = sys.executable
BIN = Path(sys.executable).parent
NPU_HOLD = str(BIN / "npu-hold")
UNIT = str(PROGS / "stack_unit.py")
PRECIOUS = "precious\n"


# --------------------------------------------------------------------------
# Helpers.


def hold(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*HOLD, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
    )


def run(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
    )


def state_dir() -> Path:
    return Path(os.environ["HOLD_STATE_DIR"])


def victim(tmp_path: Path) -> Path:
    v = tmp_path / "victim"
    v.write_text(PRECIOUS)
    v.chmod(0o644)
    return v


def plant(kind: str, at: Path, target: Path) -> None:
    """A symlink or a hard link at ``at`` to ``target`` (its directory made as ours)."""
    at.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if kind == "symlink":
        at.symlink_to(target)
    else:
        os.link(target, at)


def said(kind: str) -> str:
    """What the refusal says about the planted link."""
    return "is a symlink; refusing to" if kind == "symlink" else "hard links"


def assert_untouched(v: Path) -> None:
    assert v.read_text() == PRECIOUS
    assert stat.S_IMODE(v.stat().st_mode) == 0o644


def write_stack(base: Path, *, task: bool = False) -> Path:
    """Stack ``t``: unit ``a`` (records its start in base/events), and a task unit."""
    cmd = "[" + ", ".join(f'"{x}"' for x in (PY, UNIT, str(base), "a", "--say", "READY")) + "]"
    body = f"name: t\nunits:\n  a:\n    cmd: {cmd}\n    ready: {{log: READY}}\n"
    if task:
        lane = max(allowed_cpus())
        body += f'  job:\n    kind: task\n    cmd: ["{PY}", "-c", "pass"]\n    cpus: "{lane}"\n'
    path = base / "stack.yaml"
    path.write_text(body)
    return path


def stack_dir() -> Path:
    return state_dir() / "stacks" / "t"


def assert_nothing_started(base: Path) -> None:
    assert not (base / "events").exists(), (base / "events").read_text()
    assert hold("ps", "t").returncode == 1


KINDS = ["symlink", "hardlink"]


# --------------------------------------------------------------------------
# The daemon's files: refused by the client that would start it (exit 2, the
# message names the path), so the user hears why; no daemon is started.


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["daemon.log", "daemon.lock", "state.json"])
@pytest.mark.parametrize("client", ["npu-hold", "hold run"])
def test_daemon_files_refused_at_autostart(
    tmp_path: Path, kind: str, name: str, client: str
) -> None:
    v = victim(tmp_path)
    state_dir().mkdir(mode=0o700)
    path = state_dir() / name
    plant(kind, path, v)
    ran = tmp_path / "ran"
    argv = [NPU_HOLD] if client == "npu-hold" else [*HOLD, "run"]
    res = run(*argv, "--", "touch", str(ran))
    assert res.returncode == 2, res.stderr
    assert str(path) in res.stderr and said(kind) in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert not ran.exists()
    assert_untouched(v)
    assert daemon_pid(state_dir()) is None and not (state_dir() / "daemon.sock").exists()
    assert path.is_symlink() if kind == "symlink" else path.stat().st_nlink == 2


@pytest.mark.parametrize("kind", KINDS)
def test_daemon_started_by_hand_refuses_a_planted_log(tmp_path: Path, kind: str) -> None:
    v = victim(tmp_path)
    state_dir().mkdir(mode=0o700)
    path = state_dir() / "daemon.log"
    plant(kind, path, v)
    res = hold("daemon", timeout=30)
    assert res.returncode == 2, res.stderr
    assert str(path) in res.stderr and said(kind) in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert_untouched(v)
    assert not (state_dir() / "daemon.sock").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_daemon_started_by_hand_refuses_a_planted_state(tmp_path: Path, kind: str) -> None:
    v = victim(tmp_path)
    v.write_text('{"version": 1, "sessions": []}')
    before = v.read_text()
    state_dir().mkdir(mode=0o700)
    path = state_dir() / "state.json"
    plant(kind, path, v)
    res = hold("daemon", timeout=30)
    assert res.returncode == 2, res.stderr
    assert str(path) in res.stderr and said(kind) in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert v.read_text() == before
    assert daemon_pid(state_dir()) is None  # (its socket file may be left: nobody answers)


def test_a_clean_state_dir_still_works(tmp_path: Path) -> None:
    """The control: the same run without a planted link is granted."""
    ran = tmp_path / "ran"
    res = run(NPU_HOLD, "--", "touch", str(ran))
    assert res.returncode == 0, res.stderr
    assert ran.exists()
    log = state_dir() / "daemon.log"
    assert log.stat().st_nlink == 1 and not log.is_symlink()


# --------------------------------------------------------------------------
# Tokens: replaced by rename, so a hard link's victim is never written; a
# symlink is refused (tests/test_daemon.py test_symlinked_token_path_is_refused).


def test_hard_linked_token_is_replaced_not_written(tmp_path: Path) -> None:
    v = victim(tmp_path)
    state_dir().mkdir(mode=0o700)
    path = state_dir() / "npu-0.token"
    plant("hardlink", path, v)
    probe = tmp_path / "token.seen"
    res = run(NPU_HOLD, "--", "sh", "-c", f"head -1 {path} > {probe}")
    assert res.returncode == 0, res.stderr
    assert probe.read_text().startswith("npu-hold ")
    assert_untouched(v)
    assert v.stat().st_nlink == 1  # our name now is our own file (or gone with the lease)


# --------------------------------------------------------------------------
# Stacks: a detached stack's supervisor.log, its directories, its lock and
# record, and each unit's log (services and tasks), foreground and detached.


@pytest.mark.parametrize("kind", KINDS)
def test_detached_supervisor_log_refused(tmp_path: Path, kind: str) -> None:
    v = victim(tmp_path)
    path = stack_dir() / "supervisor.log"
    plant(kind, path, v)
    res = hold("up", "--detach", str(write_stack(tmp_path)))
    assert res.returncode == 2, res.stderr
    assert str(path) in res.stderr and said(kind) in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert_untouched(v)
    assert_nothing_started(tmp_path)


@pytest.mark.parametrize("detach", [False, True], ids=["foreground", "detached"])
def test_symlinked_stack_directory_refused(tmp_path: Path, detach: bool) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (state_dir() / "stacks").mkdir(parents=True, mode=0o700)
    stack_dir().symlink_to(elsewhere)
    res = hold("up", *(["--detach"] if detach else []), str(write_stack(tmp_path)))
    assert res.returncode == 2, res.stderr
    assert f"{stack_dir()} is a symlink" in res.stderr, res.stderr
    assert list(elsewhere.iterdir()) == []
    assert not (tmp_path / "events").exists()


def test_symlinked_logs_directory_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    stack_dir().mkdir(parents=True, mode=0o700)
    (stack_dir() / "logs").symlink_to(elsewhere)
    res = hold("up", str(write_stack(tmp_path)))
    assert res.returncode == 2, res.stderr
    assert f"{stack_dir() / 'logs'} is a symlink" in res.stderr, res.stderr
    assert list(elsewhere.iterdir()) == []
    assert_nothing_started(tmp_path)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["logs/a.log", "logs/job.log", "stack.lock", "stack.json"])
@pytest.mark.parametrize("detach", [False, True], ids=["foreground", "detached"])
def test_stack_files_refused(tmp_path: Path, kind: str, name: str, detach: bool) -> None:
    v = victim(tmp_path)
    path = stack_dir() / name
    plant(kind, path, v)
    res = hold("up", *(["--detach"] if detach else []), str(write_stack(tmp_path, task=True)))
    try:
        assert res.returncode == 2, res.stderr
        assert str(path) in res.stderr and said(kind) in res.stderr, res.stderr
        assert "Traceback" not in res.stderr
        assert_untouched(v)
        assert_nothing_started(tmp_path)
    finally:
        if res.returncode == 0:
            hold("down", "t")


def test_stack_runs_once_the_link_is_gone(tmp_path: Path) -> None:
    """The control: the same stack, detached, comes up and its logs are its own files."""
    path = write_stack(tmp_path, task=True)
    res = hold("up", "--detach", str(path))
    try:
        assert res.returncode == 0, res.stderr
        for name in ("supervisor.log", "logs/a.log", "logs/job.log", "stack.json", "stack.lock"):
            st = (stack_dir() / name).lstat()
            assert stat.S_ISREG(st.st_mode) and st.st_nlink == 1, name
    finally:
        down = hold("down", "t")
    assert down.returncode == 0, down.stderr


def test_hold_logs_does_not_read_through_a_symlink(tmp_path: Path) -> None:
    v = victim(tmp_path)
    res = hold("up", "--detach", str(write_stack(tmp_path)))
    try:
        assert res.returncode == 0, res.stderr
    finally:
        assert hold("down", "t").returncode == 0
    log = stack_dir() / "logs" / "a.log"
    log.unlink()
    plant("symlink", log, v)
    got = hold("logs", "t", "a")
    assert got.returncode == 2, got.stderr
    assert f"{log} is a symlink; refusing to read through it" in got.stderr, got.stderr
    assert PRECIOUS.strip() not in got.stdout
    assert "Traceback" not in got.stderr
    assert_untouched(v)


# --------------------------------------------------------------------------
# The helper itself.


def test_fifo_is_refused_without_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    opens: list[Callable[[str], int]] = [
        safefile.open_for_append,
        safefile.open_for_write,
        safefile.open_for_update,
        safefile.open_for_read,
    ]
    for op in opens:
        t0 = time.monotonic()
        with pytest.raises(UnsafePath, match="is a FIFO"):
            op(str(fifo))
        assert time.monotonic() - t0 < LOADED  # an open of a FIFO waits for a writer


def test_directory_and_socket_are_refused(tmp_path: Path) -> None:
    import socket

    d = tmp_path / "dir"
    d.mkdir()
    with pytest.raises(UnsafePath, match="is a directory"):
        safefile.open_for_append(str(d))
    sock_path = tmp_path / "sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock_path))
        with pytest.raises(UnsafePath, match="is a socket"):
            safefile.open_for_append(str(sock_path))
        with pytest.raises(UnsafePath, match="is a socket"):
            safefile.write_atomic(str(sock_path), b"x")


def test_someone_elses_file_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file away")
    f = tmp_path / "theirs"
    f.write_text(PRECIOUS)
    os.chown(f, 65534, -1)
    for op in (safefile.open_for_append, safefile.open_for_write, safefile.open_for_read):
        with pytest.raises(UnsafePath, match="owned by uid 65534"):
            op(str(f))
    with pytest.raises(UnsafePath, match="owned by uid 65534"):
        safefile.check_file(str(f))
    assert f.read_text() == PRECIOUS


def test_open_for_write_empties_only_after_the_checks(tmp_path: Path) -> None:
    v = victim(tmp_path)
    link = tmp_path / "link"
    os.link(v, link)
    with pytest.raises(UnsafePath, match="2 hard links"):
        safefile.open_for_write(str(link))
    assert_untouched(v)
    own = tmp_path / "own"
    own.write_text("old content\n")
    fd = safefile.open_for_write(str(own))
    try:
        os.write(fd, b"new\n")
    finally:
        os.close(fd)
    assert own.read_text() == "new\n"


def test_append_creates_a_private_file_and_is_not_nonblocking(tmp_path: Path) -> None:
    import fcntl

    p = tmp_path / "new.log"
    fd = safefile.open_for_append(str(p))
    try:
        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK
        assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        os.write(fd, b"a\n")
    finally:
        os.close(fd)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600 & ~_umask()
    assert p.read_text() == "a\n"


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def test_write_atomic_refuses_a_symlink_and_a_planted_temp_file(tmp_path: Path) -> None:
    v = victim(tmp_path)
    link = tmp_path / "rec.json"
    link.symlink_to(v)
    with pytest.raises(UnsafePath, match="is a symlink; refusing to write through it"):
        safefile.write_atomic(str(link), b"{}")
    assert_untouched(v)
    assert link.is_symlink()
    # A hard link is replaced, never written into.
    hard = tmp_path / "hard.json"
    os.link(v, hard)
    safefile.write_atomic(str(hard), b"{}")
    assert hard.read_text() == "{}" and v.stat().st_nlink == 1
    assert_untouched(v)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_unsafe_path_is_one_class_everywhere() -> None:
    from hold.daemon import tokens
    from hold_supervisor.parse import BadValue

    assert tokens.UnsafePath is UnsafePath
    assert tokens.write_atomic is safefile.write_atomic
    e = UnsafePath("/x is a symlink; refusing to write through it", "/x")
    assert isinstance(e, BadValue) and str(e) == "/x is a symlink; refusing to write through it"
    assert e.path == "/x"


def test_ensure_dir_refuses_a_symlink_and_a_file(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(UnsafePath, match="is a symlink"):
        safefile.ensure_dir(str(link))
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(UnsafePath, match="is not a directory"):
        safefile.ensure_dir(str(f))
    safefile.ensure_dir(str(tmp_path / "a" / "b"))
    assert (tmp_path / "a" / "b").is_dir()


def test_unit_log_rotation_does_not_write_through_a_link_planted_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hold_supervisor.unitlog import RotatingLog

    v = victim(tmp_path)
    path = tmp_path / "u.log"
    log = RotatingLog(str(path), max_bytes=30, keep=1)
    real_replace = os.replace

    def replace_then_plant(src: str, dst: str) -> None:
        """The rotation's rename, and a link planted at once where the log reopens."""
        real_replace(src, dst)
        if src == str(path):
            path.symlink_to(v)

    try:
        log.write("first line")
        monkeypatch.setattr(os, "replace", replace_then_plant)
        log.write("x" * 40)  # past max_bytes: rotates, and the reopening is refused
        monkeypatch.undo()
        assert log.refused is not None and f"{path} is a symlink" in log.refused
        log.write("dropped, not written through the link")
    finally:
        log.close()
    assert_untouched(v)
    assert (tmp_path / "u.log.1").read_text() == "first line\n"
