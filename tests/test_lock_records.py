"""The machine-wide lock files are anyone's to write (issue 24): what a record
says is believed only where the kernel agrees, and a record no daemon could
have written never breaks another user's client, ``hold status`` or
``hold metrics``. Here the test itself is "another arbiter": it holds the
flock of the test's npu device, with whatever record it likes."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import HOLD

from hold.daemon import devlock
from hold.devices.classes import node_key

NPU_HOLD = str(Path(sys.executable).parent / "npu-hold")


@contextlib.contextmanager
def locked_with(base: Path, record: bytes, *, into_lock_file: bool = False) -> Iterator[str]:
    """The npu device's lock file, flocked by this process, with ``record`` in
    this user's record file beside it (or in the lock file itself)."""
    node = next((base / "dev").glob("accel*"))
    key = node_key(str(node))
    assert key is not None
    path = devlock.lock_path(os.environ["HOLD_LOCK_DIR"], key)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if into_lock_file:
            os.write(fd, record)
        else:
            Path(devlock.record_path(path, os.geteuid())).write_bytes(record)
        yield path
    finally:
        os.close(fd)


def _record(**fields: object) -> bytes:
    """A record every field of which is well formed, naming this process as its daemon."""
    now = time.time()
    record: dict[str, object] = {"user": "u", "label": "l", "pid": 1, "lease": "x", "cls": "npu"}
    record |= {"uid": os.geteuid(), "start": 1, "since": now, "until": now + 60, "arbiter": "a"}
    record |= {"daemon_pid": os.getpid(), **fields}
    return json.dumps(record).encode()


def _no_wait() -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [NPU_HOLD, "--no-wait", "--", "true"], capture_output=True, text=True, timeout=60
    )


def _views_work() -> None:
    for argv in ([*HOLD, "status"], [*HOLD, "status", "--json"], [*HOLD, "metrics"]):
        res = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, (argv, res.stderr)
        assert "Traceback" not in res.stderr


def test_a_plain_flock_is_named_by_the_kernel(isolated_hold: Path) -> None:
    """No lease, no record: the waiter hears the pid the kernel names, not "pid ?"."""
    with locked_with(isolated_hold, b"") as path:
        res = _no_wait()
        assert res.returncode == 75, res.stderr
        assert f"locked by pid {os.getpid()} (user " in res.stderr, res.stderr
        assert "no ticket daemon" in res.stderr and path in res.stderr, res.stderr
        status = subprocess.run([*HOLD, "status"], capture_output=True, text=True, timeout=60)
        assert "by no ticket daemon" in status.stdout, status.stdout
        _views_work()


def test_a_record_naming_another_daemon_is_not_believed(isolated_hold: Path) -> None:
    """A record that names a daemon other than the lock's holder (overwritten by
    someone): the kernel's holder is what is said."""
    forged = {"user": "somebody", "label": "forged", "pid": 1, "daemon_pid": 1, "lease": "x"}
    with locked_with(isolated_hold, json.dumps(forged).encode()):
        res = _no_wait()
        assert res.returncode == 75, res.stderr
        assert f"locked by pid {os.getpid()}" in res.stderr and "forged" not in res.stderr


@pytest.mark.parametrize("where", ["its own user's file", "the lock file"])
def test_a_record_is_believed_from_its_own_users_file_alone(
    isolated_hold: Path, where: str
) -> None:
    """A record naming the lock's holder as its daemon: believed from the
    holder's user's own record file, never from the lock file, which every
    user can write (anyone could rewrite a live lease's record there, keeping
    its daemon's pid, and be believed: issue 24)."""
    in_lock = where == "the lock file"
    with locked_with(isolated_hold, _record(label="written"), into_lock_file=in_lock):
        res = _no_wait()
        assert res.returncode == 75, res.stderr
        if in_lock:
            assert f"locked by pid {os.getpid()}" in res.stderr, res.stderr
            assert "written" not in res.stderr, res.stderr
        else:
            assert "'written'" in res.stderr, res.stderr
            assert "through another ticket daemon" in res.stderr, res.stderr


def test_a_record_file_made_by_another_user_is_not_believed(
    isolated_hold: Path, unpriv_user: str
) -> None:
    """Someone else made the holder's user's record file (anyone may make any
    name in the sticky lock directory): not believed, and who made it is said."""
    pw = pwd.getpwnam(unpriv_user)
    with locked_with(isolated_hold, _record(label="planted")) as path:
        os.chown(devlock.record_path(path, os.geteuid()), pw.pw_uid, pw.pw_gid)
        res = _no_wait()
        assert res.returncode == 75, res.stderr
        assert "planted" not in res.stderr, res.stderr
        assert f"locked by pid {os.getpid()}" in res.stderr, res.stderr
        assert f"was made by user {unpriv_user}" in res.stderr, res.stderr
        status = subprocess.run([*HOLD, "status"], capture_output=True, text=True, timeout=60)
        line = next(ln for ln in status.stdout.splitlines() if ln.startswith("npu:0"))
        assert f"made by user {unpriv_user}, not believed" in line, line
        _views_work()


def test_a_record_with_nan_breaks_nothing(isolated_hold: Path) -> None:
    record = (
        f'{{"user": "u", "label": "l", "lease": "x", "daemon_pid": {os.getpid()}, '
        '"since": NaN, "until": Infinity, "pid": 123456789012345678901234567890}'
    )
    with locked_with(isolated_hold, record.encode()):
        res = _no_wait()
        assert res.returncode == 75, res.stderr
        # Not strict JSON: the record is refused whole (hold.documents.LockRecord),
        # and the kernel's holder of the lock is what is said.
        assert "Traceback" not in res.stderr, res.stderr
        assert f"locked by pid {os.getpid()}" in res.stderr, res.stderr
        assert " nan" not in res.stderr.lower() and "inf" not in res.stderr.lower(), res.stderr
        _views_work()


@pytest.mark.parametrize(
    "times",
    [{"since": 1e300, "until": 1e300}, {"since": 2**62, "until": 2**62}, {"until": -1e18}],
    ids=["1e300", "2**62", "long ago"],
)
def test_a_record_with_a_time_no_clock_can_show_breaks_nothing(
    isolated_hold: Path, times: dict[str, float]
) -> None:
    """Finite, within 64 bits, and still no time a daemon writes (beyond year
    9999, before 1970): the record is refused whole, as one with NaN is, and
    the kernel's holder is what is said. Believed, it crashed every view that
    shows its time (time.localtime: "timestamp out of range")."""
    with locked_with(isolated_hold, _record(**times)):
        res = _no_wait()
        assert res.returncode == 75, res.stderr
        assert "Traceback" not in res.stderr, res.stderr
        assert f"locked by pid {os.getpid()}" in res.stderr, res.stderr
        _views_work()


def test_an_unusable_lock_file_is_shown_not_free(isolated_hold: Path) -> None:
    """A directory made at the lock file's path (which not even root's daemon
    removes): the device cannot be granted, and hold status says why instead of
    "free"."""
    node = next((isolated_hold / "dev").glob("accel*"))
    key = node_key(str(node))
    assert key is not None
    path = devlock.lock_path(os.environ["HOLD_LOCK_DIR"], key)
    os.mkdir(path)
    res = _no_wait()
    assert res.returncode == 75, res.stderr
    assert "cannot be locked" in res.stderr and path in res.stderr, res.stderr
    status = subprocess.run([*HOLD, "status"], capture_output=True, text=True, timeout=60)
    line = next(ln for ln in status.stdout.splitlines() if ln.startswith("npu:0"))
    assert "unusable" in line and "its lock file cannot be used" in line, line
    _views_work()
