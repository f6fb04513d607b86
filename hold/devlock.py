"""Machine-wide device locks: one holder per device, whichever arbiter grants it.

Every daemon -- the system daemon, or a user's own when none serves -- takes a
device's kernel lock before it grants the device and keeps it until the
lease's trees are stopped. The lock is ``flock(2)`` on a file in a
machine-wide directory (root-owned, sticky, world-writable: ``/run/lock``),
named by the device's identity (:func:`hold.devices.node_key`), never by an
index or a path: two users whose configurations reach one node by different
paths still meet on one lock.

With the grant the daemon passes its open file description to the client
(``SCM_RIGHTS``). A flock belongs to the open file description, not to a
process, so the lock lasts while *either* of them holds it: a SIGKILLed
client leaves it with the daemon until the tree is stopped, a SIGKILLed
daemon leaves it with the client until a new daemon takes it back. No single
SIGKILL frees a device whose lease's tree may still run.

The file's content says whose lease it is (uid, user, holder pid and start
time, since, until, lease id; the label only where the owner allows it), so
that a waiter served by another arbiter can be told who is in the way. The
content informs; only the kernel lock decides.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
from typing import Any

from supervisor.parse import BadValue

# Searched in this order; the first that is a root-owned, sticky,
# world-writable directory is used. Only root (or the directory's owner) can
# delete another user's file in such a directory, so nobody can swap a lock
# file under a holder. /run/lock first: /tmp may be private to a service
# (systemd's PrivateTmp), and then two arbiters would not meet.
LOCK_DIRS = ("/run/lock", "/dev/shm", "/tmp")
MAX_RECORD = 4096


class LockUnusable(Exception):
    """The lock file cannot be used (not a regular file, or not ours to open):
    the device counts as held, by whoever owns the file."""


def lock_dir(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The machine-wide lock directory (``HOLD_LOCK_DIR`` overrides it, for tests only:
    arbiters with different lock directories do not exclude each other)."""
    explicit = environ.get("HOLD_LOCK_DIR")
    if explicit:
        return explicit
    for cand in LOCK_DIRS:
        try:
            st = os.stat(cand)
        except OSError:
            continue
        if (
            stat.S_ISDIR(st.st_mode)
            and st.st_uid == 0
            and st.st_mode & stat.S_ISVTX
            and st.st_mode & 0o002
        ):
            return cand
    raise BadValue(
        "device lock directory", " or ".join(LOCK_DIRS),
        "a root-owned, sticky, world-writable directory (mode 1777) for the machine-wide "
        "device locks",
    )  # fmt: skip


def lock_path(directory: str, key: str) -> str:
    return os.path.join(directory, f"hold-dev-{key}.lock")


def open_lock(path: str) -> int:
    """Open the lock file, creating it (mode 0666) if it is missing.

    Never through a symlink (``O_NOFOLLOW``), never a FIFO or device
    (``O_NONBLOCK`` so that opening one cannot hang, then checked). An
    existing file is opened without ``O_CREAT``: with ``fs.protected_regular``
    the kernel refuses ``O_CREAT`` on another user's file in a sticky
    directory, even one that exists.
    """
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    for _ in range(5):
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            try:
                fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                continue  # made by someone else meanwhile: open theirs
            os.fchmod(fd, 0o666)  # the umask would keep other users out
        except OSError as e:
            raise LockUnusable(f"{path}: {e.strerror}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise LockUnusable(f"{path} is not a regular file")
        return fd
    raise LockUnusable(f"{path} keeps appearing and disappearing")


def try_lock(fd: int) -> bool:
    """Take the exclusive lock on ``fd`` if nobody holds it; never waits."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def acquire(path: str) -> int | None:
    """The locked descriptor of ``path``, or None if another holds the lock."""
    fd = open_lock(path)
    if try_lock(fd):
        return fd
    os.close(fd)
    return None


def wait(path: str) -> int:
    """Block until the lock of ``path`` is ours; its descriptor (for a waiter thread)."""
    fd = open_lock(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


def same_file(fd: int, path: str) -> bool:
    """Is ``fd`` the file at ``path`` (a descriptor handed back by a client)?"""
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(a.st_mode) and (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def write_owner(fd: int, record: dict[str, Any]) -> None:
    """Say whose lease holds the lock (only the lock's holder calls this)."""
    data = (json.dumps(record, sort_keys=True) + "\n").encode()[:MAX_RECORD]
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def read_owner(path: str) -> dict[str, Any] | None:
    """What the lock file says of its holder; None if absent or not a record.

    Anyone may write the file, so every field is checked before use and none
    of it authorises anything.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.pread(fd, MAX_RECORD, 0)
    finally:
        os.close(fd)
    try:
        rec = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(rec, dict):
        return None
    out: dict[str, Any] = {}
    for name, kind in (("uid", int), ("pid", int), ("start", int), ("daemon_pid", int),
                       ("since", float), ("until", float), ("user", str), ("lease", str),
                       ("label", str), ("cls", str), ("arbiter", str)):  # fmt: skip
        value = rec.get(name)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, kind) and not isinstance(value, bool):
            out[name] = value[:200] if isinstance(value, str) else value
    return out


def locked_inodes() -> set[tuple[int, int, int]]:
    """``(major, minor, inode)`` of every file with a flock held now, from ``/proc/locks``.

    Read instead of probing with a shared lock of our own: a probe would make
    another arbiter's non-blocking attempt fail for an instant.
    """
    out: set[tuple[int, int, int]] = set()
    try:
        with open("/proc/locks", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return out
    for line in text.splitlines():
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 00:1a:5678 0 EOF"; "->" marks a waiter
        if len(parts) < 6 or parts[1] == "->" or parts[1] != "FLOCK":
            continue
        try:
            maj, mnr, ino = parts[5].split(":")
            out.add((int(maj, 16), int(mnr, 16), int(ino)))
        except ValueError:
            continue
    return out


def is_locked(path: str, locked: set[tuple[int, int, int]] | None = None) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    held = locked_inodes() if locked is None else locked
    return (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) in held
