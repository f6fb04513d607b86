"""The resource figures of one tree: CPU time, memory, process count (:class:`TreeUsage`).

Two sources, the strongest first:

* ``cgroup`` -- a tree with a cgroup leaf: ``cpu.stat`` (``usage_usec``, every
  process that ever ran in the leaf or below it, the exited ones included),
  ``memory.current`` (the memory charged to the leaf: anonymous memory, page
  cache, kernel memory), ``pids.current`` and ``memory.peak`` (Linux 5.19+).
  The kernel keeps these whether or not a controller is enabled for
  ``cpu.stat``; ``memory.*`` and ``pids.*`` exist only where the controllers
  are (a hybrid host's v2 tree has none): there memory and count are those of
  the leaf's processes, read through psutil, and ``peak_bytes`` is None.
* ``psutil`` -- a tree without a leaf, given as its pids (the caller found
  them: :meth:`hold_supervisor.proc.tree.Tree.members`): the resident memory
  (RSS) of each and its CPU time, with the CPU time of the children it reaped.
  An exited member's time then counts only if a member reaped it, so the sum
  can fall when one exits: a counter that resets now and then.

psutil is imported only here, and only for a tree without a leaf (or a leaf
without the memory controller): never on ``hold run``'s or ``npu-hold``'s
path. CPU per cent is the difference of two readings over the wall time
between them (:func:`cpu_percent`, :class:`Rates`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Literal

from hold_supervisor.parse import format_bytes, format_duration

Source = Literal["cgroup", "psutil"]


@dataclass(frozen=True, slots=True)
class TreeUsage:
    """One reading of a tree's figures, taken at ``at`` (``time.monotonic()``).

    ``cpu_seconds``: user and system time; ``rss_bytes``: resident memory
    (with a cgroup, the memory charged to it); ``pids``: live processes;
    ``peak_bytes``: the cgroup's ``memory.peak`` where the kernel has it."""

    cpu_seconds: float
    rss_bytes: int
    pids: int
    source: Source
    at: float
    peak_bytes: int | None = None

    def doc(self, percent: float | None) -> dict[str, Any]:
        """The figures as the status and ``ps`` documents carry them."""
        return {
            "cpu_seconds": round(self.cpu_seconds, 3),
            "cpu_percent": None if percent is None else round(percent, 1),
            "rss_bytes": self.rss_bytes,
            "pids": self.pids,
            "source": self.source,
        }


def of_leaf(path: str) -> TreeUsage | None:
    """The figures of the cgroup leaf at ``path`` (and everything below it); None
    where it is gone or its ``cpu.stat`` cannot be read."""
    at = time.monotonic()
    stat = _read(path, "cpu.stat")
    if stat is None:
        return None
    usec = _field(stat, b"usage_usec")
    if usec is None:
        return None
    memory = _number(path, "memory.current")
    count = _number(path, "pids.current")
    if memory is None or count is None:
        # lazy: proc.cgroup only for a leaf short of figures; off hold status's start
        from hold_supervisor.proc.cgroup import Leaf

        pids = Leaf(path).pids()
        by_psutil = of_pids(pids)
        memory = by_psutil.rss_bytes if memory is None else memory
        count = len(pids) if count is None else count
    return TreeUsage(usec / 1e6, memory, count, "cgroup", at, _number(path, "memory.peak"))


def of_pids(pids: Iterable[int]) -> TreeUsage:
    """The figures of the processes ``pids`` (those gone meanwhile left out), through psutil."""
    # lazy: psutil (~20 modules) only for figures; off the daemon's and supervisor's start
    import psutil

    at = time.monotonic()
    cpu = 0.0
    rss = count = 0
    for pid in set(pids):
        try:
            p = psutil.Process(pid)
            with p.oneshot():
                t = p.cpu_times()
                mem = p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue  # gone meanwhile: not a member any more
        except psutil.AccessDenied:
            continue  # not ours to read (the caller counted only what it may see)
        cpu += t.user + t.system + t.children_user + t.children_system
        rss += mem
        count += 1
    return TreeUsage(cpu, rss, count, "psutil", at)


def total(readings: Iterable[TreeUsage | None]) -> TreeUsage | None:
    """The sum of several trees' readings (a lease's, a stack's); None if none was read.
    The source is ``cgroup`` only if every tree's was."""
    got = [r for r in readings if r is not None]
    if not got:
        return None
    peaks = [r.peak_bytes for r in got]
    return TreeUsage(
        sum(r.cpu_seconds for r in got),
        sum(r.rss_bytes for r in got),
        sum(r.pids for r in got),
        "cgroup" if all(r.source == "cgroup" for r in got) else "psutil",
        min(r.at for r in got),
        None if any(p is None for p in peaks) else sum(p for p in peaks if p is not None),
    )


def cpu_percent(before: TreeUsage, after: TreeUsage) -> float | None:
    """CPU per cent between two readings of one tree (100 is one CPU busy all the
    time); None where no time passed between them. Never below 0 (a psutil sum
    falls when a member exits unreaped)."""
    wall = after.at - before.at
    if wall <= 0:
        return None
    return max(0.0, (after.cpu_seconds - before.cpu_seconds) / wall * 100.0)


class Rates:
    """The last reading of each tree (or lease, or unit), to give a CPU per cent
    at the next: :meth:`percent` compares a new reading with the last one at
    least ``least`` seconds older, so that two askers a moment apart do not
    get a per cent over a millisecond. Shared by threads."""

    def __init__(self, least: float = 0.5) -> None:
        self.least = least
        self._lock = threading.Lock()
        self._last: dict[Hashable, TreeUsage] = {}
        self._said: dict[Hashable, float] = {}

    def percent(self, key: Hashable, now: TreeUsage) -> float | None:
        """The CPU per cent of ``key`` since its last reading (None at the first)."""
        with self._lock:
            before = self._last.get(key)
            if before is not None and now.at - before.at < self.least:
                return self._said.get(key)
            self._last[key] = replace(now)
            if before is None:
                return None
            pct = cpu_percent(before, now)
            if pct is not None:
                self._said[key] = pct
            return pct

    def forget(self, keep: Iterable[Hashable]) -> None:
        """Drop the readings of every key not in ``keep`` (ended leases, removed units)."""
        kept = set(keep)
        with self._lock:
            for key in set(self._last) - kept:
                del self._last[key]
                self._said.pop(key, None)


def _read(path: str, name: str) -> bytes | None:
    try:
        with open(f"{path}/{name}", "rb") as f:
            return f.read()
    except OSError:
        return None


def _field(data: bytes, key: bytes) -> int | None:
    for line in data.splitlines():
        k, _, v = line.partition(b" ")
        if k == key:
            try:
                return int(v)
            except ValueError:
                return None
    return None


def _number(path: str, name: str) -> int | None:
    data = _read(path, name)
    if data is None:
        return None
    try:
        return int(data.strip())
    except ValueError:
        return None  # "max", or not a number


HEAD = ("CPU%", "CPU", "MEM", "PROCS")  # the table columns of :func:`cells`


def cells(doc: dict[str, Any] | None) -> list[str]:
    """A ``usage`` document (:meth:`TreeUsage.doc`) as the four table cells of
    :data:`HEAD` (``-`` for what is unknown)."""
    if not isinstance(doc, dict):
        return ["-"] * len(HEAD)
    pct = doc.get("cpu_percent")
    return [
        "-" if pct is None else f"{pct:.0f}%",
        format_duration(doc.get("cpu_seconds")),
        format_bytes(doc.get("rss_bytes")),
        str(doc.get("pids", "-")),
    ]


def words(doc: dict[str, Any] | None) -> str:
    """A ``usage`` document in words, for a piped line: ``cpu 12% 3m07s  mem 1.2GiB  procs 3``."""
    if not isinstance(doc, dict):
        return ""
    pct, cpu, mem, procs = cells(doc)
    return f"cpu {pct} {cpu}  mem {mem}  procs {procs}"
