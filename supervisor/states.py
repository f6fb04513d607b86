"""The states of a stack's units and of a task unit's calls, and the moves between them.

Each state is a :class:`~enum.StrEnum` member whose value is the name shown
by ``hold ps`` (table and ``--json``), so it prints, compares and serialises
as that plain string. Every change of state goes through :func:`advance` (a
unit) or :func:`advance_call` (a call), which check it against the table
and raise :class:`BadTransition` (an internal error) on a move the table
does not allow.

A unit (a service) begins ``waiting``; once its dependencies are ready it is
``starting``, then ``ready`` or ``failed``. A ready unit that ends is
``exited``; an exited or failed one the restart policy takes back is in
``backoff``, then ``starting`` again. ``hold restart`` takes a ready,
exited or backing-off unit to ``restarting``, then ``starting``. When the
stack stops, every unit that was ever spawned goes to ``stopping``, then
``stopped`` or ``survived`` (its process outlived the stop): the two ends.

A one-shot unit (``kind: oneshot``) goes ``waiting -> starting`` and then
``completed`` (exited 0, what it left stopped) or ``failed``. A unit whose
dependency can no longer be met (it failed for good and was not essential)
goes from ``waiting`` to ``skipped`` and is never started.

A call: ``queued -> running -> stopping -> done``; any of them may end
(``done``) at once on a refusal, a failed spawn or an internal error.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Protocol


class BadTransition(AssertionError):
    """A state change the table does not allow: a bug in the supervisor."""


class UnitState(StrEnum):
    WAITING = "waiting"  # not started yet: its dependencies are not all ready
    STARTING = "starting"  # spawned (or spawning), waiting for its readiness probe
    READY = "ready"  # running and ready; its exit is watched
    FAILED = "failed"  # could not spawn, ended before it was ready, or not ready in time
    EXITED = "exited"  # ended after it was ready
    BACKOFF = "backoff"  # what it left is stopped; starts again after the delay
    RESTARTING = "restarting"  # hold restart: being stopped, then started again
    STOPPING = "stopping"  # the stack is stopping it
    STOPPED = "stopped"  # stopped, nothing of it left
    SURVIVED = "survived"  # stopped, but its process is still there
    COMPLETED = "completed"  # a oneshot that exited 0 (what it left was stopped)
    SKIPPED = "skipped"  # never started: a dependency failed for good


U = UnitState

UNIT_TRANSITIONS: Mapping[UnitState, frozenset[UnitState]] = {
    # An internal error in the start job before it spawned also fails the unit.
    U.WAITING: frozenset({U.STARTING, U.FAILED, U.SKIPPED}),
    U.STARTING: frozenset({U.READY, U.COMPLETED, U.FAILED, U.STOPPING}),
    U.READY: frozenset({U.EXITED, U.RESTARTING, U.STOPPING}),
    U.FAILED: frozenset({U.BACKOFF, U.STOPPING}),
    U.EXITED: frozenset({U.BACKOFF, U.RESTARTING, U.STOPPING}),
    U.BACKOFF: frozenset({U.STARTING, U.RESTARTING, U.FAILED, U.STOPPING}),
    # Survivors of the stop before the restart fail it.
    U.RESTARTING: frozenset({U.STARTING, U.FAILED, U.STOPPING}),
    U.STOPPING: frozenset({U.STOPPED, U.SURVIVED}),
    U.STOPPED: frozenset(),
    U.SURVIVED: frozenset(),
    U.COMPLETED: frozenset({U.STOPPING}),
    U.SKIPPED: frozenset(),
}

del U


class CallState(StrEnum):
    QUEUED = "queued"  # waiting for a slot
    RUNNING = "running"
    STOPPING = "stopping"  # ended, timed out or cancelled: what is left is stopped
    DONE = "done"  # the result is there


CALL_TRANSITIONS: Mapping[CallState, frozenset[CallState]] = {
    CallState.QUEUED: frozenset({CallState.RUNNING, CallState.DONE}),
    CallState.RUNNING: frozenset({CallState.STOPPING, CallState.DONE}),
    CallState.STOPPING: frozenset({CallState.DONE}),
    CallState.DONE: frozenset(),
}


class HasUnitState(Protocol):
    name: str
    state: UnitState


class HasCallState(Protocol):
    id: str
    state: CallState


def allowed(old: UnitState | CallState, new: UnitState | CallState) -> bool:
    """Whether the table of ``old``'s kind allows the move from ``old`` to ``new``."""
    if isinstance(old, UnitState) and isinstance(new, UnitState):
        return new in UNIT_TRANSITIONS[old]
    if isinstance(old, CallState) and isinstance(new, CallState):
        return new in CALL_TRANSITIONS[old]
    return False


def advance(unit: HasUnitState, new: UnitState) -> None:
    """Move ``unit`` to ``new``; :class:`BadTransition` if the table forbids it."""
    old = unit.state
    if not allowed(old, new):
        raise BadTransition(f"unit {unit.name}: {old} -> {new} is not a transition")
    unit.state = new


def advance_call(call: HasCallState, new: CallState) -> None:
    """Move ``call`` to ``new``; :class:`BadTransition` if the table forbids it."""
    old = call.state
    if not allowed(old, new):
        raise BadTransition(f"call {call.id}: {old} -> {new} is not a transition")
    call.state = new
