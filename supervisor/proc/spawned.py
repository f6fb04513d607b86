"""The children this process spawned, told apart from the orphans it adopted.

A child subreaper (:mod:`hold_supervisor.proc.reaper`) has two kinds of
children: those a spawn made, each reaped by its own
:class:`~hold_supervisor.spawn.child.Child`, and the orphans of its trees, which
it reaps itself (:func:`hold_supervisor.proc.reaper.reap_adopted`) and which
belong to a tree ("adopted"). A pid is known to be spawned only once the spawn
has returned it, so a spawn holds :func:`registering` from before the fork
until the pid is written down, and every "is this child ours" question waits
for that: otherwise a child that exits at once (a readiness probe's ``test``)
could be reaped, or killed, as somebody's orphan between the two (seen under
load: a unit failed to start with ``NoSuchProcess``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_spawned: set[int] = set()
_lock = threading.Lock()


@contextmanager
def registering() -> Iterator[Callable[[int], None]]:
    """Around a spawn: yields the function that records the new child's pid. Until
    the block ends, :func:`is_spawned` and :func:`pids` wait (a few milliseconds)."""
    with _lock:
        yield _spawned.add


def forget(pid: int) -> None:
    """The child ``pid`` was reaped by its owner."""
    with _lock:
        _spawned.discard(pid)


def is_spawned(pid: int) -> bool:
    """Whether our child ``pid`` was made by a spawn (False: an adopted orphan)."""
    with _lock:
        return pid in _spawned


def pids() -> frozenset[int]:
    """Every spawned child not reaped yet."""
    with _lock:
        return frozenset(_spawned)
