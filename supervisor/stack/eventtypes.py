"""What the workers of a running stack tell its main thread: one frozen class per
kind of event, all of them here, and :data:`Event`, their union.

A job thread, a liveness check or a control request builds one and posts it
(:meth:`~hold_supervisor.stack.state.StackState.post`); the main thread takes it
(:func:`~hold_supervisor.stack.events.handle_events`, or, once the stack is
stopping, :mod:`~hold_supervisor.stack.stop`) and dispatches on its class, every
case named: an event of any other type is an error there, never ignored.

A job's :class:`Outcome` (the payload of :class:`Result`) is here too: a start
returns one, and a unit spawned before the run had a thread keeps a failed one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple, Never

from hold_supervisor.proc.stop import StopReport
from hold_supervisor.stack.readiness import Answer

if TYPE_CHECKING:  # both import this module: a cycle at run time
    from hold_supervisor.stack.liveness import Liveness
    from hold_supervisor.stack.units import Unit

# How a job ended: ``ready`` (a service), ``completed`` (a oneshot, status 0),
# ``failed`` (with an exit status and why), ``aborted`` (the stack is stopping).
Ending = Literal["ready", "completed", "failed", "aborted"]


class Outcome(NamedTuple):
    """A job's end: how, the exit status (0 unless failed), and why."""

    ending: Ending
    code: int
    why: str


@dataclass(frozen=True, slots=True)
class Say:
    """A line to show (from a thread that may not write the display itself)."""

    text: str


@dataclass(frozen=True, slots=True)
class Spawned:
    """The unit's process was spawned (its pid and tree are set)."""

    unit: Unit


@dataclass(frozen=True, slots=True)
class Result:
    """The unit's job is over: the main thread joins it and moves the unit's state."""

    unit: Unit
    outcome: Outcome


@dataclass(frozen=True, slots=True)
class Skipped:
    """An essential unit can never start (what it waits on failed for good): why."""

    unit: Unit
    why: str


@dataclass(frozen=True, slots=True)
class Alive:
    """One liveness answer of ``watcher``, the check of the unit's process it was
    started for (a stale watcher's answer is dropped)."""

    unit: Unit
    watcher: Liveness
    answer: Answer


@dataclass(frozen=True, slots=True)
class Cleaned:
    """The cleaning job of an ended unit is over: what it stopped (None: nothing
    to stop), and the backoff before its restart."""

    unit: Unit
    report: StopReport | None
    delay: float


@dataclass(frozen=True, slots=True)
class OnMain:
    """A control request that changes the stack (``down``, ``restart``): run ``fn``
    in the main thread."""

    fn: Callable[[], None]


Event = Say | Spawned | Result | Skipped | Alive | Cleaned | OnMain


def not_an_event(ev: Never) -> TypeError:
    """The error for what reached a dispatch and is none of the events. A dispatch's
    last case passes it here, narrowed to ``Never``: mypy fails a dispatch that
    misses a kind, and at run time what untyped code posted is told, never ignored."""
    return TypeError(f"not a stack event: {ev!r} ({type(ev).__qualname__})")
