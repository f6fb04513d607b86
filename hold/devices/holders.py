"""Who holds a device node now: the scan that ``hold audit`` and the daemon share.

Finding holders: every process's descriptors and memory mappings, matched by
device number -- a descriptor's ``st_rdev`` (or, for the regular files that
stand in for devices in tests, ``(st_dev, st_ino)``), a mapping's
``dev inode`` fields -- never by the text of a path, so a node reached
through a bind mount, a hard link or a renamed node still matches. The
matching of one process is :class:`hold_supervisor.proc.scan.NodeMatcher`'s,
the survivor check's too; here are the scan of every process around it (its
cache, its forked workers, kernel threads) and the rows it gives.

This reads ``/proc`` directly rather than through psutil: the scan visits
every descriptor of every process on the machine, and psutil's per-process
objects would cost several times the system calls that matter.

Also here: what a person needs to see of the few holders found (:func:`details`,
:func:`device_memory`). Whether a ticket covers a holder is the audit's
question (:mod:`hold.views.audit`); whether a device is empty, the daemon's
(:mod:`hold.daemon.occupancy`).
"""

from __future__ import annotations

import gc
import glob
import marshal
import os
import signal
import stat
import threading
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any, NamedTuple, NoReturn

from hold.devices.classes import DeviceClass
from hold.devices.scancache import ScanCache
from hold_supervisor.proc import scan as procscan
from hold_supervisor.proc.identity import AccessDenied, NoSuchProcess, read_cmdline, read_stat
from hold_supervisor.proc.scan import KTHREADD, NodeMatcher, kernel_threads, kthreadd_children

# A key for "this node": ("rdev", st_rdev) for device nodes, ("file", dev, ino)
# for the node's own inode (how a mapping names it, and how a regular file
# standing in for a device is known).
Key = tuple[Any, ...]


class Target(NamedTuple):
    cls: str
    unit: int | None  # device index; None: a shared node of the class (/dev/nvidiactl)
    path: str


class Holder(NamedTuple):
    pid: int
    starttime: int
    uid: int
    cls: str
    unit: int | None
    how: str  # "fd" or "mmap"
    node: str


def targets(
    classes: dict[str, DeviceClass],
    only: str | None = None,
    units: Collection[int] | None = None,
) -> dict[Key, Target]:
    """Every node of the classes, by the keys a holder's descriptor or mapping can show.

    ``only``: one class; ``units``: only these devices of it, and none of its
    shared nodes (a process that holds only ``/dev/nvidiactl`` uses no device
    in particular).
    """
    out: dict[Key, Target] = {}
    for cls in classes.values():
        if only is not None and cls.name != only:
            continue
        for index, path in enumerate(cls.device_nodes()):
            if units is None or index in units:
                _add(out, path, Target(cls.name, index, path))
        if units is not None:
            continue
        for pattern in cls.shared_nodes:
            for path in sorted(glob.glob(pattern)):
                _add(out, path, Target(cls.name, None, path))
    return out


def _add(out: dict[Key, Target], path: str, target: Target) -> None:
    try:
        st = os.stat(path)
    except OSError:
        return
    out[("file", st.st_dev, st.st_ino)] = target
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        out[("rdev", st.st_rdev)] = target


class Scan(NamedTuple):
    holders: list[Holder]
    not_inspected: int  # processes whose descriptors we may not read
    processes: int
    seconds: float
    unread: tuple[int, ...] = ()  # their pids


class _Matcher:
    """The per-process work of a scan: :class:`~hold_supervisor.proc.scan.NodeMatcher`'s
    matches as :class:`Holder` rows, one per process and (class, device)."""

    def __init__(self, tgts: dict[Key, Target]) -> None:
        self.nodes = NodeMatcher(
            {(k[1], k[2]): t for k, t in tgts.items() if k[0] == "file"},
            {k[1]: t for k, t in tgts.items() if k[0] == "rdev"},
        )

    def inspect(self, pid: int) -> tuple[list[Holder], bool]:
        """(holders in this process, True if we may not read its descriptors or
        mappings: see :meth:`NodeMatcher.inspect`, never "holds nothing")."""
        held, denied = self.nodes.inspect(pid)
        if not held:
            return [], denied
        st0 = procscan.stat_of(pid)
        if st0 is None or st0.is_dead:
            return [], False
        found: dict[tuple[str, int | None], tuple[Target, str]] = {}
        for t, how in held.items():  # descriptors first: a device held both ways is "fd"
            found.setdefault((t.cls, t.unit), (t, how))
        uid = _uid(pid)
        return [
            Holder(pid, st0.starttime, uid, t.cls, t.unit, how, t.path) for t, how in found.values()
        ], denied


def scan(
    tgts: dict[Key, Target],
    pids: Iterable[int] | None = None,
    cache: ScanCache | None = None,
    *,
    forks: bool = False,
) -> Scan:
    """Who holds any of ``tgts`` now (one entry per process and node).

    Kernel threads are not read, nor (with a ``cache``) processes read holding
    nothing of ``tgts`` a moment ago: :mod:`hold.devices.scancache` says which and why.
    The work runs in the calling thread: between its system calls the
    per-process work is Python holding the GIL, so threads do not scale with
    cores (``bench.audit``: on 16 cores, 10,000 processes, four threads took
    847 ms and one 408).

    ``forks``: spread it over forked worker processes instead, one per usable
    core where there are enough processes to read (:func:`fork_count`); what
    ``hold audit`` runs (50 ms in the same run). Not for the daemon: forking a
    process whose other threads may hold a lock is not safe. Batches that a
    worker could not read (not started, or died) are read by this process:
    the result is the same either way.
    """
    t0 = time.monotonic()
    me = os.getpid()
    kernel = kernel_threads() if pids is None else frozenset()
    todo = [p for p in (procscan.pids() if pids is None else pids) if p != me and p not in kernel]
    listed = len(todo) + len(kernel)
    key = frozenset(tgts)
    cursor = 0
    if cache is not None:
        todo, cursor = cache.start(key, todo)
    matcher = _Matcher(tgts)
    results: list[_Part] = []
    if forks:
        results += _forked(matcher, todo)
    else:
        results.append(_work(matcher, todo))
    if kernel:
        # A kernel thread that ended during the scan may have left its pid to
        # a user process since: whoever has such a pid now is read too.
        gone = sorted(kernel - kthreadd_children() - {KTHREADD})
        results.append(_work(matcher, [p for p in gone if procscan.listed(p)]))
    if cache is not None:
        cache.note(key, [p for _, _, e in results for p in e], cursor, t0)
    holders = [h for part, _, _ in results for h in part]
    unread = tuple(p for _, d, _ in results for p in d)
    return Scan(holders, len(unread), listed, time.monotonic() - t0, unread)


PER_FORK = 300  # processes per forked worker (below that, its start costs more than it saves)
MAX_FORKS = 16
# One fork at a time in this process. Scans forked from several threads
# (``hold web``) would otherwise fork while another thread is inside its fork:
# filelock (4.3) refuses that with a RuntimeError from an audit hook (on the
# 16-core host, Python 3.12: 15 of 16 runs lost scans that way). Only the fork
# is held, not the scan: the workers still run side by side.
_FORKING = threading.Lock()

# One share of a scan: (holders found, pids not inspected, pids read holding nothing).
_Part = tuple[list[Holder], list[int], list[int]]


def _work(matcher: _Matcher, chunk: list[int]) -> _Part:
    holders: list[Holder] = []
    empty: list[int] = []
    denied: list[int] = []
    for pid in chunk:
        found, no = matcher.inspect(pid)
        holders += found
        if no:
            denied.append(pid)
        if not found and not no:
            empty.append(pid)
    return holders, denied, empty


def fork_count(n: int) -> int:
    """How many processes (this one included) a forked scan of ``n`` pids runs in."""
    try:
        cores = len(os.sched_getaffinity(0))
    except OSError:
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_FORKS, n // PER_FORK))


def _forked(matcher: _Matcher, todo: list[int]) -> list[_Part]:
    """``todo`` read in :func:`fork_count` processes; what each found.

    The pids go out in batches from a queue that every process (this one
    too) takes from as it goes, so that a worker the scheduler holds back
    (a busy machine) leaves more to the others instead of keeping everyone
    waiting. The queue is a pipe filled before the first fork: a read of
    one 4-byte batch number is atomic between readers, and its end (no
    writer left) tells each reader it is done. Every process answers with
    the batches it finished; a batch nobody answered for (its worker could
    not start, or died) is read here afterwards.

    The workers are forked, not spawned: they start in well under a
    millisecond with the matcher already built, and run nothing but system
    calls on /proc and :mod:`marshal` (no import, no lock another thread of
    this process could hold), then ``_exit`` (no atexit, no stdio flush).
    """
    n = fork_count(len(todo))
    if n == 1:
        return [_work(matcher, todo)]
    size = -(-len(todo) // (n * BATCHES_PER_FORK))
    batches = [todo[i : i + size] for i in range(0, len(todo), size)]
    queue, fill = os.pipe()
    try:  # at most MAX_FORKS * BATCHES_PER_FORK * 4 bytes: never more than the pipe holds
        os.write(fill, b"".join(i.to_bytes(4, "little") for i in range(len(batches))))
    finally:
        os.close(fill)
    kids: dict[int, int] = {}  # worker pid -> the pipe of its answer
    parts: list[_Part] = []
    done: set[int] = set()
    try:
        for _ in range(n - 1):
            # Blocking nothing first runs a Python handler already due (a ^C)
            # here, before anything is made (pthread_sigmask checks for them
            # after its call: blocking all at once would raise with all still
            # blocked). Then every signal waits until the worker is inside its
            # own try (a ^C in between would unwind it through this function,
            # as if it were this process; CPython's fork clears what was
            # pending already), and until this process has written it down.
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
            try:
                signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
                if not _fork_worker(matcher, batches, queue, kids, mask):
                    break
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # here a ^C may land
        part, mine = _drain(matcher, batches, queue)
        parts.append(part)
        done.update(mine)
        for pid in list(kids):
            data = _read_all(kids[pid])
            os.close(kids.pop(pid))
            _, status = os.waitpid(pid, 0)
            answer = _decode(data) if status == 0 else None
            if answer is not None:
                parts.append(answer[0])
                done.update(answer[1])
        left = [p for i, batch in enumerate(batches) if i not in done for p in batch]
        if left:
            parts.append(_work(matcher, left))
    finally:
        os.close(queue)
        for pid, r in kids.items():  # only on an exception here (^C)
            os.close(r)
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except OSError:
                pass
    return parts


BATCHES_PER_FORK = 8  # batches in the queue per process: small enough to even out, few reads


def _fork_worker(
    matcher: _Matcher,
    batches: list[list[int]],
    queue: int,
    kids: dict[int, int],
    mask: Iterable[int],
) -> bool:
    """One worker forked and written down in ``kids`` (its pid -> the pipe of its
    answer); False if none could be (the process limit, out of memory or of
    descriptors). Called with every signal blocked."""
    try:
        r, w = os.pipe()
    except OSError:
        return False
    try:
        with _FORKING:
            pid = os.fork()
    except (OSError, RuntimeError):
        # At the process limit (EAGAIN), out of memory, or refused by a
        # library's audit hook (RuntimeError): this process reads the batches.
        os.close(r)
        os.close(w)
        return False
    if pid == 0:
        _worker(matcher, batches, queue, (r, w), mask)
    os.close(w)
    kids[pid] = r
    return True


def _drain(matcher: _Matcher, batches: list[list[int]], queue: int) -> tuple[_Part, list[int]]:
    """Batches taken from ``queue`` until it is empty: what they held, and which they were."""
    holders: list[Holder] = []
    denied: list[int] = []
    empty: list[int] = []
    done: list[int] = []
    while len(b := os.read(queue, 4)) == 4:
        i = int.from_bytes(b, "little")
        found, no, none = _work(matcher, batches[i])
        holders += found
        denied += no
        empty += none
        done.append(i)
    return (holders, denied, empty), done


def _worker(
    matcher: _Matcher,
    batches: list[list[int]],
    queue: int,
    answer_pipe: tuple[int, int],
    mask: Iterable[int],
) -> NoReturn:
    """A forked worker: batches from ``queue`` until it is empty, the answer into
    the pipe, exit; whatever happens (^C included), it never returns."""
    code = 1
    try:
        # Its scan makes no cycles, yet the allocations would start the
        # collector's passes over every object inherited (a few percent).
        # Not in the caller: another of its threads may be toggling it.
        gc.disable()
        w = answer_pipe[1]
        # Every other descriptor let go at once: a pipe of a scan that another
        # thread of the caller runs meanwhile must not wait for this one's end.
        low = 3
        for fd in sorted({queue, w}):
            os.closerange(low, fd)
            low = fd + 1
        os.closerange(low, 1 << 30)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        (holders, denied, empty), done = _drain(matcher, batches, queue)
        answer = ([tuple(h) for h in holders], denied, empty, done)
        view = memoryview(marshal.dumps(answer))
        while view:
            view = view[os.write(w, view) :]
        code = 0
    finally:
        os._exit(code)


def _read_all(fd: int) -> bytes:
    chunks: list[bytes] = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _decode(data: bytes) -> tuple[_Part, list[int]] | None:
    """A worker's answer (what it found, the batches it read), or None if it is
    not one: its batches are then read again."""
    try:
        raw, denied, empty, done = marshal.loads(data)
        part = [Holder(*t) for t in raw], [int(p) for p in denied], [int(p) for p in empty]
        return part, [int(i) for i in done]
    except (EOFError, ValueError, TypeError):
        return None


def _uid(pid: int) -> int:
    uid = procscan.uid_of(pid)
    return -1 if uid is None else uid


# ------------------------------------------------------------------ details


class Details(NamedTuple):
    command: str
    age_s: float | None
    rss_bytes: int | None


def details(pid: int) -> Details:
    """What a person needs to see of a holder (only for the few found, after the scan).

    Read from /proc directly, not through psutil: importing psutil costs more
    than ``hold audit``'s whole scan (7 ms on an idle machine, twice that
    where site-packages is large); three small files tell the same.
    """
    try:
        command = read_cmdline(pid)
        start = read_stat(pid).starttime
        statm = procscan.read_raw(pid, "statm").split()
    except NoSuchProcess:
        return Details("(exited)", None, None)
    except (AccessDenied, PermissionError):
        return Details("(not readable)", None, None)
    if len(statm) < 2:
        return Details("(exited)", None, None)
    # The start time counts from boot as CLOCK_BOOTTIME does (both as this pid
    # namespace's time namespace sees them); not btime: that is rounded to seconds.
    uptime = time.clock_gettime(time.CLOCK_BOOTTIME)
    age = max(0.0, uptime - start / os.sysconf("SC_CLK_TCK"))
    return Details(command, age, int(statm[1]) * os.sysconf("SC_PAGE_SIZE"))


NvmlMemory = Callable[[], dict[tuple[int, int], int] | None]  # hold.devices.nvml.used_memory's kind


def device_memory(
    holders: list[Holder], nvml_memory: NvmlMemory | None = None
) -> dict[tuple[int, str, int | None], int]:
    """Bytes of device memory per (pid, class, index), where the driver reports it.

    NVIDIA: NVML (:mod:`hold.devices.nvml`) where the driver is; AMD: the KFD per-process
    entries in sysfs; others: DRM ``fdinfo`` memory keys. Absent sources are
    skipped: the column then says nothing rather than something wrong.
    ``nvml_memory``: NVML's figures asked for already (:class:`hold.devices.nvml.Prefetch`).
    """
    out: dict[tuple[int, str, int | None], int] = {}
    pids = {h.pid for h in holders}
    if not pids:
        return out
    _nvml(holders, out, nvml_memory)
    _kfd(pids, out)
    _drm_fdinfo(holders, out)
    return out


def _nvml(
    holders: list[Holder],
    out: dict[tuple[int, str, int | None], int],
    asked: NvmlMemory | None,
) -> None:
    # Only the gpu class's rows show NVML's figures: no NVML for other classes.
    pids = {h.pid for h in holders if h.cls == "gpu"}
    if not pids:
        return
    if asked is None:
        # lazy: NVML (ctypes) only for gpu holders; off hold audit's and the daemon's start
        from hold.devices import nvml

        asked = nvml.used_memory
    for (pid, minor), used in (asked() or {}).items():
        if pid in pids:
            out[(pid, "gpu", minor)] = used


def _kfd(pids: set[int], out: dict[tuple[int, str, int | None], int]) -> None:
    for pid in pids:
        for path in glob.glob(f"/sys/class/kfd/kfd/proc/{pid}/vram_*"):
            try:
                with open(path, "rb") as f:
                    used = int(f.read().strip())
            except (OSError, ValueError):
                continue
            key = (pid, "gpu", None)
            out[key] = out.get(key, 0) + used


def _drm_fdinfo(holders: list[Holder], out: dict[tuple[int, str, int | None], int]) -> None:
    for h in holders:
        # Only DRM nodes have drm-* keys; reading every fdinfo of every other
        # holder would be most of a large audit's time for nothing.
        if (h.pid, h.cls, h.unit) in out or not h.node.startswith("/dev/dri/"):
            continue
        total = 0
        for data in procscan.fdinfos(h.pid):
            if b"drm-" not in data:
                continue
            for line in data.splitlines():
                if line.startswith((b"drm-memory-", b"drm-resident-")):
                    value = line.split(b":", 1)[1].split()
                    try:
                        n = int(value[0])
                    except (IndexError, ValueError):
                        continue
                    unit = value[1] if len(value) > 1 else b""
                    total += n * {b"KiB": 1024, b"MiB": 1 << 20, b"GiB": 1 << 30}.get(unit, 1)
        if total:
            out[(h.pid, h.cls, h.unit)] = total
