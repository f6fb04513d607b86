"""The state tables of units and calls: complete, every state reachable, the ends final,
a forbidden move refused; and the names are the plain strings ``hold ps`` shows."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import pytest

from hold_supervisor.states import (
    CALL_TRANSITIONS,
    UNIT_TRANSITIONS,
    BadTransition,
    CallState,
    UnitState,
    advance,
    advance_call,
    allowed,
)

TABLES: list[tuple[Any, Any, Any]] = [
    (
        UNIT_TRANSITIONS,
        UnitState.WAITING,
        {UnitState.STOPPED, UnitState.SURVIVED, UnitState.SKIPPED},
    ),
    (CALL_TRANSITIONS, CallState.QUEUED, {CallState.DONE}),
]


def _reachable(table: Mapping[StrEnum, frozenset[StrEnum]], start: StrEnum) -> set[StrEnum]:
    seen = {start}
    todo = [start]
    while todo:
        for nxt in table[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.mark.parametrize(("table", "start", "ends"), TABLES, ids=["unit", "call"])
def test_table_is_complete_and_closed(table, start, ends) -> None:
    kind = type(start)
    assert set(table) == set(kind)  # a row for every state
    for old, targets in table.items():
        assert all(isinstance(t, kind) for t in targets)
        assert old not in targets  # no state moves to itself


@pytest.mark.parametrize(("table", "start", "ends"), TABLES, ids=["unit", "call"])
def test_every_state_reachable_from_the_start(table, start, ends) -> None:
    assert _reachable(table, start) == set(type(start))


@pytest.mark.parametrize(("table", "start", "ends"), TABLES, ids=["unit", "call"])
def test_terminal_states_have_no_way_out(table, start, ends) -> None:
    assert {s for s, targets in table.items() if not targets} == ends
    # and every other state can still get to an end
    for s in table:
        assert _reachable(table, s) & ends, s


def test_every_spawned_unit_can_be_stopped() -> None:
    """The stack's stop takes any unit that was spawned to stopping, whatever it was doing."""
    for s in UnitState:
        if s in (
            UnitState.WAITING,
            UnitState.STOPPING,
            UnitState.STOPPED,
            UnitState.SURVIVED,
            UnitState.SKIPPED,  # never spawned
        ):
            continue
        assert UnitState.STOPPING in UNIT_TRANSITIONS[s], s
    assert UNIT_TRANSITIONS[UnitState.STOPPING] == {UnitState.STOPPED, UnitState.SURVIVED}


def test_the_names_are_the_strings_shown() -> None:
    assert [s.value for s in UnitState] == [
        "waiting",
        "starting",
        "ready",
        "failed",
        "exited",
        "backoff",
        "restarting",
        "stopping",
        "stopped",
        "survived",
        "completed",
        "skipped",
    ]
    assert [s.value for s in CallState] == ["queued", "running", "stopping", "done"]
    assert UnitState.READY == "ready"
    assert f"{UnitState.BACKOFF}" == "backoff" and str(CallState.DONE) == "done"
    assert json.dumps({"state": UnitState.SURVIVED}) == '{"state": "survived"}'


@dataclass
class _Unit:
    name: str
    state: UnitState


@dataclass
class _Call:
    id: str
    state: CallState


def test_a_unit_follows_its_life() -> None:
    u = _Unit("model", UnitState.WAITING)
    for s in (
        UnitState.STARTING,
        UnitState.READY,
        UnitState.EXITED,
        UnitState.BACKOFF,
        UnitState.STARTING,
        UnitState.READY,
        UnitState.RESTARTING,
        UnitState.STARTING,
        UnitState.FAILED,
        UnitState.STOPPING,
        UnitState.SURVIVED,
    ):
        advance(u, s)
        assert u.state is s


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (UnitState.WAITING, UnitState.READY),  # ready without starting
        (UnitState.FAILED, UnitState.RESTARTING),  # hold restart refuses a failed unit
        (UnitState.STOPPED, UnitState.STARTING),  # an end is final
        (UnitState.SURVIVED, UnitState.STOPPING),
        (UnitState.STOPPING, UnitState.READY),
        (UnitState.READY, UnitState.READY),
    ],
)
def test_a_forbidden_unit_move_raises(old: UnitState, new: UnitState) -> None:
    u = _Unit("model", old)
    assert not allowed(old, new)
    with pytest.raises(BadTransition, match=f"unit model: {old} -> {new}"):
        advance(u, new)
    assert u.state is old  # unchanged
    assert issubclass(BadTransition, AssertionError)  # an internal error


def test_call_moves() -> None:
    c = _Call("abc", CallState.QUEUED)
    advance_call(c, CallState.RUNNING)
    advance_call(c, CallState.STOPPING)
    advance_call(c, CallState.DONE)
    with pytest.raises(BadTransition, match="call abc: done -> running"):
        advance_call(c, CallState.RUNNING)
    assert c.state is CallState.DONE
    q = _Call("def", CallState.QUEUED)
    advance_call(q, CallState.DONE)  # cancelled in line
    with pytest.raises(BadTransition):
        advance_call(_Call("x", CallState.QUEUED), CallState.STOPPING)


def test_kinds_do_not_mix() -> None:
    assert not allowed(UnitState.STOPPING, CallState.DONE)
    assert not allowed(CallState.RUNNING, UnitState.READY)
