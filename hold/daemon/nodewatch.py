"""The kernel's word on a device node: who opened it and when the last reference went.

``inotify`` on a node's inode reports ``IN_OPEN`` for every open of it,
through any path that reaches that inode (a hard link, a bind mount, a
symlink, ``/proc/PID/fd/N``), and ``IN_CLOSE_*`` only when the last
reference to that *open file* is gone: a descriptor inherited by a forked
child, a ``dup``, a descriptor passed over a Unix socket or a memory mapping
each keep the file open and send nothing until the last of them goes. So
the number of opens minus the number of closes, counted from a moment the
node was known to be closed by everyone, is the number of open files on it
now. Watching needs read access to the node and no privilege.

Three things keep that count from being exact; each is handled here as far
as it can be, and :mod:`hold.daemon.occupancy` trusts the count for no more
than what survives them ("no open since", and "held" while above zero):

* **Coalescing.** inotify merges an event into the previous one in the
  queue when both are identical and the older one is still unread (tried on
  Linux 6.18: two opens, then one read, give one ``IN_OPEN``). Two opens of
  one node in a row would count as one, and the first close would bring the
  count to zero while the second file is still open. So the node's parent
  directory is watched too, in the same inotify instance: an open through
  the node's own path then queues two events, the directory's (with the
  name) and the node's, and two opens in a row queue directory, node,
  directory, node -- never two identical events next to each other. What
  remains: two opens on two CPUs whose four events interleave (directory,
  directory, node, node) still merge, with no sign of it -- not rare: two
  processes opening one node 2,000 times each, unread, were counted 3,722
  times. An open
  through another path (a bind mount of the node, a hard link in another
  directory) has no directory event before it: such an open is
  **unpaired**, and a count with an unpaired open in it is not exact.
* **Overflow.** When the queue is full (``max_queued_events``) the kernel
  drops events and says so (``IN_Q_OVERFLOW``): every count is lost.
* **A node replaced.** A watch follows its inode, not its path: a node
  removed and made again (udev, a driver reload) is another inode, whose
  opens the old watch never sees. :meth:`NodeWatch.current` compares the
  path's inode with the watched one.

A watch sees only its own inode. A node of the same device with another
inode (``mknod`` elsewhere, a container's own ``/dev`` on a tmpfs) sends it
nothing: :mod:`hold.daemon.mountns` finds such nodes in every mount namespace
and watches them here too (:meth:`NodeWatch.watch_other`: no directory beside
them, so each of their opens is unpaired), and watches the directories they
were made in for new ones (:meth:`NodeWatch.watch_made`).

The watch only counts; whether a count may be believed (what the scan that
started it saw, what happened since) is :mod:`hold.daemon.occupancy`'s question.
The instance is shared by the daemon's event loop and its worker threads:
every method takes the watch's lock.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import threading
from dataclasses import dataclass

from hold.errors import HoldError

IN_CLOSE_WRITE = 0x00000008
IN_CLOSE_NOWRITE = 0x00000010
IN_OPEN = 0x00000020
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_DONT_FOLLOW = 0x02000000
IN_MASK_CREATE = 0x10000000
IN_MASK_ADD = 0x20000000
IN_CLOSE = IN_CLOSE_WRITE | IN_CLOSE_NOWRITE

NODE_MASK = IN_OPEN | IN_CLOSE | IN_DELETE_SELF | IN_MOVE_SELF
DIR_MASK = IN_OPEN | IN_CLOSE | IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO
MADE_MASK = IN_CREATE | IN_MOVED_TO  # a directory where a node may be made (watch_made)
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len (struct inotify_event)


class WatchUnavailable(HoldError):
    """No inotify here, or the node cannot be watched (no read access, gone): the
    device's emptiness is then proved by scans (the daemon logs why)."""


@dataclass
class Counted:
    """One watched inode: its path, and what the kernel said since :meth:`NodeWatch.reset`.

    ``open_files``: opens minus closes, never below zero; ``events``: every
    open and close (a scan that saw none arrive while it ran saw a still
    node); ``opened``: an open arrived; ``unpaired``: an open arrived that
    did not come through the watched path (its count may be short);
    ``unmatched``: a close arrived with the count at zero (a file opened
    before the count started, or an open lost to coalescing); ``lost``: the
    count is gone (overflow, the node replaced or removed) and says why.
    """

    path: str
    dev: int
    ino: int
    wd: int
    parent_wd: int
    name: bytes
    open_files: int = 0
    events: int = 0
    opened: bool = False
    unpaired: bool = False
    unmatched: bool = False
    lost: str | None = None


class NodeWatch:
    """One inotify instance counting the open files of a set of nodes."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._add = libc.inotify_add_watch
        self._add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self._rm = libc.inotify_rm_watch
        self._rm.argtypes = [ctypes.c_int, ctypes.c_int]
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            raise WatchUnavailable(f"inotify_init1: {os.strerror(ctypes.get_errno())}")
        self.fd: int = fd
        self._lock = threading.Lock()
        self._nodes: dict[int, Counted] = {}  # node watch descriptor -> its count
        self._dirs: dict[int, str] = {}  # parent directory's watch descriptor -> its path
        # Directories watched for new entries (watch_made) -> who asked (a tag);
        # the tags whose directory gained an entry since the last take_made.
        self._made: dict[int, object] = {}
        self._made_since: set[object] = set()
        self._last: tuple[int, int, bytes] | None = None  # the previous event (wd, mask, name)
        self.overflows = 0

    def close(self) -> None:
        with self._lock:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
            self._nodes.clear()
            self._dirs.clear()

    def watch(self, path: str) -> Counted:
        """Start counting the open files of the inode ``path`` names now.

        The count starts at zero *now*: files opened before are invisible to
        it, which is why a scan must say where it starts from. Raises
        :class:`WatchUnavailable` where the node cannot be watched.
        """
        real = os.path.realpath(path)
        parent, name = os.path.split(real)
        with self._lock:
            wd = self._add_watch(real, NODE_MASK)
            try:
                st = os.stat(real)
            except OSError as e:
                raise WatchUnavailable(f"{real}: {e.strerror}") from None
            # Several nodes in one directory share its watch (IN_MASK_ADD keeps
            # one descriptor per inode, as the kernel does).
            pwd = self._add_watch(parent, DIR_MASK | IN_MASK_ADD)
            self._dirs[pwd] = parent
            counted = self._nodes.get(wd)
            if counted is None or (counted.dev, counted.ino) != (st.st_dev, st.st_ino):
                counted = Counted(real, st.st_dev, st.st_ino, wd, pwd, name.encode())
                self._nodes[wd] = counted
            return counted

    def watch_other(self, path: str) -> Counted | None:
        """Start counting the open files of the inode ``path`` names, a node found
        outside the configuration (see :mod:`hold.daemon.mountns`; the path is
        resolved in the calling thread's mount namespace, and not followed if
        it is a symbolic link). None where that inode is counted already (a
        bind mount of a node watched here through :meth:`watch`); the count
        already kept where it was found before by this method (a look cut
        short may have watched it and said nothing). Its parent directory is
        not watched: every open of it counts as unpaired. Raises
        :class:`WatchUnavailable` where it cannot be watched.
        """
        with self._lock:
            try:
                st = os.lstat(path)
            except OSError as e:
                raise WatchUnavailable(f"{path}: {e.strerror}") from None
            for c in self._nodes.values():
                if (c.dev, c.ino) == (st.st_dev, st.st_ino):
                    return c if c.parent_wd == -1 else None
            # IN_MASK_CREATE: an inode watched already keeps its mask (an
            # add without it would replace the mask of that watch).
            mask = NODE_MASK | IN_DONT_FOLLOW | IN_MASK_CREATE
            wd = int(self._add(self.fd, os.fsencode(path), mask))
            if wd < 0:
                err = ctypes.get_errno()
                if err == errno.EEXIST:
                    return None
                raise WatchUnavailable(f"inotify_add_watch {path}: {os.strerror(err)}")
            counted = Counted(path, st.st_dev, st.st_ino, wd, -1, b"")
            self._nodes[wd] = counted
            return counted

    def watch_made(self, path: str, tag: object) -> None:
        """Note ``tag`` in :meth:`take_made` when an entry is made in directory ``path``
        (resolved in the calling thread's mount namespace, not followed)."""
        with self._lock:
            wd = self._add_watch(path, MADE_MASK | IN_DONT_FOLLOW | IN_MASK_ADD)
            self._made[wd] = tag

    def forget_made(self, tag: object) -> None:
        """Stop watching the directories :meth:`watch_made` watches for ``tag``."""
        with self._lock:
            for wd in [w for w, t in self._made.items() if t == tag]:
                del self._made[wd]
                if wd not in self._dirs and wd not in self._nodes:
                    self._rm(self.fd, wd)
            self._made_since.discard(tag)

    def take_made(self) -> set[object]:
        """The tags whose directories gained an entry since the last call."""
        with self._lock:
            out, self._made_since = self._made_since, set()
            return out

    def restore_made(self, tags: set[object]) -> None:
        """Give back what :meth:`take_made` gave, not acted on."""
        with self._lock:
            self._made_since |= tags

    def _add_watch(self, path: str, mask: int) -> int:
        wd = int(self._add(self.fd, os.fsencode(path), mask))
        if wd < 0:
            err = ctypes.get_errno()
            raise WatchUnavailable(f"inotify_add_watch {path}: {os.strerror(err)}")
        return wd

    def forget(self, counted: Counted) -> None:
        """Stop counting ``counted`` (its parent directory's watch stays while others use it)."""
        with self._lock:
            if self._nodes.pop(counted.wd, None) is not None:
                self._rm(self.fd, counted.wd)
            shared = any(c.parent_wd == counted.parent_wd for c in self._nodes.values())
            if not shared and self._dirs.pop(counted.parent_wd, None) is not None:
                self._rm(self.fd, counted.parent_wd)

    def reset(self, counted: Counted) -> None:
        """Start ``counted``'s count again from zero (a scan found the node closed)."""
        with self._lock:
            counted.open_files = 0
            counted.opened = counted.unpaired = counted.unmatched = False
            counted.lost = None

    def current(self, counted: Counted) -> bool:
        """Does ``counted.path`` still name the watched inode (one ``stat``)?"""
        try:
            st = os.stat(counted.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == (counted.dev, counted.ino)

    def drain(self) -> set[int]:
        """Read every event the kernel has queued; the watch descriptors whose count moved.

        Called by the event loop when the descriptor is readable, and by a
        worker before it believes a count (the kernel queues an event before
        the system call that caused it returns, so after a drain every open
        and close that has happened is counted).
        """
        moved: set[int] = set()
        with self._lock:
            while self.fd >= 0:
                try:
                    data = os.read(self.fd, 65536)
                except (BlockingIOError, InterruptedError):
                    break
                self._parse(data, moved)
        return moved

    def _parse(self, data: bytes, moved: set[int]) -> None:
        pos = 0
        while pos + _HEADER.size <= len(data):
            wd, mask, _cookie, size = _HEADER.unpack_from(data, pos)
            name = data[pos + _HEADER.size : pos + _HEADER.size + size].rstrip(b"\0")
            pos += _HEADER.size + size
            last, self._last = self._last, (wd, mask, name)
            if mask & IN_Q_OVERFLOW:
                self.overflows += 1
                for c in self._nodes.values():
                    c.lost = "the event queue overflowed"
                    moved.add(c.wd)
                continue
            if wd in self._made:
                if mask & (IN_CREATE | IN_MOVED_TO):
                    self._made_since.add(self._made[wd])
                elif mask & IN_IGNORED:  # its file system is gone (a container's /dev)
                    del self._made[wd]
            counted = self._nodes.get(wd)
            if counted is not None:
                self._on_node(counted, mask, last)
                moved.add(wd)
            elif wd in self._dirs and mask & (IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO):
                for c in self._nodes.values():
                    if c.parent_wd == wd and c.name == name:
                        c.lost = f"{c.path} was removed, made or renamed"
                        moved.add(c.wd)

    @staticmethod
    def _on_node(c: Counted, mask: int, last: tuple[int, int, bytes] | None) -> None:
        if mask & IN_OPEN:
            c.events += 1
            c.open_files += 1
            c.opened = True
            # Through the watched path the directory's event comes first, from
            # the same open (see the module docstring); anything else may have
            # merged with a neighbour.
            if last is None or last != (c.parent_wd, IN_OPEN, c.name):
                c.unpaired = True
        if mask & IN_CLOSE:
            c.events += 1
            if c.open_files == 0:
                # A close may never cancel an open it cannot be matched to.
                c.unmatched = True
            else:
                c.open_files -= 1
        if mask & (IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED):
            c.lost = f"{c.path}: the watched inode was removed or moved"
