"""A running stack's events are typed (issue 22): the main loop and the stop
dispatch on the event's class, and what is none of the event classes is an
error -- it stops the loop loudly (the stack then stops, cause ``internal``);
during the stop it is told and the stop goes on. Nothing runs here: a
:class:`StackState` over a loaded spec, its queue fed by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hold_supervisor.spawn.containment import WalkContainment
from hold_supervisor.stack.display import Display
from hold_supervisor.stack.events import handle_events
from hold_supervisor.stack.eventtypes import Cleaned, OnMain, Outcome, Result, Say, Spawned
from hold_supervisor.stack.state import StackState
from hold_supervisor.stack.stop import _handle_results_quietly
from hold_supervisor.stackfile.load import load

STACK = """\
name: ev
units:
  a:
    cmd: [/bin/true]
"""


def state(tmp_path: Path, said: list[str]) -> StackState:
    path = tmp_path / "stack.yaml"
    spec = load(str(path), text=STACK)
    return StackState(
        spec,
        run_dir=str(tmp_path),
        containment=WalkContainment(),
        environ={},
        display=Display(write=said.append, live=False),
    )


def untyped(ev: object) -> Any:
    """What untyped code could post (mypy refuses it from typed code)."""
    return ev


def test_events_dispatch_by_class(tmp_path: Path) -> None:
    said: list[str] = []
    st = state(tmp_path, said)
    ran: list[str] = []
    st.post(Say("hello"))
    st.post(OnMain(lambda: ran.append("main")))
    handle_events(st)
    assert said == ["hold up: hello"]
    assert ran == ["main"]
    assert st.events.empty()


@pytest.mark.parametrize(
    "ev",
    [("say", "the old tagged tuple"), "say", object(), Outcome("ready", 0, "not an event")],
    ids=["tagged-tuple", "string", "object", "outcome"],
)
def test_an_unknown_event_is_an_error_in_the_loop(tmp_path: Path, ev: object) -> None:
    said: list[str] = []
    st = state(tmp_path, said)
    st.post(untyped(ev))
    with pytest.raises(TypeError, match="not a stack event"):
        handle_events(st)
    assert said == []  # not taken for a Say


def test_an_unknown_event_during_the_stop_is_told_and_the_stop_goes_on(tmp_path: Path) -> None:
    said: list[str] = []
    st = state(tmp_path, said)
    u = st.units["a"]
    st.post(untyped(("result", u, "failed", 1, "old")))
    st.post(Spawned(u))  # dropped quietly: the stop decides now
    st.post(Say("after"))
    _handle_results_quietly(st)
    assert len(said) == 2, said
    assert "internal error while stopping: not a stack event" in said[0]
    assert said[1] == "hold up: after"
    assert st.events.empty()


def test_the_stop_takes_the_last_results_of_jobs(tmp_path: Path) -> None:
    said: list[str] = []
    st = state(tmp_path, said)
    u = st.units["a"]
    marker: Any = object()
    u.job = marker
    st.post(Result(u, Outcome("aborted", 0, "")))
    _handle_results_quietly(st)
    assert u.job is None
    u.job = marker
    st.post(Cleaned(u, None, 0.0))
    _handle_results_quietly(st)
    assert u.job is None
    assert said == []
