"""Opening the files we keep (logs, records, locks, state) without being tricked.

Every file that ``hold`` and the supervisor write in their own directories
is opened here, and only here:

* never through a symlink: ``O_NOFOLLOW`` on the file, and the directories we
  make ourselves (a stack's run directory, its ``logs``) are checked to be
  real directories of ours before anything is opened in them;
* never a FIFO, device or socket someone put in its place (``O_NONBLOCK``, so
  the open itself cannot hang on a FIFO; then ``fstat``: a regular file);
* never a file of someone else (owned by this effective user), and never a
  hard link (a link count of 1): a hard link to a victim file is the same
  trick as a symlink, and ``O_NOFOLLOW`` does not see it;
* never truncated before those checks (``open_for_write`` truncates after).

A refusal raises :class:`UnsafePath`, a :class:`~hold_supervisor.parse.BadValue`,
with a message that names the path; the command line turns it into exit 2.

Whole-file records are replaced (:func:`write_atomic`): a temp file made with
``O_EXCL|O_NOFOLLOW`` beside the target, then a rename. A rename replaces the
*name*, never the old inode's content, so a hard link at the target harms no
one; a symlink (or anything but a regular file) there is still refused.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

from hold_supervisor.errors import SupervisorError
from hold_supervisor.parse import BadValue

__all__ = [
    "UnsafePath",
    "WriteFailed",
    "check_file",
    "ensure_dir",
    "open_for_append",
    "open_for_read",
    "open_for_update",
    "open_for_write",
    "remove_in_dir",
    "write_atomic",
    "write_in_dir",
]


class UnsafePath(BadValue):
    """A path we were about to write, read or delete is not what we made (e.g. a symlink)."""

    def __init__(self, message: str, path: str | None = None) -> None:
        # Not BadValue's own wording ("... is not valid: ..."): the message says it all.
        ValueError.__init__(self, message)
        self.what = "path"
        self.value = path
        self.accepted = message
        self.where = ""
        self.path = path


class WriteFailed(SupervisorError, OSError):
    """Writing a whole file failed: said of the file asked for, not of its temp file.

    An ``OSError`` still (``errno`` kept; exit 125 where it ends a command), whose text reads
    ``cannot write PATH: permission denied`` rather than an errno and the
    random name of a temp file the caller never asked for.
    """

    def __init__(self, path: str, cause: OSError) -> None:
        super().__init__(cause.errno, cause.strerror, path)

    def __str__(self) -> str:
        why = (self.strerror or "failed").lower()
        return f"cannot write {self.filename}: {why}"


def _failed(path: str, e: OSError) -> OSError:
    """``e`` as the caller should read it: a :class:`WriteFailed` of ``path``."""
    return e if isinstance(e, WriteFailed) else WriteFailed(path, e)


_WHAT = {
    stat.S_IFLNK: "a symlink",
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def _refuse(path: str, what: str, verb: str) -> UnsafePath:
    return UnsafePath(f"{path} is {what}; refusing to {verb} through it", path)


def _verify(path: str, st: os.stat_result, verb: str, *, owned: bool = True) -> None:
    """Raise unless ``st`` (of ``path``) is a regular file of ours with one link."""
    kind = stat.S_IFMT(st.st_mode)
    if kind != stat.S_IFREG:
        raise _refuse(path, _WHAT.get(kind, "not a regular file"), verb)
    if not owned:
        return
    me = os.geteuid()
    if st.st_uid != me:
        raise UnsafePath(
            f"{path} is owned by uid {st.st_uid}, not by us (uid {me}); refusing to {verb} it",
            path,
        )
    if st.st_nlink != 1:
        raise UnsafePath(
            f"{path} has {st.st_nlink} hard links (a link to another file?); "
            f"refusing to {verb} through it",
            path,
        )


def _open(path: str, flags: int, mode: int, verb: str, *, owned: bool = True) -> int:
    """``os.open`` without following a link or blocking on a FIFO, then :func:`_verify`."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refuse(path, "a symlink", verb) from None
        if e.errno in (errno.EISDIR, errno.ENXIO, errno.ENODEV):
            # A directory, a socket or a FIFO without a reader, a device.
            try:
                kind = stat.S_IFMT(os.lstat(path).st_mode)
            except OSError:
                kind = 0
            raise _refuse(path, _WHAT.get(kind, "not a regular file"), verb) from None
        raise
    try:
        _verify(path, os.fstat(fd), verb, owned=owned)
        # A regular file: blocking or not is all one to it, but whoever inherits
        # the descriptor (a child's stdout) gets an ordinary one.
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_for_append(path: str, mode: int = 0o600) -> int:
    """A descriptor that appends to ``path`` (created with ``mode`` if absent)."""
    return _open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode, "write")


def open_for_write(path: str, mode: int = 0o600) -> int:
    """A descriptor that writes ``path`` from its start, emptied (after the checks)."""
    fd = _open(path, os.O_WRONLY | os.O_CREAT, mode, "write")
    try:
        os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_for_update(path: str, mode: int = 0o600) -> int:
    """Read and write, nothing emptied (a lock file whose content says who holds it)."""
    return _open(path, os.O_RDWR | os.O_CREAT, mode, "write")


def open_for_read(path: str, *, owned: bool = True) -> int:
    """A descriptor to read ``path``; ``FileNotFoundError`` if it is absent.

    ``owned``: also require our own file with one link (our state); False for
    a file that only has to be a regular file at that very name (a log).
    """
    return _open(path, os.O_RDONLY, 0, "read", owned=owned)


def check_file(path: str, verb: str = "write") -> None:
    """Raise :class:`UnsafePath` unless ``path`` is absent or a regular file of ours
    with one link: what the opening functions above would refuse, said before a
    process is started that would open it."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    _verify(path, st, verb)


def ensure_dir(path: str, mode: int = 0o700, *, owned: bool = True) -> None:
    """Make ``path`` (and missing parents) and check that it is a real directory
    (not a symlink) of ours (``owned``; False for a parent we only put ours in).
    Files are then opened in it by name."""
    try:
        os.makedirs(path, mode=mode, exist_ok=True)
    except FileExistsError:
        pass  # a file or a dangling link at the name: refused below
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"{path} is a symlink; refusing to write through it", path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{path} is not a directory; refusing to write in it", path)
    me = os.geteuid()
    if owned and st.st_uid != me:
        raise UnsafePath(
            f"{path} is owned by uid {st.st_uid}, not by us (uid {me}); refusing to write in it",
            path,
        )


def write_atomic(path: str, data: bytes, mode: int = 0o600) -> None:
    """Write ``path`` whole or not at all: a temp file beside it, then rename.

    No fsync, on purpose: what this protects against is the death of the
    writer (a SIGKILLed daemon), and the page cache outlives any process. A
    machine crash loses the last write, but it also ends every process the
    record could be about (and /run is wiped at boot). An fsync would cost a
    few milliseconds in every write, for nothing.

    Refuses if ``path`` is a symlink or not a regular file. The temp file is
    created with ``O_EXCL|O_NOFOLLOW`` (a random name; anything already there
    is refused), so nothing is ever written through a link someone planted.
    The target's owner is not checked: the rename never writes into the old
    file (a mirrored token in a user's home is that user's, chowned to them).
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        kind = stat.S_IFMT(st.st_mode)
        if kind != stat.S_IFREG:
            raise _refuse(path, _WHAT.get(kind, "not a regular file"), "write")
    tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, mode)
    except FileExistsError:
        raise UnsafePath(f"{tmp} exists; refusing to write through it", tmp) from None
    except OSError as e:
        raise _failed(path, e) from None
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.close(fd)
        fd = -1
        os.rename(tmp, path)
    except BaseException as e:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise _failed(path, e) from None
        raise


def _open_dir(path: str, uid: int, verb: str) -> int:
    """A descriptor of the directory ``path``, which must be owned by ``uid``.

    Everything after is done relative to that descriptor, so the name cannot
    be switched to another directory meanwhile; and since the directory is
    ``uid``'s own, nothing written in it gives that user more than they have.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except NotADirectoryError:
        raise UnsafePath(f"{path} is not a directory; refusing to {verb} in it", path) from None
    try:
        st = os.fstat(fd)
        if st.st_uid != uid:
            raise UnsafePath(
                f"{path} is owned by uid {st.st_uid}, not by uid {uid}; refusing to {verb} in it",
                path,
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _regular_or_absent(dfd: int, path: str, name: str, verb: str) -> bool:
    """True if ``name`` (in ``dfd``) is a regular file, False if absent; else refused."""
    try:
        st = os.lstat(name, dir_fd=dfd)
    except FileNotFoundError:
        return False
    kind = stat.S_IFMT(st.st_mode)
    if kind != stat.S_IFREG:
        raise _refuse(os.path.join(path, name), _WHAT.get(kind, "not a regular file"), verb)
    return True


def write_in_dir(
    path: str, name: str, data: bytes, *, uid: int, gid: int, mode: int = 0o644
) -> None:
    """Write ``path/name`` whole, as :func:`write_atomic`, in a directory of ``uid``
    (a user's home, written by the system daemon): the file is that user's.

    The directory is opened once and checked to be ``uid``'s; the temp file is
    made in it with ``O_EXCL|O_NOFOLLOW``, given to ``uid:gid`` through its
    descriptor (never by name: a name can be switched for a link to another
    file), written, then renamed over ``name``. A symlink or anything but a
    regular file at ``name`` is refused and left as it is.
    """
    dfd = _open_dir(path, uid, "write")
    try:
        _regular_or_absent(dfd, path, name, "write")
        tmp = f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, mode, dir_fd=dfd)
        except FileExistsError:
            raise UnsafePath(
                f"{os.path.join(path, tmp)} exists; refusing to write through it", path
            ) from None
        except OSError as e:
            raise _failed(os.path.join(path, name), e) from None
        try:
            if (uid, gid) != (os.geteuid(), os.getegid()):
                os.fchown(fd, uid, gid)
            os.fchmod(fd, mode)  # the umask's part back: what the caller asked for
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.close(fd)
            fd = -1
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException as e:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            if isinstance(e, OSError):
                raise _failed(os.path.join(path, name), e) from None
            raise
    finally:
        os.close(dfd)


def remove_in_dir(path: str, name: str, *, uid: int) -> None:
    """Delete ``path/name`` if it is a regular file, in a directory of ``uid``;
    absent is done; anything else (a symlink, a directory) is refused and kept."""
    dfd = _open_dir(path, uid, "delete")
    try:
        if _regular_or_absent(dfd, path, name, "delete"):
            os.unlink(name, dir_fd=dfd)
    finally:
        os.close(dfd)
