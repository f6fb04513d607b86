"""One pass over ``/proc``: who is there, who carries a marker, who holds what.

Parsed by hand rather than through psutil: the stop path and the survivor
check read every process on the machine, sometimes several times in a row,
and psutil builds a Python object (and opens several files) per process where
one read of ``/proc/PID/stat`` is enough. Every function here tolerates
processes that vanish mid-scan and reports the ones it may not read.
"""

from __future__ import annotations

import os
import stat as stat_mod
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Generic, NamedTuple, TypeVar

from hold_supervisor.proc.identity import AccessDenied, NoSuchProcess, Stat, read_stat

# Character devices every process holds and no tree owns exclusively.
_COMMON_CHAR_DEVICES: frozenset[tuple[int, int]] = frozenset(
    {(1, 3), (1, 5), (1, 7), (1, 8), (1, 9), (5, 0), (5, 1), (5, 2)}
    # null, zero, full, random, urandom, tty, console, ptmx
)
_PTS_MAJORS = frozenset(range(136, 144))  # /dev/pts/*

T = TypeVar("T")


def pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def stat_of(pid: int) -> Stat | None:
    """``/proc/PID/stat`` parsed (:func:`~hold_supervisor.proc.identity.read_stat`), or None
    if the process is gone or may not be read: for scans, where a process that
    vanished mid-scan is simply not there."""
    try:
        return read_stat(pid)
    except (NoSuchProcess, AccessDenied, OSError, ValueError, IndexError):
        return None


def stall_hint(pid: int | None, *, waiting: bool = True) -> str:
    """Why a process may not be answering, where its state says so: ``" (its
    process is stopped: ...)"`` (SIGSTOP, a debugger), or with ``waiting`` also
    ``" (its process waits in the kernel: ...)"`` (a disk, a mount); else ``""``.
    For messages about a daemon or a supervisor that did not answer."""
    st = stat_of(pid) if pid is not None else None
    if st is None:
        return ""
    if st.state in ("T", "t"):
        return " (its process is stopped: SIGSTOP or a debugger)"
    if waiting and st.state == "D":
        return " (its process waits in the kernel: a disk or a mount)"
    return ""


def fds(pid: int | str) -> list[tuple[int, str]]:
    """The open descriptors of ``pid`` (``"self"`` for this process): (number,
    its ``/proc/PID/fd/N`` path, to stat or readlink).

    The one walk of a process's descriptors. Raises :class:`OSError` when the
    listing may not be read (:class:`PermissionError`) or the process is gone.
    """
    base = f"/proc/{pid}/fd"
    return [(int(name), f"{base}/{name}") for name in os.listdir(base)]


def ticks_at(wall: float) -> int:
    """The start time (clock ticks since boot, as in /proc/PID/stat) of a
    process started at ``wall`` (seconds since the epoch).

    From /proc/uptime (1/100 s), not /proc/stat's btime, which is rounded to
    whole seconds: a second's error would misplace a process started just
    after ``wall``.
    """
    with open("/proc/uptime", "rb") as f:
        uptime = float(f.read().split()[0])
    return int((uptime - (time.time() - wall)) * os.sysconf("SC_CLK_TCK"))


def read_raw(pid: int | str, name: str) -> bytes:
    """The whole file ``/proc/PID/NAME`` (``"self"`` for this process) with plain
    system calls (no buffered file object per file).

    Raises :class:`PermissionError` (a process we may not inspect); ``b""`` if
    it is gone (or the file is not there).
    """
    try:
        fd = os.open(f"/proc/{pid}/{name}", os.O_RDONLY | os.O_CLOEXEC)
    except PermissionError:
        raise
    except OSError:
        return b""
    try:
        chunks: list[bytes] = []
        while True:
            chunk = os.read(fd, 262144)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    except PermissionError:
        raise
    except OSError:
        return b""
    finally:
        os.close(fd)


def status_line(pid: int | str, key: bytes) -> bytes | None:
    """The first line of ``/proc/PID/status`` that starts with ``key`` (``b"NSpid:"``),
    whole; None if it has none. Raises :class:`OSError` if it may not be read."""
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(key):
                return line
    return None


def open_dir() -> int:
    """A descriptor of ``/proc`` itself: for reads relative to it (``thread-self/...``)
    from a thread that entered another mount namespace, where the path /proc
    may name another pid namespace's file system, or nothing."""
    return os.open("/proc", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def open_ns(pid: int | str, kind: str) -> int:
    """A descriptor of the ``kind`` namespace (``"mnt"``, ``"pid"``...) of ``pid``."""
    return os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)


def exe(pid: int | str) -> str:
    """The program the process runs (the ``/proc/PID/exe`` link). Raises
    :class:`FileNotFoundError` where it has none (a kernel thread, or gone) and
    other :class:`OSError` where it may not be read."""
    return os.readlink(f"/proc/{pid}/exe")


def uid_of(pid: int) -> int | None:
    """The owner of the process's ``/proc`` directory (its effective uid, unless
    it is not dumpable: then root); None if it is gone or may not be looked at."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def listed(pid: int) -> bool:
    """Does ``/proc`` list ``pid`` now?"""
    return os.path.exists(f"/proc/{pid}")


def thread_count(pid: int | str = "self") -> int:
    """How many threads the process has (the kernel's count, C threads included).
    Raises :class:`OSError` if it may not be read."""
    return len(os.listdir(f"/proc/{pid}/task"))


def fdinfos(pid: int) -> Iterator[bytes]:
    """The ``/proc/PID/fdinfo/N`` text of each open descriptor that can still be read."""
    base = f"/proc/{pid}/fdinfo"
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        try:
            with open(f"{base}/{name}", "rb") as f:
                yield f.read()
        except OSError:
            continue


def _read_unbuffered(path: str) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return f.read()


KTHREADD = 2  # the kernel's thread starter: the parent of every kernel thread
PF_KTHREAD = 0x00200000  # /proc/PID/stat flags: a kernel thread


def kernel_threads() -> frozenset[int]:
    """The kernel threads now: kthreadd (pid 2, checked to be one) and those of its
    children that have no program (``exe``); empty where pid 2
    is no kernel thread (inside a pid namespace it is anyone's) or the kernel
    lacks the ``children`` file: then every process is read. A kthreadd child
    that is exiting has no ``exe`` either; it holds nothing a moment later."""
    try:
        fields = _read_unbuffered(f"/proc/{KTHREADD}/stat").rsplit(b")", 1)[1].split()
        if not int(fields[6]) & PF_KTHREAD:
            return frozenset()
    except (OSError, IndexError, ValueError):
        return frozenset()
    out = {KTHREADD}
    for pid in kthreadd_children():
        try:
            os.readlink(f"/proc/{pid}/exe")
        except FileNotFoundError:
            out.add(pid)
        except OSError:
            pass  # may not look: read it as any other process
    return frozenset(out)


def kthreadd_children() -> set[int]:
    try:
        return {
            int(p) for p in _read_unbuffered(f"/proc/{KTHREADD}/task/{KTHREADD}/children").split()
        }
    except (OSError, ValueError):
        return set()


def pid_cursor() -> int:
    """The last pid the kernel handed out in our pid namespace (the last field but
    one of ``/proc/loadavg``)."""
    return int(_read_unbuffered("/proc/loadavg").split()[4])


def flock_holders() -> dict[tuple[int, int, int], int]:
    """``(major, minor, inode)`` of every file with a flock held now -> the pid that
    took it, from ``/proc/locks`` (waiters left out); empty if it may not be read.
    The pid is the kernel's word, unlike anything written in the file; it may be
    gone while the lock lives on (a descriptor passed on before it exited)."""
    out: dict[tuple[int, int, int], int] = {}
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
            out[(int(maj, 16), int(mnr, 16), int(ino))] = int(parts[4])
        except ValueError:
            continue
    return out


def flocked_files() -> set[tuple[int, int, int]]:
    """The files of :func:`flock_holders`."""
    return set(flock_holders())


def children_of(pid: int) -> list[int] | None:
    """``pid``'s children, from ``/proc/PID/task/*/children`` (no scan of every
    process); [] once it is gone, None where the kernel lacks that file."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out: list[int] = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out += [int(x) for x in f.read().split()]
        except FileNotFoundError:
            if tid == str(pid) and os.path.isdir(f"/proc/{pid}/task/{tid}"):
                return None  # CONFIG_PROC_CHILDREN off
            continue  # a thread that ended while we looked
        except OSError:
            continue
    return out


def children_of_self() -> list[int]:
    """This process's children, from ``/proc/self/task/*/children`` (no scan of
    every process); falls back to a scan where the kernel lacks that file."""
    if not os.path.exists(f"/proc/self/task/{os.getpid()}/children"):  # CONFIG_PROC_CHILDREN off
        me = os.getpid()
        return [st.pid for st in snapshot().values() if st.ppid == me]
    out: list[int] = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children", "rb") as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            continue  # a thread that ended while we looked
    return out


def snapshot() -> dict[int, Stat]:
    """Every live process now, by pid (zombies included; see :attr:`Stat.is_dead`)."""
    out: dict[int, Stat] = {}
    for pid in pids():
        st = stat_of(pid)
        if st is not None:
            out[pid] = st
    return out


class Stats(Mapping[int, Stat]):
    """Processes by pid, each read from ``/proc/PID/stat`` when first asked for
    and kept: what :func:`ancestors` needs for a few pids, without a
    :func:`snapshot` of every process on the machine. A pid that is gone (or
    may not be read) is absent. Iterating gives only the pids asked for so far.
    """

    def __init__(self) -> None:
        self._read: dict[int, Stat | None] = {}

    def __getitem__(self, pid: int) -> Stat:
        try:
            st = self._read[pid]
        except KeyError:
            st = self._read[pid] = stat_of(pid)
        if st is None:
            raise KeyError(pid)
        return st

    def __iter__(self) -> Iterator[int]:
        return iter([pid for pid, st in self._read.items() if st is not None])

    def __len__(self) -> int:
        return sum(1 for st in self._read.values() if st is not None)


# How long a read of a process's environment waits for an execve under way to
# finish (see environ): the window is microseconds of the process's own time,
# but a loaded machine may not run it for a while.
_EXEC_WAIT = 2.0


def environ(pid: int) -> bytes | None:
    """The process's initial environment (``/proc/PID/environ``), read after any
    execve under way has finished (waiting at most ``_EXEC_WAIT``); None if it
    is gone. Raises ``PermissionError`` if it may not be read.

    An execve replaces the memory first and places the new arguments and
    environment in it last. In between -- after the close-on-exec descriptors
    are closed, so after a parent waiting on such a pipe saw the exec succeed
    -- the environment reads empty, and a child spawned with a tree's marker
    read then would be taken for no member. Measured on a 2-vCPU VM beside two
    busy loops: 295 of 300 children read at once after spawn were in that
    window. Its stat says so (:attr:`~hold_supervisor.proc.identity.Stat.in_exec`),
    so an empty read is looked at again, and waited for while an exec is under
    way. An exec done is not enough: a chain of execs (``sh -c 'exec env ...
    cmd'``) may begin the next one between the look and the next read, which
    then reads empty too (1 read in 53 beside busy loops on a 16-core host). So
    an environment is taken to be empty only when a read found it so between
    two looks at the same memory (the same ``env_end``, no exec under way). One
    still changing at the deadline (its binary stuck on a hung mount) is read as
    it is: empty.
    """
    deadline: float | None = None
    delay = 0.0005
    settled: int | None = None  # env_end of the last look that found no exec under way
    while True:
        data = _read_environ(pid)
        if data != b"":
            return data
        st = stat_of(pid)
        if st is None:
            return None
        now = time.monotonic()
        if deadline is None:
            deadline = now + _EXEC_WAIT
        elif now >= deadline:
            return data
        if not st.in_exec:
            if st.env_end == settled:
                return data
            # Read again at once: if that is empty too, the next look says
            # whether an exec came between.
            settled = st.env_end
        else:
            settled = None
            time.sleep(delay)
            delay = min(delay * 2, 0.01)


def _read_environ(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except PermissionError:
        raise
    except OSError:
        return None


def environ_has(pid: int, entry: bytes) -> bool | None:
    """Does the process's initial environment contain ``entry`` exactly (read by
    :func:`environ`)? ``None`` when it may not be read (another user's process,
    without root)."""
    try:
        data = environ(pid)
    except PermissionError:
        return None
    return data is not None and (b"\0" + entry + b"\0") in (b"\0" + data)


def environ_value(pid: int, name: bytes) -> str | None:
    """``name``'s value in the process's initial environment (read by
    :func:`environ`); None if it has none or may not be read."""
    try:
        data = environ(pid)
    except PermissionError:
        return None
    for entry in (data or b"").split(b"\0"):
        if entry.startswith(name + b"="):
            return entry[len(name) + 1 :].decode(errors="replace")
    return None


class Node(NamedTuple):
    """A file or device node, by device number and inode, not by path text."""

    dev: int
    ino: int
    rdev: int  # for device nodes, the device they open; 0 otherwise
    path: str  # what it was seen as, for messages only

    @property
    def key(self) -> tuple[int, int]:
        return (self.dev, self.ino)


def node_of_stat(st: os.stat_result, path: str) -> Node:
    rdev = st.st_rdev if stat_mod.S_ISCHR(st.st_mode) or stat_mod.S_ISBLK(st.st_mode) else 0
    return Node(st.st_dev, st.st_ino, rdev, path)


def is_private_candidate(node: Node, st_mode: int) -> bool:
    """Could holding this node mark a process as part of a tree?

    Regular files and device nodes, except the terminals and the few
    character devices every process has open.
    """
    if stat_mod.S_ISREG(st_mode):
        return True
    if stat_mod.S_ISCHR(st_mode) or stat_mod.S_ISBLK(st_mode):
        major, minor = os.major(node.rdev), os.minor(node.rdev)
        if (major, minor) in _COMMON_CHAR_DEVICES or major in _PTS_MAJORS:
            return False
        return major != 4  # /dev/tty*, the virtual consoles
    return False


class Holdings:
    """What a set of processes holds: nodes (files, devices) and socket inodes."""

    __slots__ = ("nodes", "sockets")

    def __init__(self) -> None:
        self.nodes: dict[tuple[int, int], Node] = {}
        self.sockets: set[int] = set()


def holdings(pid: int, *, skip_fds: Iterable[int] = (), with_maps: bool = True) -> Holdings:
    """Nodes the process holds open (descriptors, and device mappings) and its sockets."""
    h = Holdings()
    skip = set(skip_fds)
    try:
        entries = fds(pid)
    except OSError:
        return h
    for fd, path in entries:
        if fd in skip:
            continue
        try:
            target = os.readlink(path)
            if target.startswith("socket:["):
                h.sockets.add(int(target[8:-1]))
                continue
            st = os.stat(path)
        except OSError:
            continue
        node = node_of_stat(st, target)
        if is_private_candidate(node, st.st_mode):
            h.nodes[node.key] = node
    if with_maps:
        for node in mapped_device_nodes(pid):
            h.nodes[node.key] = node
    return h


def mapped_device_nodes(pid: int) -> Iterator[Node]:
    """Device nodes mapped into the process (a descriptor may be closed, the mapping kept).

    Regular-file mappings are left out: they are shared libraries and the
    executable, which every process on the machine shares.
    """
    try:
        data = read_raw(pid, "maps")
    except PermissionError:
        return
    for key, path, st in _dev_mappings(data):
        node = node_of_stat(st, path.decode("utf-8", "replace"))
        if node.key == key and is_private_candidate(node, st.st_mode):
            yield node


def _dev_mappings(maps: bytes) -> Iterator[tuple[tuple[int, int], bytes, os.stat_result]]:
    """Each file under ``/dev/`` that the ``/proc/PID/maps`` text ``maps`` maps, once:
    ((dev, inode) as the mapping names it, its path, the path's stat now); paths
    that no longer stat are left out."""
    if b" /dev/" not in maps:  # most processes map no device node: skip the parse
        return
    seen: set[tuple[int, int]] = set()
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or parts[4] == b"0" or not parts[5].startswith(b"/dev/"):
            continue
        major_s, minor_s = parts[3].split(b":")
        key = (os.makedev(int(major_s, 16), int(minor_s, 16)), int(parts[4]))
        if key in seen:
            continue
        seen.add(key)
        try:
            st = os.stat(parts[5])
        except OSError:
            continue
        yield key, parts[5], st


class NodeMatcher(Generic[T]):
    """Which of some wanted nodes a process holds, by descriptor or memory mapping:
    the one answer to "who holds these nodes" (``hold audit``, the daemon's device
    scan, the survivor check), built once per scan and asked per process.

    Matched by number, never by the text of a path, so a node reached through a
    bind mount, a hard link or a renamed node still matches: a descriptor of a
    character or block device by its device number (``st_rdev``, so another
    node file of the same device matches too), one of a regular file by
    ``(st_dev, st_ino)``; a mapping by the ``dev inode`` of the file mapped,
    or, for a mapped node under ``/dev/``, by the device number it opens.
    ``files``: ``(dev, ino)`` -> what to answer for it (a device node's own
    inode too: how a mapping names it); ``devices``: device number -> the same.
    """

    __slots__ = ("_needles", "devices", "files")

    def __init__(self, files: Mapping[tuple[int, int], T], devices: Mapping[int, T]) -> None:
        self.files = dict(files)
        self.devices = dict(devices)
        # In /proc/PID/maps a mapping names its file by "maj:min inode" of the
        # node file itself: searching the raw text for " maj:min inode " finds
        # it without parsing a line (the kernel's formatting: at least
        # two-digit hex device numbers, decimal inode).
        self._needles = [
            (f" {os.major(dev):02x}:{os.minor(dev):02x} {ino} ".encode(), t)
            for (dev, ino), t in self.files.items()
        ]

    @staticmethod
    def of_nodes(nodes: Iterable[Node]) -> NodeMatcher[Node]:
        """A matcher answering with the :class:`Node` matched."""
        nodes = list(nodes)
        return NodeMatcher({n.key: n for n in nodes}, {n.rdev: n for n in nodes if n.rdev})

    def inspect(self, pid: int) -> tuple[dict[T, str], bool]:
        """(what the process holds -> ``"fd"`` or ``"mmap"``, descriptors first; True if
        we may not read all of its descriptors or mappings).

        "May not" is decided per descriptor and per file, not only by the
        listing of ``fd/``: the listing can be allowed where following the
        links is not (a process in another user namespace, or one more
        privileged than us, such as a sandbox's init), and such a process
        must be counted as not inspected, never passed over as holding
        nothing. A process that is gone holds nothing (False).
        """
        # Listed and stat'ed inline, not through fds(): this is the hot loop
        # of the holder scan (every descriptor of every process, bench.audit),
        # and fds() builds an (int, path) pair per descriptor.
        base = f"/proc/{pid}/fd"
        try:
            names = os.listdir(base)
        except PermissionError:
            return {}, True
        except OSError:
            return {}, False
        found: dict[T, str] = {}
        denied = False
        by_rdev = self.devices.get
        by_file = self.files.get
        for name in names:
            try:
                st = os.stat(f"{base}/{name}")
            except PermissionError:
                denied = True  # the same check guards every descriptor: stop asking
                break
            except OSError:
                continue  # closed meanwhile
            mode = st.st_mode
            if stat_mod.S_ISCHR(mode) or stat_mod.S_ISBLK(mode):
                t = by_rdev(st.st_rdev)
            elif stat_mod.S_ISREG(mode):
                t = by_file((st.st_dev, st.st_ino))
            else:
                continue
            if t is not None:
                found.setdefault(t, "fd")
        try:
            maps = read_raw(pid, "maps")
        except PermissionError:
            return found, True
        for needle, t in self._needles:
            if needle in maps:
                found.setdefault(t, "mmap")
        if self.devices:
            # Another node file of a wanted device (mknod elsewhere): the path
            # only locates it; its device number decides.
            for _, _, st in _dev_mappings(maps):
                if stat_mod.S_ISCHR(st.st_mode) or stat_mod.S_ISBLK(st.st_mode):
                    t = by_rdev(st.st_rdev)
                    if t is not None:
                        found.setdefault(t, "mmap")
        return found, denied


def holders_of(nodes: Iterable[Node], candidates: Iterable[int]) -> dict[int, Node]:
    """Which of ``candidates`` hold (descriptor or mapping) one of ``nodes``, and
    which node (the first found), as :class:`NodeMatcher` matches. A process
    whose descriptors or mappings we may not read is named only for what could
    be read of it: the survivor check reports what it can show."""
    matcher = NodeMatcher.of_nodes(nodes)
    found: dict[int, Node] = {}
    if not matcher.files:
        return found
    for pid in candidates:
        held, _ = matcher.inspect(pid)
        if held:
            found[pid] = next(iter(held))
    return found


class Listener(NamedTuple):
    proto: str  # tcp, tcp6, udp, udp6
    port: int
    inode: int


def listeners() -> dict[int, Listener]:
    """Listening TCP sockets and bound UDP sockets in this network namespace, by inode."""
    out: dict[int, Listener] = {}
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        try:
            with open(f"/proc/net/{proto}", "rb") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            # TCP: state 0A is LISTEN. UDP: 07 is "closed" but bound, which is
            # how an unconnected UDP server looks.
            state = parts[3]
            if (proto.startswith("tcp") and state != b"0A") or (
                proto.startswith("udp") and state != b"07"
            ):
                continue
            port = int(parts[1].rsplit(b":", 1)[1], 16)
            inode = int(parts[9])
            if inode:
                out[inode] = Listener(proto, port, inode)
    return out


def socket_owners(inodes: set[int], candidates: Iterable[int]) -> dict[int, int]:
    """socket inode -> pid, for the ``candidates`` that hold one of ``inodes``."""
    found: dict[int, int] = {}
    if not inodes:
        return found
    for pid in candidates:
        try:
            entries = fds(pid)
        except OSError:
            continue
        for _fd, path in entries:
            try:
                target = os.readlink(path)
            except OSError:
                continue
            if target.startswith("socket:["):
                ino = int(target[8:-1])
                if ino in inodes:
                    found[ino] = pid
    return found


def descendants(roots: Iterable[int], procs: dict[int, Stat]) -> set[int]:
    """All pids in ``procs`` whose parent chain reaches one of ``roots`` (roots excluded)."""
    children: dict[int, list[int]] = {}
    for st in procs.values():
        children.setdefault(st.ppid, []).append(st.pid)
    out: set[int] = set()
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in out:
                out.add(child)
                stack.append(child)
    return out


def ancestors(pid: int, procs: Mapping[int, Stat] | None = None) -> list[Stat]:
    """The chain of parents of ``pid`` (nearest first), ending at pid 1 or a gone parent.

    Read from ``/proc`` now, or, given ``procs`` (a :func:`snapshot`), from that
    snapshot: the chain as it was when the snapshot was taken.
    """
    get = stat_of if procs is None else procs.get
    out: list[Stat] = []
    seen: set[int] = set()
    st = get(pid)
    while st is not None and st.ppid > 0 and st.ppid not in seen:
        seen.add(st.ppid)
        parent = get(st.ppid)
        if parent is None:
            break
        out.append(parent)
        st = parent
    return out


__all__ = [
    "KTHREADD",
    "Holdings",
    "Listener",
    "NoSuchProcess",
    "Node",
    "NodeMatcher",
    "Stats",
    "ancestors",
    "descendants",
    "environ",
    "environ_has",
    "exe",
    "fdinfos",
    "fds",
    "flock_holders",
    "flocked_files",
    "holders_of",
    "holdings",
    "kernel_threads",
    "kthreadd_children",
    "listed",
    "listeners",
    "pid_cursor",
    "pids",
    "read_raw",
    "snapshot",
    "socket_owners",
    "stat_of",
    "status_line",
    "thread_count",
    "uid_of",
]
