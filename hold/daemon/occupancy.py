"""Is a device empty? The kernel's count of its open files, and the holder scan where
the count cannot answer.

Nobody is handed a device that is not empty. A scan of every process's
descriptors and mappings (:mod:`hold.devices.holders`) answers that, but its cost
grows with the machine; so the daemon asks the kernel instead
(:mod:`hold.daemon.nodewatch`: ``inotify`` counts the open files of each device
node). A device is **known empty** when a scan, started after its watch was
in place and with no open or close of the node while it ran, found no
holder; it stays known empty until the next open of its node, and until
then a grant needs no scan. A count back at zero after opens proves
nothing: inotify merges identical unread events, and two opens on two CPUs
can be counted as one (see :meth:`Occupancy._empty`); so the first grant
after the device was used scans (or the end of the lease that used it did),
and that scan starts the count again. How far a count is believed beyond
that depends on what the scan could see:

* ``exact``: the scan could read every process (root, in the machine's own
  pid namespace) and found none. A count above zero says the device is held
  (an event may be merged away, never made up): the usage figures need no
  scan for it.
* ``opens``: the scan could not read every process (a per-user daemon, a
  container), or found only the class's allowed holders: a close may belong
  to a file the scan never saw, so the count says nothing but "no open yet".
* neither (no baseline yet, the queue overflowed, the node replaced or not
  watchable): the next grant scans, and that scan is the new baseline.

The count of one inode proves nothing of a node of the same device with
another inode (a container's own ``/dev``): so every such node the system
daemon can find, in every mount namespace, is counted with it
(:mod:`hold.daemon.mountns`); where the namespaces cannot be listed the
count does not stand alone (:meth:`Occupancy.witness`).

A scan also runs where someone is known to hold the device (to name them),
for ``hold audit``, and at a lease's end when the count is not back at zero
(whoever took the device during the lease is stopped before anyone else gets
it, see :func:`stop_leftovers`).

This is the one place where holding something makes a process a target.
``hold_supervisor.proc.stop`` never signals a non-member for holding a tree's regular
file or port (anyone may open a file the moment a tree has it open); a
*device node* of a lease is different, because using it without the lease
breaks "one holder at a time".

Scans run in the daemon's worker threads: a scan of a large machine takes a
good fraction of a second and must not stall the event loop.
"""

from __future__ import annotations

import os
import pwd
import stat
import threading
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from hold.daemon.mountns import MountNamespaces
from hold.daemon.nodewatch import Counted, NodeWatch, WatchUnavailable
from hold.devices.classes import DeviceClass, node_key
from hold.devices.holders import Holder, details, device_memory, scan, targets
from hold.devices.scancache import ScanCache
from hold_supervisor.proc import scan as procscan
from hold_supervisor.proc.identity import ProcessId, user_name
from hold_supervisor.proc.origin import origin
from hold_supervisor.proc.stop import StopReport, stop_tree
from hold_supervisor.proc.tree import Tree

if TYPE_CHECKING:
    from hold.daemon.records import Log

Trust = Literal["exact", "opens"]
Holders = dict[int, list[dict[str, Any]]]  # device index -> who holds one of its nodes


def _device_number(path: str) -> tuple[str | None, int]:
    """``("c"|"b", rdev)`` of a device node (its other nodes share it); (None, 0) else."""
    try:
        st = os.stat(path)
    except OSError:
        return None, 0
    if stat.S_ISCHR(st.st_mode):
        return "c", st.st_rdev
    if stat.S_ISBLK(st.st_mode):
        return "b", st.st_rdev
    return None, 0


def has_nodes(cls: DeviceClass) -> bool:
    """False for a class with only its logical device (nothing to scan)."""
    return bool(cls.device_nodes())


class Occupancy:
    """The kernel's count of each device's open files, and how far it is believed.

    Keyed by device key (:func:`hold.devices.classes.node_key`): one device named by
    two classes is one count. Shared by the event loop and the workers.
    """

    def __init__(self) -> None:
        try:
            self.watch: NodeWatch | None = NodeWatch()
            self.unavailable: str | None = None
        except WatchUnavailable as e:
            self.watch = None
            self.unavailable = str(e)
        self._lock = threading.Lock()
        self.counts: dict[str, Counted] = {}  # device key -> its node's count
        self.trust: dict[str, Trust] = {}  # device key -> how far its count is believed
        self.not_watched: dict[str, str] = {}  # device key -> why it has no count
        # The device's other nodes (other inodes, other mount namespaces: see
        # hold.daemon.mountns), each counted like its own node, and how many
        # times a node was added to or lost from that list (a scan that saw
        # the list change while it ran is no baseline).
        self.others: dict[str, list[Counted]] = {}
        self.epochs: dict[str, int] = {}
        self.namespaces: MountNamespaces | None = None
        self._devices: dict[tuple[str, int], str] = {}  # ("c"|"b", rdev) -> device key
        self._patterns: list[str] = []
        self._relook = False  # a node of another inode was lost: look everywhere again
        self.unwatched: dict[str, str] = {}  # device key -> its node no watch could be put on
        if self.watch is not None and os.geteuid() == 0:
            self.namespaces = MountNamespaces(self.watch)
        self.log: Log | None = None  # the daemon's, where there is one

    def witness(self) -> str | None:
        """Why the count of the nodes found cannot stand alone here (None where it can).

        Root: a holder may come through a node of another inode in another
        mount namespace; the count stands only while every namespace is
        walked (:mod:`hold.daemon.mountns`). A daemon of one user (not root)
        cannot walk them, and needs no walk for what its user can do: no
        unprivileged process can make a device node, and a namespace of its
        own reaches a device only through a bind mount of a node counted
        here. What root made for the user (a rootful container run as that
        user) is its blind spot, named in ``hold status``.
        """
        if os.geteuid() != 0 or self.namespaces is None:
            return None
        return self.namespaces.unavailable

    def fileno(self) -> int | None:
        return self.watch.fd if self.watch is not None else None

    def track(self, classes: dict[str, DeviceClass], keys: dict[str, list[str]]) -> None:
        """Watch every device node of ``classes`` (again: each count starts over)."""
        with self._lock:
            if self.watch is not None:
                for counted in self.counts.values():
                    self.watch.forget(counted)
                for others in self.others.values():
                    for o in others:
                        self.watch.forget(o)
            self.counts.clear()
            self.trust.clear()
            self.not_watched.clear()
            self.others.clear()
            self._devices.clear()
            self._patterns = [p for cls in classes.values() for p in cls.nodes]
            for name, cls in classes.items():
                for path in cls.device_nodes():
                    # Each path's own key, not zipped with ``keys``: a node gone
                    # between the two listings would shift every key after it.
                    key = node_key(path)
                    if key is None or key not in keys[name]:
                        continue
                    if key in self.counts or key in self.not_watched:
                        continue
                    if self.watch is None:
                        self.not_watched[key] = f"no inotify: {self.unavailable}"
                        continue
                    try:
                        self.counts[key] = self.watch.watch(path)
                    except WatchUnavailable as e:
                        self.not_watched[key] = str(e)
                        continue
                    kind, rdev = _device_number(path)
                    if kind is not None:
                        self._devices[(kind, rdev)] = key
        if self.namespaces is not None:
            self.namespaces.forget()
        try:
            self.refresh()
        except OSError:
            pass  # out of descriptors now: the first grant looks again

    def refresh(self) -> None:
        """Watch the nodes of the tracked devices in mount namespaces that are new or
        changed since the last call (:mod:`hold.daemon.mountns`). A node watched
        late may have been opened before: its device's count starts over."""
        if self.namespaces is None or not self._devices:
            return
        if self._relook:
            self._relook = False
            self.namespaces.forget()
        found = self.namespaces.refresh(self._devices, self._patterns)
        with self._lock:
            # A node found and not watched: its device's count proves nothing
            # until a look watches it (each refresh looks again).
            self.unwatched = found.unwatched
            for key in found.unwatched:
                self.trust.pop(key, None)
            added = []
            for key, counted in found.nodes:
                others = self.others.setdefault(key, [])
                if any(o is counted for o in others):
                    continue  # counted already (found again: another namespace, a second look)
                others.append(counted)
                added.append((key, counted))
                self.epochs[key] = self.epochs.get(key, 0) + 1
                self.trust.pop(key, None)
        if self.log is not None:
            for key, counted in added:
                self.log.info("node_watched", device=key, node=counted.path)
            for error in found.errors:
                self.log.warning("mount_namespace_unread", error=error)

    def drain(self) -> set[str]:
        """Read the kernel's events; the device keys whose count moved."""
        if self.watch is None:
            return set()
        moved = self.watch.drain()
        with self._lock:
            out = {k for k, c in self.counts.items() if c.wd in moved}
            for key, others in self.others.items():
                if any(o.wd in moved for o in others):
                    out.add(key)
                lost = [o for o in others if o.lost]
                if lost:
                    # Its file system went (a container ended), the node was
                    # removed, or the queue overflowed: the inode may still be
                    # open elsewhere, and a node still there must be watched
                    # again (every namespace is looked into at the next refresh).
                    self._relook = True
                    others[:] = [o for o in others if not o.lost]
                    for o in lost:
                        self.watch.forget(o)
                    self.epochs[key] = self.epochs.get(key, 0) + 1
                    self.trust.pop(key, None)
            return out

    def _read_now(self) -> str | None:
        """Bring the counts up to now -- every node of a tracked device in a new
        mount namespace watched, the kernel's queue read -- and say why the
        count cannot stand alone here (:meth:`witness`), or None."""
        witness = self.witness()
        if witness is None:
            # The queue first: an entry made in a watched directory (a mknod
            # in a container's /dev) must be known before the look, or its
            # node is watched only after the grant it should have stopped.
            self.drain()
            try:
                self.refresh()
            except OSError as e:  # this time only (out of descriptors): no proof now
                witness = f"the mount namespaces could not be listed now: {e.strerror}"
        self.drain()
        return witness

    def known_empty(self, keys: list[str]) -> bool:
        """Does the kernel's count prove every device of ``keys`` empty now?"""
        if self._read_now() is not None:
            return False
        with self._lock:
            return all(self._empty(k) for k in keys)

    def _empty(self, key: str) -> bool:
        c, trust = self.counts.get(key), self.trust.get(key)
        if c is None or trust is None or c.lost is not None:
            return False
        assert self.watch is not None
        if not self.watch.current(c):
            c.lost = f"{c.path} names another inode now"
            return False
        # Whatever the trust: empty only while no open has come since the scan
        # that started the count. A count back at zero after opens is no proof:
        # inotify merges an event into the last unread one when both are the
        # same, and two opens of the node's path on two CPUs can queue
        # directory, directory, node, node (their events interleave) -- one
        # open counted, so the first close brings the count to zero while the
        # other file is open, with no sign of it. Two processes opening a node
        # 2,000 times each, unread: 3,722 of 4,000 counted (Linux 6.18), and a
        # soak granted a device that a stray held for a second. Merging only
        # ever loses an event beside another, so "no open at all" is proof.
        if key in self.unwatched:
            return False
        return not c.opened and not any(o.opened for o in self.others.get(key, ()))

    def held(self, keys: list[str]) -> bool | None:
        """Does anyone hold one of ``keys`` now: the count's answer where it can give
        one, else None. Held where an exact count is above zero (events can be
        merged away, never made up); not held where no open came since the
        count's scan (see :meth:`_empty`); else unknown."""
        if self._read_now() is not None:
            return None
        with self._lock:
            out = False
            for k in keys:
                c = self.counts.get(k)
                if c is None or k not in self.trust or c.lost:
                    return None
                if self.trust[k] == "exact" and c.open_files > 0 and not c.unpaired:
                    out = True
                elif c.opened or any(o.opened for o in self.others.get(k, ())):
                    return None
            return out

    def states(self, keys: list[str]) -> dict[str, tuple[str, str]]:
        """What is known of each device of ``keys`` that no lease holds, without a
        scan (for ``hold status``): the counts brought up to now once, then
        :meth:`_state` of each."""
        witness = self._read_now()
        return {k: self._state(k, witness) for k in keys}

    def _state(self, key: str, witness: str | None) -> tuple[str, str]:
        """A word -- ``free``, ``in use`` (the count says a node of it is open;
        nobody named yet), ``unknown`` -- and how that is known, or why no more
        is; ``witness``: :meth:`witness`'s answer just now."""
        with self._lock:
            c = self.counts.get(key)
            if c is None:
                return "unknown", self.not_watched.get(key, "its node is not watched")
            opened = [o for o in (c, *self.others.get(key, ())) if o.open_files > 0]
            if opened:
                n = sum(o.open_files for o in opened)
                paths = ", ".join(o.path for o in opened)
                return "in use", (
                    f"the kernel's count: {n} open file(s) of {paths}; holder not named yet "
                    "(the next grant or hold audit names it)"
                )
            if c.lost:
                return "unknown", f"{c.lost}; the next grant scans"
            if key in self.unwatched:
                return "unknown", f"a node of it cannot be watched: {self.unwatched[key]}"
            if key not in self.trust:
                return "unknown", "no scan since its watch started; the next grant scans"
            if not self._empty(key):
                return "unknown", "opened and closed since the last scan; the next grant scans"
            if witness is not None:
                return "free", f"the last scan (its other nodes cannot be watched: {witness})"
            if self.namespaces is None or self.namespaces.unavailable is not None:
                why = "this daemon cannot list mount namespaces (not root)"
                return "free", f"count (of the nodes this daemon can reach; {why})"
            return "free", f"count (its nodes in {len(self.namespaces)} mount namespaces)"

    def why_not(self, key: str) -> str:
        """Why ``key``'s count does not prove it empty (for the log and the benchmark)."""
        witness = self.witness()
        if witness is not None:
            return f"its other nodes cannot be watched: {witness}"
        with self._lock:
            c = self.counts.get(key)
            if c is None:
                return self.not_watched.get(key, "not watched")
            if c.lost:
                return c.lost
            if key not in self.trust:
                return "no scan since the watch started"
            if key in self.unwatched:
                return f"a node of it cannot be watched: {self.unwatched[key]}"
            for o in self.others.get(key, ()):
                if o.opened:
                    return f"opened through another node of it: {o.path} (another inode)"
            if c.unpaired:
                return "opened through another path"
            if c.unmatched:
                return "a close the count could not match"
            return f"{c.open_files} open file(s)" if c.open_files else "opened since the last scan"

    def mark(self, keys: list[str]) -> dict[str, int]:
        """Before a scan: each device's events so far (after reading the kernel's queue,
        with every node of it that exists now watched)."""
        self._read_now()
        with self._lock:
            return {k: self._events(k) for k in keys if k in self.counts}

    def _events(self, key: str) -> int:
        """Every open and close of ``key``'s nodes, and every node added or lost."""
        others = self.others.get(key, ())
        return self.counts[key].events + sum(o.events for o in others) + self.epochs.get(key, 0)

    def settle(self, marked: dict[str, int], trust: dict[str, Trust | None]) -> set[str]:
        """After a scan begun at ``marked``: a device the scan found empty, whose node
        saw no open or close while it ran, is known empty from now (``trust``:
        what the scan could see, see the module docstring); one it found held
        is not. Returns the devices whose node was opened or closed while the
        scan ran (its word on them may be stale: each process is read at its
        own moment, and one read before it opened the node was seen empty).
        A node of it found only now, in a mount namespace that appeared while
        the scan ran, counts as a move too: its opens before now were counted
        by nobody."""
        self._read_now()
        moved: set[str] = set()
        with self._lock:
            for key, events in marked.items():
                c = self.counts.get(key)
                if c is None:
                    continue  # a reload started the counts over meanwhile
                how = trust.get(key)
                if self._events(key) != events:
                    moved.add(key)
                if how is None:
                    self.trust.pop(key, None)
                    continue
                if key in moved or c.lost or (self.watch and not self.watch.current(c)):
                    continue  # no baseline from this scan
                assert self.watch is not None
                self.watch.reset(c)
                for o in self.others.get(key, ()):
                    self.watch.reset(o)
                self.trust[key] = how
        return moved


class Look(NamedTuple):
    """One scan of some devices of a class."""

    found: Holders  # holders outside the class's allowed ones
    allowed: frozenset[int]  # devices held (only) by allowed holders
    complete: bool  # every process that may hold a device could be read (see look)
    # Devices nobody was found holding, but which processes this daemon may not
    # read might hold (and no other witness cleared): not proven empty.
    unproven: frozenset[int] = frozenset()
    unseen: int = 0  # processes the scan may not read

    def trust(self, index: int) -> Trust | None:
        """How far this scan lets the count of device ``index`` be believed."""
        if index in self.found or index in self.unproven:
            return None
        return "exact" if self.complete and index not in self.allowed else "opens"

    def why_unproven(self, cls: str) -> str:
        """For a refused client: which devices, why, and what to do."""
        names = ", ".join(f"{cls}:{i}" for i in sorted(self.unproven))
        return f"{names} cannot be proven free: {unreadable_why(self.unseen)}"


def unreadable_why(unseen: int | None = None) -> str:
    """Why a daemon that is not root cannot prove a device free, and what to do
    (``unseen``: how many processes its last scan could not read, where known)."""
    me = pwd.getpwuid(os.geteuid()).pw_name
    count = "" if unseen is None else f"{unseen} "
    return (
        f"this ticket daemon runs as {me} and may not read {count}process(es) of other "
        "users, any of which may hold it. Use the system daemon, which reads every "
        "process (an administrator: sudo hold daemon --install), or accept the risk "
        "with 'unreadable_processes: ignore' in the configuration"
    )


def look(
    cls: DeviceClass,
    devices: list[int],
    cache: ScanCache | None = None,
    *,
    unreadable: str = "ignore",
) -> Look:
    """Scan ``devices`` of ``cls``: who holds them, and what the scan could see.

    ``cache``: processes read a moment ago holding nothing are not read again
    (:mod:`hold.devices.scancache`); a scan meant to start a count must not use it.

    ``unreadable``: "refuse" -- a daemon not running as root, whose scan could
    not read some processes (other users'), proves a device empty only where
    another witness does: for an NVIDIA GPU, NVML's list of the processes with a
    context on it, whoever runs them (a process it lists is a holder, named by
    pid, even one the scan could not read). Other devices are ``unproven``.
    (Root's blind spots -- a process more privileged than root here -- stay
    the scan's, counted only: see ``complete`` below.) "ignore": the scan's
    word, what it could read.
    """
    tgts = {
        k: t
        for k, t in targets({cls.name: cls}, cls.name).items()
        if t.unit is not None and t.unit in devices
    }
    if not tgts:
        return Look({}, frozenset(), False)
    result = scan(tgts, cache=cache)
    found = [h for h in result.holders if not cls.allows(h.pid, h.uid)]
    allowed = frozenset(h.unit for h in result.holders if h.unit is not None) - {
        h.unit for h in found
    }
    memory = device_memory(found)
    out: Holders = {}
    for h in found:
        assert h.unit is not None
        out.setdefault(h.unit, []).append(_describe(h, memory))
    # Complete: root in the machine's own pid namespace. A per-user daemon
    # cannot read other users' processes, which often hold devices; what even
    # root cannot read (a process with capabilities root here lacks, as a
    # VM's init may have) is a blind spot of the scan itself, counted in
    # ``not_inspected`` and left out of this rule: it would make every count
    # on such a machine a count of opens only.
    complete = os.geteuid() == 0 and not _nested_pid_namespace()
    unproven: set[int] = set()
    if unreadable == "refuse" and os.geteuid() != 0 and result.not_inspected:
        unproven = {i for i in devices if i not in out}
        for i, holders in _nvml_witness(cls, sorted(unproven)).items():
            unproven.discard(i)
            if holders:
                out[i] = holders
    return Look(out, allowed, complete, frozenset(unproven), result.not_inspected)


def _nvml_witness(cls: DeviceClass, devices: list[int]) -> Holders:
    """For the NVIDIA GPUs among ``devices``: who NVML says has a context on each
    ([] for none: NVML's word that it is free); a device it cannot answer for is
    missing."""
    # lazy: NVIDIA's only for a class with NVIDIA GPUs; off an idle daemon's memory
    from hold.devices.gpuids import nvidia_minor

    nodes = cls.device_nodes()
    minors = {i: nvidia_minor(nodes[i]) for i in devices if i < len(nodes)}
    minors = {i: m for i, m in minors.items() if m is not None}
    if not minors:
        return {}
    # lazy: NVML (ctypes) only where there are NVIDIA GPUs
    from hold.devices import nvml

    listed = nvml.pids_by_minor()
    if listed is None:
        return {}
    out: Holders = {}
    for i, minor in minors.items():
        if minor not in listed:
            continue
        out[i] = []
        for pid in sorted(listed[minor]):
            st = procscan.stat_of(pid)
            uid = procscan.uid_of(pid)
            out[i].append(
                {
                    "pid": pid,
                    "starttime": st.starttime if st is not None else 0,
                    "uid": uid,
                    "user": user_name(uid) if uid is not None else "?",
                    "command": details(pid).command[:200],
                    "node": nodes[i],
                    "memory_bytes": None,
                    "origin": origin(pid).doc(),
                }
            )
    return out


def holders_of(cls: DeviceClass, devices: list[int], cache: ScanCache | None = None) -> Holders:
    """device index -> who holds one of its nodes now (pid, user, command, memory)."""
    return look(cls, devices, cache).found


def checked_look(
    occ: Occupancy,
    cls: DeviceClass,
    devices: list[int],
    keys: list[str],
    unreadable: str = "ignore",
) -> Look:
    """:func:`look`, and what it proves given to the count: the baseline of each device.

    A scan that found a device empty while its node was opened or closed
    may have read the opener before it opened: it is taken again (up to
    :data:`LOOKS` in all; then its word stands, as a plain scan's would).
    """
    for _ in range(LOOKS):
        marked = occ.mark(keys)
        seen = look(cls, devices, unreadable=unreadable)
        moved = occ.settle(marked, {k: seen.trust(i) for k, i in zip(keys, devices, strict=True)})
        if not any(k in moved for k, i in zip(keys, devices, strict=True) if i not in seen.found):
            break
    return seen


LOOKS = 3  # scans of one check while the node moves under them


def _nested_pid_namespace() -> bool:
    """Are there processes this one cannot list (its pid namespace has a parent)?"""
    try:
        line = procscan.status_line("self", b"NSpid:")
    except OSError:
        return True
    return True if line is None else len(line.split()) > 2


def _describe(h: Holder, memory: dict[tuple[int, str, int | None], int]) -> dict[str, Any]:
    return {
        "pid": h.pid,
        "starttime": h.starttime,
        "uid": h.uid,
        "user": user_name(h.uid),
        "command": details(h.pid).command[:200],
        "node": h.node,
        "memory_bytes": memory.get((h.pid, h.cls, h.unit)),
        "origin": origin(h.pid).doc(),
    }


class LeftoverStop(StopReport):
    """The stop of one device holder at a lease's end, and who that holder was.

    A :class:`StopReport` (so it logs and counts like any other) with
    ``holder``: the scan's description of the process it was started for --
    ``pid``, ``starttime``, ``uid``, ``user``, ``command``, ``node``,
    ``memory_bytes`` -- plus ``device`` (the index in its class) and
    ``class``. The daemon logs it: a process that used a leased device
    without the ticket was stopped, and this says whose it was.
    """

    __slots__ = ("holder",)

    def __init__(self, report: StopReport, holder: dict[str, Any]) -> None:
        super().__init__(report.tree_id, report.signal, report.method)
        for name in StopReport.__slots__:
            setattr(self, name, getattr(report, name))
        self.holder = holder


def stop_leftovers(
    cls: DeviceClass,
    devices: list[int],
    *,
    uid: int | None,
    grace: float,
    granted: float,
    occ: Occupancy | None = None,
    keys: list[str] | None = None,
    unreadable: str = "ignore",
) -> tuple[list[StopReport], Holders]:
    """Stop the trees of whoever still holds ``devices``; (reports, who still holds them).

    Only processes started after the lease was ``granted`` (wall clock) are
    its leftovers: an older one (granted past with ``busy_devices: warn``) was
    never the lease's to stop. ``uid``: stop only what that user could have
    stopped (a daemon running as root ending another user's lease).
    ``occ`` and ``keys`` (the devices' keys): the scan that finds the device
    empty starts its count (:func:`checked_look`).

    Each report is a :class:`LeftoverStop`, naming the holder (pid, user,
    command, node, device) it was made for.
    """

    def scan_now() -> Holders:
        if occ is None or keys is None:
            return holders_of(cls, devices)
        return checked_look(occ, cls, devices, keys, unreadable).found

    since = procscan.ticks_at(granted) - 2  # ticks of slack for rounding
    reports: list[StopReport] = []
    found = scan_now()
    for index, holders in found.items():
        for h in holders:
            st = procscan.stat_of(h["pid"])
            if st is None or st.starttime != h["starttime"] or st.is_dead or h["pid"] == 1:
                continue
            if st.starttime < since:
                continue
            if h["pid"] == os.getpid():
                continue
            tree = Tree(
                f"left{h['pid']}",
                ProcessId(h["pid"], st.starttime),
                st.pgrp if st.pgrp == h["pid"] else None,
                st.session if st.session == h["pid"] else None,
                uid=uid,
            )
            report = stop_tree(tree, grace=grace)
            reports.append(LeftoverStop(report, {**h, "class": cls.name, "device": index}))
    # Scanned again only if something was stopped: otherwise the first scan,
    # taken after the lease's trees were stopped, is the answer (and it
    # serves the next grant too: see the module docstring).
    return reports, scan_now() if reports else found
