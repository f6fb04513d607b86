"""Which processes a holder scan (:func:`hold.devices.holders.scan`) may pass over.

Two kinds, both decided without reading the process itself:

* **Kernel threads**: kthreadd (pid 2, checked to be one) and those of its
  children that have no program (``exe``). They hold no user's descriptor or
  mapping, and on a small machine they are most of ``/proc``. A child of
  kthreadd with a program is a user-mode helper (modprobe, a core dump
  handler) and is read like anyone else.
* **A process read a moment ago** (:class:`ScanCache`, the daemon's): one
  that a scan of the *same nodes* found holding none of them at most
  :data:`WINDOW` seconds ago, and whose pid cannot have been handed out
  again since. The pid check costs no system call per process: the kernel
  hands pids out in order (the cursor is the last field but one of
  ``/proc/loadavg``), so a pid outside the range handed out since is the
  same process (or none). This assumes fewer than ``pid_max`` new tasks
  within the window (655,000 a second with the smallest ``pid_max``).

What the window gives up: a process that was read holding nothing and then
opened the node (or was sent a descriptor of it) within the window is not
seen by the next scan. A full scan has the same gap for as long as the scan
takes (each process is read at its own moment), and on a machine with a
thousand processes that is longer than the window.

The reads of ``/proc`` behind both (which pids are kernel threads, the pid
cursor) are :mod:`hold_supervisor.proc.scan`'s: ``kernel_threads``,
``kthreadd_children``, ``pid_cursor``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from hold_supervisor.proc.scan import pid_cursor

WINDOW = 0.05  # seconds a process read holding nothing is believed

Targets = frozenset[tuple[object, ...]]  # the node keys a scan looked for


def reused(pid: int, then: int, now: int) -> bool:
    """Could ``pid`` have been handed out since the cursor stood at ``then``
    (it is at ``now``)? At most one wrap (see the module docstring)."""
    if now >= then:
        return then < pid <= now
    return pid > then or pid <= now


class ScanCache:
    """Processes read holding none of a scan's nodes, per set of nodes (see above)."""

    def __init__(self, window: float = WINDOW) -> None:
        import threading  # here: hold audit, which imports this module, needs no thread (1 ms)

        self.window = window
        self._lock = threading.Lock()  # scans run in the daemon's worker threads
        # targets -> pid -> (when it was read, the pid cursor before the read)
        self._empty: dict[Targets, dict[int, tuple[float, int]]] = {}

    def start(self, targets: Targets, pids: Iterable[int]) -> tuple[list[int], int]:
        """(the pids a scan of ``targets`` must read, the cursor before reading them)."""
        cursor = pid_cursor()
        now = time.monotonic()
        with self._lock:
            known = self._empty.get(targets, {})
            fresh = {
                p: v
                for p, v in known.items()
                if now - v[0] <= self.window and not reused(p, v[1], cursor)
            }
            self._empty[targets] = fresh
        return [p for p in pids if p not in fresh], cursor

    def note(self, targets: Targets, empty: Iterable[int], cursor: int, when: float) -> None:
        """``empty``: pids read from ``when`` on (after the cursor stood at ``cursor``),
        holding none of ``targets``."""
        with self._lock:
            known = self._empty.setdefault(targets, {})
            for pid in empty:
                known[pid] = (when, cursor)
