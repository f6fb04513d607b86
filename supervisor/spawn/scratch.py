"""Scratch: a fresh private directory for one run, gone when the run is.

Why this exists: in the probe practice this project came from, an imported
model container filled a tmpfs to 0 bytes and broke every other user's tools,
and a ``.`` in a path once came close to wiping a shared scratch root. So:

* the root is disk-backed (``$XDG_CACHE_HOME/hold/scratch`` by default, the
  caller's choice), a real directory of ours (no symlink), 0700; where it
  comes from (``XDG_CACHE_HOME``, else ``HOME``) must be an absolute, existing
  directory of ours and not ``/`` (:func:`check_base`), or nothing is made;
* a free-space floor (:data:`DEFAULT_MIN_FREE` unless the caller names
  another; 0: none) is checked before the run starts;
* a run's directory is made with ``mkdirat`` on a descriptor of the root that
  stays open, with a fresh name, 0700; its own descriptor stays open too, and
  an ``flock`` on it says "a live run owns this" (the kernel lets it go when
  the owner dies, however it dies);
* removal works only through descriptors: every entry is unlinked *at* its
  directory's descriptor, a directory is entered with ``O_NOFOLLOW`` and only
  if it is on the same filesystem, a symlink is removed as a link and never
  followed, and the run's directory is removed by name from the root only if
  that name is still the inode we made. Nothing above the run's directory is
  ever touched, and ``.``/``..`` never appear (``scandir`` does not list them);
* what could not be removed is reported, not ignored;
* :func:`sweep` removes the directories whose owner died without removing
  them (SIGKILL of a launcher): their lock is free.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pwd
import secrets
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from hold_supervisor.errors import SupervisorError
from hold_supervisor.exitcodes import USAGE
from hold_supervisor.safefile import UnsafePath, ensure_dir

MAX_DEPTH = 200  # deeper than this is reported, not removed (no unbounded recursion)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
PREFIX = "run-"
KEPT = "kept-"
# The free space a scratch's filesystem must have when it is made, unless the
# caller names another floor (the configuration's ``scratch: {min_free}``, a
# unit's ``scratch: {min_free}``); 0 turns it off.
DEFAULT_MIN_FREE = 1 << 30


class ScratchError(SupervisorError):
    """No scratch could be made (too little free space, an unsafe root)."""

    exit_code = USAGE


def default_root(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """``$XDG_CACHE_HOME/hold/scratch`` (``~/.cache/hold/scratch``): disk, not a tmpfs.

    :class:`ScratchError` (nothing made) unless the directory it comes from,
    ``XDG_CACHE_HOME`` or else ``HOME`` (else the password database's home),
    passes :func:`check_base`: ``XDG_CACHE_HOME=/`` would make ``/hold/scratch``,
    ``./..`` a relative ``HOLD_SCRATCH``, ``HOME=/nonexistent`` a new tree there.
    """
    xdg = environ.get("XDG_CACHE_HOME")
    if xdg:
        check_base(xdg, "XDG_CACHE_HOME")
        return os.path.join(xdg, "hold", "scratch")
    home, where = environ.get("HOME"), "HOME (XDG_CACHE_HOME is not set)"
    if not home:
        uid = os.geteuid()
        try:
            home = pwd.getpwuid(uid).pw_dir
        except KeyError:
            raise ScratchError(
                f"scratch root: neither XDG_CACHE_HOME nor HOME is set, and uid {uid} has "
                "no home in the password database; set XDG_CACHE_HOME to a directory of "
                "yours. Nothing was made"
            ) from None
        where = f"the home of uid {uid} in the password database (HOME is not set)"
    check_base(home, where)
    return os.path.join(home, ".cache", "hold", "scratch")


def check_base(path: str, where: str) -> None:
    """Refuse (:class:`ScratchError`, naming ``path`` and ``where`` it came from)
    a directory to make scratch roots in that is not an absolute path without
    ``..``, not ``/``, and an existing directory of this user."""
    me = os.geteuid()
    why = None
    if not os.path.isabs(path):
        why = "is a relative path"
    elif ".." in path.split("/"):
        why = "contains '..'"
    elif os.path.normpath(path) == "/":
        why = "is the root directory /"
    else:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            why = "does not exist"
        except OSError as e:
            why = f"cannot be looked at ({e.strerror})"
        else:
            if not stat.S_ISDIR(st.st_mode):
                why = "is not a directory"
            elif st.st_uid != me:
                why = f"is owned by uid {st.st_uid}, not by you (uid {me})"
    if why is not None:
        raise ScratchError(
            f"scratch root: {path!r} (from {where}) {why}; wanted an absolute, existing "
            f"directory of yours other than /. Nothing was made"
        )


@dataclass
class RemoveReport:
    """What :meth:`Scratch.remove` left: ``(path, why)`` for each thing it could not remove."""

    path: str
    left: list[tuple[str, str]] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.left

    def describe(self) -> str:
        shown = "; ".join(f"{p}: {why}" for p, why in self.left[:5])
        more = f" (and {len(self.left) - 5} more)" if len(self.left) > 5 else ""
        return f"scratch {self.path}: could not remove {shown}{more}"


class Scratch:
    """One run's scratch directory, open and locked until :meth:`remove` or :meth:`close`.

    Use as a context manager: the directory is removed on the way out unless
    ``keep``; :attr:`report` holds what the removal left.
    """

    def __init__(self, root: str, *, keep: bool = False, min_free: int | None = None) -> None:
        """``min_free``: the floor of free space (None: :data:`DEFAULT_MIN_FREE`; 0: none)."""
        if not os.path.isabs(root) or ".." in root.split("/") or os.path.normpath(root) == "/":
            raise ScratchError(
                f"scratch root: {root!r} is not an absolute path of a directory other than / "
                "(without '..'). Nothing was made"
            )
        floor = DEFAULT_MIN_FREE if min_free is None else min_free
        if floor:  # before anything is made: where the root will be, as it is now
            near = _nearest(root)
            try:
                _check_free(near, root, floor, min_free is None)
            finally:
                os.close(near)
        ensure_dir(root, 0o700)
        self._root_fd = os.open(root, _DIR_FLAGS)
        self.root = root
        self.keep = keep
        self.report: RemoveReport | None = None
        try:
            if floor:  # again, on the root itself (another filesystem may be mounted there)
                _check_free(self._root_fd, root, floor, min_free is None)
            self.name, self._fd = _make(self._root_fd)
        except BaseException:
            os.close(self._root_fd)
            raise
        self.path = os.path.join(root, self.name)
        self._ino = os.fstat(self._fd).st_ino

    def __enter__(self) -> Scratch:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.keep:
            self.keep_it()
        else:
            self.remove()

    def keep_it(self) -> str:
        """Let go of the directory, renamed ``kept-...`` so no sweep takes it; its path."""
        kept = KEPT + self.name[len(PREFIX) :]
        try:
            os.rename(self.name, kept, src_dir_fd=self._root_fd, dst_dir_fd=self._root_fd)
        except OSError:
            pass  # still ours under its run name; a sweep would see its lock free, though
        else:
            self.name, self.path = kept, os.path.join(self.root, kept)
        self.close()
        return self.path

    def remove(self) -> RemoveReport:
        """Remove everything in the directory, then the directory; never anything else."""
        if self.report is not None:
            return self.report
        report = RemoveReport(self.path)
        _empty(self._fd, self.path, os.fstat(self._fd).st_dev, 0, report)
        try:
            st = os.stat(self.name, dir_fd=self._root_fd, follow_symlinks=False)
            if st.st_ino != self._ino or not stat.S_ISDIR(st.st_mode):
                report.left.append((self.path, "the name is no longer the directory we made"))
            else:
                os.rmdir(self.name, dir_fd=self._root_fd)
        except OSError as e:
            report.left.append((self.path, e.strerror or str(e)))
        self.report = report
        self.close()
        return report

    def close(self) -> None:
        """Let go of the directory (and its lock) without removing it (``keep``)."""
        for fd in (self._fd, self._root_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._root_fd = -1


def _nearest(path: str) -> int:
    """A descriptor of ``path`` or of its nearest existing ancestor (for its free space)."""
    while True:
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            if path == os.path.dirname(path):
                raise
            path = os.path.dirname(path)


def _check_free(fd: int, root: str, min_free: int, default: bool) -> None:
    """Refuse less than ``min_free`` bytes free on the filesystem of ``fd``."""
    st = os.fstatvfs(fd)
    free = st.f_bavail * st.f_frsize
    if free < min_free:
        whose = (
            ": the default floor; the configuration's scratch: {min_free: SIZE} changes "
            "it, 0 turns it off"
            if default
            else ""
        )
        raise ScratchError(
            f"scratch: {_size(free)} free in {root}, {_size(min_free)} required (min_free)"
            f"{whose}; free some space or choose another root. Nothing was started"
        )


def _make(root_fd: int) -> tuple[str, int]:
    """A fresh directory in the root, opened and locked: (name, fd)."""
    for _ in range(16):
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        try:
            os.mkdir(name, 0o700, dir_fd=root_fd)
        except FileExistsError:
            continue
        fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fresh: nobody else has it
        return name, fd
    raise UnsafePath("could not make a fresh scratch directory (16 names taken)")


def _empty(fd: int, path: str, dev: int, depth: int, report: RemoveReport) -> None:
    """Remove every entry under the directory open at ``fd`` (``path`` for messages)."""
    try:
        entries = list(os.scandir(fd))
    except OSError as e:
        report.left.append((path, f"cannot list: {e.strerror}"))
        return
    for entry in entries:
        where = os.path.join(path, entry.name)
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
        except OSError:
            is_dir = False
        if is_dir:
            _remove_dir(fd, entry.name, where, dev, depth, report)
            continue
        try:
            os.unlink(entry.name, dir_fd=fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            report.left.append((where, e.strerror or str(e)))


def _remove_dir(
    parent: int, name: str, where: str, dev: int, depth: int, report: RemoveReport
) -> None:
    if depth >= MAX_DEPTH:
        report.left.append((where, f"deeper than {MAX_DEPTH} levels"))
        return
    try:
        sub = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as e:
        # ELOOP: it became a symlink since the listing; unlink the link itself.
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            try:
                os.unlink(name, dir_fd=parent)
                return
            except OSError as e2:
                e = e2
        report.left.append((where, e.strerror or str(e)))
        return
    try:
        if os.fstat(sub).st_dev != dev:
            report.left.append((where, "another filesystem is mounted here"))
            return
        _empty(sub, where, dev, depth + 1, report)
    finally:
        os.close(sub)
    try:
        os.rmdir(name, dir_fd=parent)
    except OSError as e:
        report.left.append((where, e.strerror or str(e)))


def sweep(root: str) -> list[RemoveReport]:
    """Remove the run directories in ``root`` whose owner is gone (their lock is free).

    Only names this module makes (``run-...``), only real directories of ours;
    a directory kept on purpose was renamed ``kept-...`` and is never swept.
    Returns a report for each directory removed.
    """
    try:
        root_fd = os.open(root, _DIR_FLAGS)
    except OSError:
        return []
    reports: list[RemoveReport] = []
    try:
        for entry in os.scandir(root_fd):
            if not entry.name.startswith(PREFIX) or not entry.is_dir(follow_symlinks=False):
                continue
            report = _sweep_one(root_fd, root, entry.name)
            if report is not None:
                reports.append(report)
    finally:
        os.close(root_fd)
    return reports


def _sweep_one(root_fd: int, root: str, name: str) -> RemoveReport | None:
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # its run is alive
        report = RemoveReport(os.path.join(root, name))
        _empty(fd, report.path, st.st_dev, 0, report)
        try:
            os.rmdir(name, dir_fd=root_fd)
        except OSError as e:
            report.left.append((report.path, e.strerror or str(e)))
        return report
    finally:
        os.close(fd)


def _size(n: int) -> str:
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor:
            return f"{n / factor:.1f} {unit}"
    return f"{n} bytes"


@contextlib.contextmanager
def scoped(
    keep: bool,
    say: Callable[[str], None],
    root: str | None = None,
    min_free: int | None = None,
) -> Iterator[Scratch]:
    """A fresh scratch for one run's scope (what killed runs left in ``root`` swept
    first), removed at the scope's end however it ends, or kept and its path said.
    ``min_free``: as :class:`Scratch`'s. Raises :class:`ScratchError`,
    :class:`UnsafePath` or ``OSError`` if none can be made."""
    root = root or default_root()
    sweep(root)
    scratch = Scratch(root, keep=keep, min_free=min_free)
    try:
        yield scratch
    finally:
        if scratch.keep:
            say(f"scratch kept: {scratch.keep_it()}")
        else:
            report = scratch.remove()
            if not report.clean:
                say(report.describe())
