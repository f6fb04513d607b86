"""Machine-wide device locks: one holder per device, whichever arbiter grants it.

Every daemon -- the system daemon, or a user's own when none serves -- takes a
device's kernel lock before it grants the device and keeps it until the
lease's trees are stopped. The lock is ``flock(2)`` on a file in a
machine-wide directory (root-owned, sticky, world-writable: ``/run/lock``),
named by the device's identity (:func:`hold.devices.classes.node_key`), never by an
index or a path: two users whose configurations reach one node by different
paths still meet on one lock.

With the grant the daemon passes its open file description to the client
(``SCM_RIGHTS``). A flock belongs to the open file description, not to a
process, so the lock lasts while *either* of them holds it: a SIGKILLed
client leaves it with the daemon until the tree is stopped, a SIGKILLed
daemon leaves it with the client until a new daemon takes it back. No single
SIGKILL frees a device whose lease's tree may still run.

Whose lease it is (:class:`hold.documents.LockRecord`: uid, user, holder pid
and start time, since, until, lease id; the label only where the owner
allows it) is said in a file beside the lock, one per user
(:func:`record_path`), so that a waiter served by another arbiter can be told
who is in the way. Not in the lock file itself: every user must be able to
open that one, so anyone could rewrite a live lease's record there, keeping
the daemon pid that made it believed. A record is believed only from the
file of the user whose process took the lock (``/proc/locks``), owned by that
user, naming that process as its daemon. It informs; only the kernel lock
decides.
"""

from __future__ import annotations

import errno
import fcntl
import os
import queue
import stat
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from hold.documents import BadDocument, LockRecord
from hold.errors import HoldError
from hold_supervisor.parse import BadValue
from hold_supervisor.proc import scan
from hold_supervisor.proc.identity import user_name

# Searched in this order; the first that is a root-owned, sticky,
# world-writable directory is used. Only root (or the directory's owner) can
# delete another user's file in such a directory, so nobody can swap a lock
# file under a holder. /run/lock first: /tmp may be private to a service
# (systemd's PrivateTmp), and then two arbiters would not meet.
LOCK_DIRS = ("/run/lock", "/dev/shm", "/tmp")
MAX_RECORD = LockRecord.MAX_SIZE


class LockUnusable(HoldError):
    """The lock file cannot be used (not a regular file, or not ours to open):
    the device counts as held, by whoever owns the file."""


def lock_dir(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The machine-wide lock directory (``HOLD_LOCK_DIR`` overrides it, for tests only:
    arbiters with different lock directories do not exclude each other)."""
    explicit = environ.get("HOLD_LOCK_DIR")
    if explicit:
        # Checked once, at the daemon's start: a missing one failed every grant
        # later, as an error about a lock file nobody had asked for.
        if not os.path.isdir(explicit) or not os.access(explicit, os.W_OK | os.X_OK):
            raise BadValue("HOLD_LOCK_DIR", explicit, "an existing directory this daemon may write")
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
        "device lock directory",
        " or ".join(LOCK_DIRS),
        "a root-owned, sticky, world-writable directory (mode 1777) for the machine-wide "
        "device locks",
    )


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
    root = os.geteuid() == 0
    for _ in range(5):
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            try:
                fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                continue  # made by someone else meanwhile: open theirs
            except OSError as e:  # the directory gone, full, read-only
                raise LockUnusable(f"{path}: cannot be made ({e.strerror})") from None
            os.fchmod(fd, 0o666)  # the umask would keep other users out
        except OSError as e:
            if root and e.errno == errno.ELOOP and _remove_planted(path):
                continue  # a symlink someone planted: root takes the name back
            raise LockUnusable(f"{path}: {e.strerror}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            if root and _remove_planted(path):
                continue  # a FIFO, a socket, a device node: likewise
            raise LockUnusable(f"{path} is not a regular file")
        if root and stat.S_IMODE(st.st_mode) & 0o666 != 0o666:
            # Another user made it theirs alone (0600): every other user's daemon
            # could no longer open it, and the device could never be granted.
            os.fchmod(fd, 0o666)
        return fd
    raise LockUnusable(f"{path} keeps appearing and disappearing")


def _remove_planted(path: str) -> bool:
    """(root) The thing planted at a lock file's name removed (never followed: the
    name itself); True if it is gone. Only names of this module's own pattern."""
    if not os.path.basename(path).startswith("hold-dev-"):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def unusable(path: str) -> str | None:
    """Why the lock file at ``path`` cannot be used by this process (what
    :func:`open_lock` would raise), without making it; None if it can (or is
    not there yet). Only looks: for ``hold status``."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{path}: {e.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if not os.access(path, os.R_OK | os.W_OK, follow_symlinks=False):
        return f"{path}: not writable by this daemon's user (mode {st.st_mode & 0o777:o})"
    return None


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


RECORD_SUFFIX = ".record"


def record_path(lock: str, uid: int) -> str:
    """Where the daemons of ``uid`` say whose lease holds the lock at ``lock``."""
    return f"{lock.removesuffix('.lock')}.{uid}{RECORD_SUFFIX}"


def write_record(lock: str, record: LockRecord) -> None:
    """Say whose lease holds the lock at ``lock`` (only its holder calls this), in
    this user's record file: mode 0644, this user's own, never through a link.

    Raises :class:`LockUnusable` where another user made a file at that name
    (root removes it and makes its own); nothing is written into a file this
    user does not own, since nobody would believe it."""
    path = record_path(lock, os.geteuid())
    data = record.encode()
    if len(data) > LockRecord.MAX_SIZE:  # a long label: said without it, never cut short
        data = replace(record, label=None).encode()
    fd = _open_own_record(path, create=True)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)


def clear_record(lock: str) -> None:
    """Empty this user's record of the lock at ``lock`` (its lease is over): never
    made, never through a link, only a file of this user's own."""
    try:
        fd = _open_own_record(record_path(lock, os.geteuid()), create=False)
    except (LockUnusable, OSError):
        return
    try:
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)


def _open_own_record(path: str, *, create: bool) -> int:
    """A writable descriptor of this user's record file at ``path``. As
    :func:`open_lock`: an existing file is opened without ``O_CREAT``
    (``fs.protected_regular``), never a link or a FIFO (``O_NONBLOCK``)."""
    flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    euid = os.geteuid()
    for _ in range(5):
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            if not create:
                raise
            try:
                fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                continue
            os.fchmod(fd, 0o644)  # readable by every waiter, whatever the umask
        except OSError as e:
            if euid == 0 and _remove_planted(path):
                continue  # a link, a FIFO, a file not root's to write: root takes the name back
            raise LockUnusable(f"{path}: {e.strerror}") from None
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == euid:
            return fd
        os.close(fd)
        if euid == 0 and _remove_planted(path):
            continue
        raise LockUnusable(f"{path} was made by user {user_name(st.st_uid)}, not by this one")
    raise LockUnusable(f"{path} keeps appearing and disappearing")


def read_record(lock: str, uid: int) -> LockRecord | None:
    """What user ``uid``'s record file of the lock at ``lock`` says; None if it is
    absent, not that user's own regular file, or not a record
    (:class:`hold.documents.LockRecord`).

    Read without following a link or waiting on a FIFO, at most
    :data:`MAX_RECORD` bytes, decoded strictly; none of it authorises anything.
    """
    path = record_path(lock, uid)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
            return None
        raw = os.pread(fd, MAX_RECORD, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        return LockRecord.decode(raw, path)
    except BadDocument:
        return None


def _believed(rec: LockRecord | None, daemon_pid: int, uid: int) -> bool:
    """Could the daemon ``daemon_pid``, of user ``uid``, have written ``rec``? Its
    own pid in it, and a lease of its own user unless it is root's (a user's
    daemon serves that user alone)."""
    return rec is not None and rec.daemon_pid == daemon_pid and uid in (0, rec.uid)


def owner_of(path: str) -> dict[str, Any]:
    """Who holds the lock at ``path``, as far as it can be told.

    The kernel names the process that took the flock (``/proc/locks``). Its
    user's record file (:func:`read_record`) is believed where it names that
    process as its daemon. Where that process has exited (a lock handed on
    with its descriptor: the daemon died, its client holds on), the record of
    any user that names it is. Otherwise a live process that is no arbiter
    holds it -- a plain ``flock`` -- and that process is what is said, with
    ``"foreign": True`` (and ``"record_by"``: who else made its user's record
    file, if someone did)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return {}
    pid = scan.flock_holders().get((os.major(st.st_dev), os.minor(st.st_dev), st.st_ino))
    if pid is None:
        return {}
    uid = scan.uid_of(pid)
    if uid is None or scan.stat_of(pid) is None:
        return _record_of_gone(path, pid)
    rec = read_record(path, uid)
    if _believed(rec, pid, uid):
        assert rec is not None
        return rec.body()
    said: dict[str, Any] = {"pid": pid, "user": user_name(uid), "foreign": True, "path": path}
    try:
        made_by = os.stat(record_path(path, uid), follow_symlinks=False).st_uid
    except OSError:
        return said
    if made_by != uid:
        said["record_by"] = user_name(made_by)
    return said


def _record_of_gone(path: str, pid: int) -> dict[str, Any]:
    """The record that names ``pid``, the exited taker of the lock at ``path``, as
    its daemon, in the record file of that record's own user or root's; else
    nothing to say."""
    directory, stem = os.path.split(path.removesuffix(".lock"))
    try:
        names = os.listdir(directory or ".")
    except OSError:
        return {}
    for name in names:
        if not (name.startswith(stem + ".") and name.endswith(RECORD_SUFFIX)):
            continue
        uid_text = name[len(stem) + 1 : -len(RECORD_SUFFIX)]
        if not uid_text.isdigit():
            continue
        rec = read_record(path, int(uid_text))
        if _believed(rec, pid, int(uid_text)):
            assert rec is not None
            return rec.body()
    return {}


def locked_inodes() -> set[tuple[int, int, int]]:
    """``(major, minor, inode)`` of every file with a flock held now, from ``/proc/locks``.

    Read instead of probing with a shared lock of our own: a probe would make
    another arbiter's non-blocking attempt fail for an instant.
    """
    return scan.flocked_files()


def is_locked(path: str, locked: set[tuple[int, int, int]] | None = None) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    held = locked_inodes() if locked is None else locked
    return (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) in held


class Locks:
    """The machine-wide locks one daemon holds, and those it waits for.

    Keyed by device key (:func:`hold.devices.classes.node_key`). A lock another
    arbiter holds gets one waiter thread, blocked in ``flock``; when it
    returns, the lock is this daemon's and ``wake`` is called, and the loop
    learns which keys changed from :meth:`collect`. Never blocks the caller.
    """

    def __init__(self, directory: str, wake: Callable[[], None]) -> None:
        self.directory = directory
        self.wake = wake
        self.fds: dict[str, int] = {}  # key -> our locked descriptor
        self.waiting: set[str] = set()  # keys a waiter thread is blocked on
        self._got: queue.SimpleQueue[tuple[str, int | None]] = queue.SimpleQueue()

    def path(self, key: str) -> str:
        return lock_path(self.directory, key)

    def take(self, key: str) -> dict[str, Any] | None:
        """None once the lock of ``key`` is ours; else whose it is (its record, or
        ``{"error": why}`` for a lock file that cannot be used), waited for."""
        if key in self.fds:
            return None
        path = self.path(key)
        try:
            fd = acquire(path)
        except LockUnusable as e:
            return {"error": str(e)}  # nothing to wait on: tried again later
        if fd is not None:
            self.fds[key] = fd
            return None
        if key not in self.waiting:
            self.waiting.add(key)
            threading.Thread(target=self._wait, args=(key, path), daemon=True).start()
        return owner_of(path)

    def take_if_free(self, key: str) -> None:
        """Take ``key``'s lock if nobody holds it; never wait (a restarted daemon's
        leases: their holders, if alive, hand theirs back when they re-attach)."""
        if key not in self.fds:
            try:
                fd = acquire(self.path(key))
            except LockUnusable:
                return
            if fd is not None:
                self.fds[key] = fd

    def _wait(self, key: str, path: str) -> None:
        """(Worker) block until the other arbiter lets go; hand the lock to the loop."""
        fd: int | None
        try:
            fd = wait(path)
        except (LockUnusable, OSError):
            fd = None
        self._got.put((key, fd))
        self.wake()

    def collect(self) -> set[str]:
        """The keys whose waiter came back (the lock is ours now, or it failed)."""
        done: set[str] = set()
        while True:
            try:
                key, fd = self._got.get_nowait()
            except queue.Empty:
                return done
            self.waiting.discard(key)
            done.add(key)
            if fd is not None:
                if key in self.fds:
                    os.close(fd)
                else:
                    self.fds[key] = fd

    def release_unused(self, used: set[str]) -> None:
        """Let go of every lock not in ``used`` (our record of it emptied: that lease is over).

        Unlocked, not only closed: the client holds a descriptor of the same
        open file description (its copy for the daemon's death), and a close
        leaves the flock to that copy. A client stopped (SIGSTOP) past its
        lease's end would then keep the device from everyone who asks after
        it (they are told the lock is held outside any lease). ``LOCK_UN``
        on any descriptor of the description lets go for all of them."""
        for key in [k for k in self.fds if k not in used]:
            fd = self.fds.pop(key)
            clear_record(self.path(key))
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def take_back(self, key: str, fds: list[int]) -> None:
        """A re-attaching client hands back its lease's locks (after our restart).

        Believed only for what they are: the lock file of ``key`` (same inode),
        whose lock that descriptor holds."""
        path = self.path(key)
        for fd in fds:
            if key not in self.fds and same_file(fd, path) and try_lock(fd):
                self.fds[key] = os.dup(fd)

    def held_elsewhere(self, key: str, locked: set[tuple[int, int, int]]) -> dict[str, Any] | None:
        """The record of ``key``'s lock if another arbiter holds it now, else None."""
        if key in self.fds or not is_locked(self.path(key), locked):
            return None
        return owner_of(self.path(key))
