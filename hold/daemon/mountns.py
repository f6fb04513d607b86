"""Every node of a device, in every mount namespace: what the kernel's count of
opens must also watch before it may prove a device empty.

A watch counts the opens of one inode (:mod:`hold.daemon.nodewatch`). A
container runtime running as root gives a container its own ``/dev`` on a
tmpfs, with device nodes made by ``mknod`` (Docker and Podman ``--device``,
CDI, Kubernetes device plugins): the same device number, another inode, in a
mount namespace the daemon's paths never reach. Its opens reach no watch on
the host's node, and a grant by the count alone was made over such a holder
(issue 45). So the daemon keeps a list of the machine's mount namespaces and
watches, in each, every node of a tracked device that it finds:

* **Which namespaces exist.** The kernel lists them itself: an ``nsfs``
  descriptor of a mount namespace answers ``NS_MNT_GET_NEXT`` and
  ``NS_MNT_GET_PREV`` (Linux 6.12) with its neighbours in the kernel's list,
  together with each one's id and number of mounts. One walk costs one
  ``ioctl`` and one ``close`` per namespace: it grows with the namespaces
  (50 containers, 50 steps), never with the processes. It needs
  ``CAP_SYS_ADMIN`` over them (a daemon running as root).
* **Which nodes a namespace has.** A new namespace (or one whose number of
  mounts changed, or where an entry was made in a directory watched below)
  is looked into from a short-lived thread that enters it (``unshare
  CLONE_FS``, ``setns``) and reads its mount table: every mount whose mount
  point is itself a node of a tracked device (a bind-mounted node), every
  tmpfs or devtmpfs mounted at or under ``/dev`` (a container's ``/dev``),
  walked a few levels deep, and the configured node patterns. Each node found
  is watched through that thread's path (a watch follows the inode, in any
  namespace); the directories it was found in are watched for new entries
  (a ``mknod`` after the look).
* **What a late watch means.** A node watched after its namespace appeared
  may have been opened before: its device's count starts over (the next
  grant of it scans, see :mod:`hold.daemon.occupancy`). Once per container
  and device, not once per grant.

What this does not see: a node made by ``mknod`` on a file system that is
neither mounted on ``/dev`` nor itself a bind-mounted node (say a container's
root file system), opened after the look that would have found it. A holder
that opened it before the look is found by the scan that the look's news
starts. The system daemon (root) on Linux 6.12 or later is the only one that
can walk the namespaces; elsewhere :attr:`MountNamespaces.unavailable` says
why, and :mod:`hold.daemon.occupancy` decides what the count is worth then.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import glob
import os
import stat
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from hold.daemon.nodewatch import Counted, NodeWatch, WatchUnavailable
from hold_supervisor.proc import scan as procscan

_NSIO = 0xB7
_INFO = struct.Struct("IIQ")  # struct mnt_ns_info: size, nr_mounts, mnt_ns_id


def _ior(nr: int) -> int:
    return (2 << 30) | (_INFO.size << 16) | (_NSIO << 8) | nr


NS_MNT_GET_INFO = _ior(10)
NS_MNT_GET_NEXT = _ior(11)
NS_MNT_GET_PREV = _ior(12)
CLONE_FS = 0x00000200
CLONE_NEWNS = 0x00020000

# File systems whose mount points may be looked at (lstat) from a namespace
# the daemon does not control: local ones. A stat of a FUSE or network mount
# point can wait on a server for ever.
LOCAL_FS = frozenset(
    {
        "tmpfs",
        "devtmpfs",
        "ramfs",
        "ext2",
        "ext3",
        "ext4",
        "xfs",
        "btrfs",
        "overlay",
        "zfs",
        "f2fs",
        "squashfs",
        "erofs",
    }
)
DEV_FS = frozenset({"tmpfs", "devtmpfs", "ramfs"})  # what a /dev is made of
WALK_DEPTH = 3  # levels below a /dev mount: /dev/dri/by-path/x is as deep as nodes go
WALK_ENTRIES = 5000  # entries read in one namespace at most (a look is on a grant's path)
LOOK_DEADLINE = 5.0  # seconds one namespace's look may take


@dataclass
class Found:
    """What one look into a namespace found: nodes of tracked devices, and what was cut short."""

    nodes: list[tuple[str, Counted]] = field(default_factory=list)  # (device key, its new watch)
    errors: list[str] = field(default_factory=list)  # what could not be looked at, and why
    # Nodes of a tracked device found and not watched (no inotify watch left,
    # say): device key -> why. Their opens are counted by nobody.
    unwatched: dict[str, str] = field(default_factory=dict)
    again: bool = False  # cut short by something passing (out of descriptors): look again


@dataclass
class _Known:
    nr_mounts: int


class MountNamespaces:
    """The machine's mount namespaces, and a watch on each tracked device's nodes in them.

    ``unavailable``: why the namespaces cannot be walked here (None where they
    can). Thread-safe: one walk at a time.
    """

    def __init__(self, watch: NodeWatch) -> None:
        self.watch = watch
        self._lock = threading.Lock()
        self._known: dict[int, _Known] = {}  # namespace id -> what it had at its last look
        self.unavailable: str | None = None
        try:
            self._own = procscan.open_ns("self", "mnt")
            self._proc = procscan.open_dir()
            for _ in self._each():  # can they be listed here at all?
                pass
        except OSError as e:
            self.unavailable = _why(e)

    def __len__(self) -> int:
        return len(self._known)

    def forget(self) -> None:
        """Look into every namespace again at the next :meth:`refresh` (the tracked
        devices changed)."""
        with self._lock:
            for ns_id in self._known:
                self.watch.forget_made(ns_id)
            self._known.clear()

    def refresh(self, devices: dict[tuple[str, int], str], patterns: list[str]) -> Found:
        """Look into every namespace that is new or changed since the last call; the
        nodes of ``devices`` (``("c"|"b", rdev)`` -> device key) found there and
        now watched. ``patterns``: the configured node patterns, looked up in
        each namespace too. Costs one walk of the namespace list when nothing
        changed. Raises :class:`OSError` where the list could not be read this
        time (out of descriptors): nothing is known of the namespaces then."""
        out = Found()
        if self.unavailable is not None:
            return out
        made = self.watch.take_made()
        with self._lock:
            listed: set[int] = set()
            try:
                for ns_id, nr, fd in self._each():
                    listed.add(ns_id)
                    old = self._known.get(ns_id)
                    if old is not None and old.nr_mounts == nr and ns_id not in made:
                        continue
                    self._known[ns_id] = _Known(nr)
                    self.watch.forget_made(ns_id)
                    found = self._look(ns_id, fd, devices, patterns)
                    out.nodes += found.nodes
                    out.errors += found.errors
                    out.unwatched.update(found.unwatched)
                    if found.again or found.unwatched:
                        del self._known[ns_id]  # looked into again at the next refresh
            except OSError as e:
                if e.errno in (errno.ENOTTY, errno.EPERM, errno.EINVAL):
                    self.unavailable = _why(e)  # for good: this kernel, this daemon
                    return out
                self.watch.restore_made(made)
                raise
            for ns_id in [n for n in self._known if n not in listed]:
                del self._known[ns_id]  # gone: its nodes' watches end with their inodes
                self.watch.forget_made(ns_id)
        return out

    def _each(self) -> Iterator[tuple[int, int, int]]:
        """Every mount namespace: (its id, its number of mounts, a descriptor of it that
        is good until the next is yielded). One descriptor at a time: a daemon
        near its limit (a flood of clients) must not run out for a walk of 50."""
        buf = bytearray(_INFO.pack(_INFO.size, 0, 0))
        fcntl.ioctl(self._own, NS_MNT_GET_INFO, buf)
        _size, nr, ns_id = _INFO.unpack(buf)
        yield ns_id, nr, self._own
        for step in (NS_MNT_GET_PREV, NS_MNT_GET_NEXT):
            cur = self._own
            try:
                while True:
                    buf = bytearray(_INFO.pack(_INFO.size, 0, 0))
                    try:
                        fd = fcntl.ioctl(cur, step, buf)
                    except OSError as e:
                        if e.errno == errno.ENOENT:
                            break  # the end of the list
                        raise
                    if cur != self._own:
                        os.close(cur)
                    cur = fd
                    _size, nr, ns_id = _INFO.unpack(buf)
                    yield ns_id, nr, fd
            finally:
                if cur != self._own:
                    os.close(cur)

    def _look(
        self, ns_id: int, fd: int, devices: dict[tuple[str, int], str], patterns: list[str]
    ) -> Found:
        """Look into namespace ``fd`` from a thread of its own (see the module docstring)."""
        found = Found()

        def enter_and_look() -> None:
            try:
                _enter(fd)
                _find(self.watch, self._proc, ns_id, devices, patterns, found)
            except OSError as e:
                found.errors.append(f"mount namespace {ns_id}: {_why(e)}")
                found.again = e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM)

        t = threading.Thread(target=enter_and_look, name=f"mountns-{ns_id}", daemon=True)
        t.start()
        t.join(LOOK_DEADLINE)
        if t.is_alive():
            found.errors.append(f"mount namespace {ns_id}: no answer in {LOOK_DEADLINE:.0f} s")
            found.again = True
        return found


_libc = ctypes.CDLL(None, use_errno=True)


def _enter(fd: int) -> None:
    """Move the calling thread (only) into mount namespace ``fd``."""
    # A thread shares its file system context (root, cwd) with the others, and
    # setns(CLONE_NEWNS) refuses a shared one: unshare it for this thread first.
    if _libc.unshare(CLONE_FS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_FS): {os.strerror(err)}")
    if _libc.setns(fd, CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _find(
    watch: NodeWatch,
    proc: int,
    ns_id: int,
    devices: dict[tuple[str, int], str],
    patterns: list[str],
    found: Found,
) -> None:
    """In the calling thread's mount namespace: watch every node of ``devices``."""
    budget = [WALK_ENTRIES]
    seen: set[str] = set()

    def node(path: str, st: os.stat_result) -> None:
        kind = "c" if stat.S_ISCHR(st.st_mode) else "b" if stat.S_ISBLK(st.st_mode) else None
        key = devices.get((kind, st.st_rdev)) if kind else None
        if key is None or path in seen:
            return
        seen.add(path)
        try:
            counted = watch.watch_other(path)
        except WatchUnavailable as e:
            found.errors.append(str(e))
            found.unwatched[key] = f"{path}: {e}"
            return
        if counted is not None:
            found.nodes.append((key, counted))

    # The mount table as this thread sees it now: /proc of the daemon's own
    # pid namespace (the namespace's own /proc may be another or none).
    with open(os.open("thread-self/mountinfo", os.O_RDONLY, dir_fd=proc), "rb") as f:
        table = f.read().decode("utf-8", "surrogateescape")
    for line in table.splitlines():
        point, fstype = _mount_of(line)
        if point is None or fstype not in LOCAL_FS:
            continue
        try:
            st = os.lstat(point)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            if fstype in DEV_FS and _is_dev(point):
                _walk_dev(watch, point, ns_id, node, budget, found)
        else:
            node(point, st)  # a node bind-mounted onto its own mount point
    for pattern in patterns:
        for path in glob.glob(pattern):
            try:
                node(path, os.lstat(path))
            except OSError:
                continue


def _walk_dev(
    watch: NodeWatch,
    top: str,
    ns_id: int,
    node: Callable[[str, os.stat_result], None],
    budget: list[int],
    found: Found,
) -> None:
    """Every node in the /dev mount at ``top`` (a few levels down); its directories
    are watched for entries made later."""
    todo = [(top, 0)]
    while todo:
        path, depth = todo.pop()
        try:
            watch.watch_made(path, ns_id)
            entries = list(os.scandir(path))
        except (OSError, WatchUnavailable) as e:
            found.errors.append(f"{path}: {e}")
            continue
        for entry in entries:
            budget[0] -= 1
            if budget[0] < 0:
                found.errors.append(f"{top}: more than {WALK_ENTRIES} entries, not all looked at")
                return
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                if depth < WALK_DEPTH and not entry.is_symlink():
                    todo.append((entry.path, depth + 1))
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                node(entry.path, st)


def _is_dev(point: str) -> bool:
    """A mount that a /dev is made of: /dev itself or one below it -- not /dev/shm,
    a tmpfs for POSIX shared memory that programs fill with files all day (each
    new entry would look into the namespace again), and no place for nodes."""
    if point == "/dev/shm" or point.startswith("/dev/shm/"):
        return False
    return point == "/dev" or point.startswith("/dev/")


def _mount_of(line: str) -> tuple[str | None, str]:
    """A mountinfo line's mount point (octal escapes undone) and file system type."""
    head, sep, tail = line.partition(" - ")
    fields = head.split(" ")
    if not sep or len(fields) < 5:
        return None, ""
    point = fields[4]
    for esc, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        point = point.replace(esc, char)
    return point, tail.split(" ", 1)[0]


def _why(e: OSError) -> str:
    if e.errno == errno.ENOTTY:
        return "this kernel cannot list mount namespaces (NS_MNT_GET_NEXT, Linux 6.12)"
    if e.errno == errno.EPERM:
        return "listing mount namespaces needs CAP_SYS_ADMIN (the system daemon, root)"
    return os.strerror(e.errno) if e.errno else str(e)
