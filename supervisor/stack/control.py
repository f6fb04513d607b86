"""The control requests of a running stack (its ``control.sock``): ``ps``, ``call``,
``down``, ``restart``.

:func:`on_request` runs in the control connection's thread. ``ps`` is answered
there (from snapshots); a ``call`` is served there, from request to result, by
the task unit's runner; ``down`` and ``restart`` change the stack, so they are
posted to the main thread, and a manual restart's stop-and-start is a job.
"""

from __future__ import annotations

import base64
import os
import select
import threading
import time
from typing import TYPE_CHECKING, Any

from hold_supervisor.cause import Cause
from hold_supervisor.exitcodes import BUSY, OK, SURVIVORS, UNIT_FAILED, USAGE
from hold_supervisor.jsonlines import MAX_LINE, BadJSON, LineBuffer
from hold_supervisor.parse import did_you_mean
from hold_supervisor.proc.stop import stop_tree
from hold_supervisor.spawn.child import owned_pids
from hold_supervisor.stack.controlsock import Message, Reply
from hold_supervisor.stack.eventtypes import OnMain, Outcome, Result
from hold_supervisor.stack.start import launch, start_and_wait
from hold_supervisor.stack.state import StackState
from hold_supervisor.stack.stop import levels
from hold_supervisor.stack.units import TaskUnit, Unit, reap
from hold_supervisor.stack.wire import StackEv, StackOp
from hold_supervisor.states import CallState, UnitState, advance

if TYPE_CHECKING:
    from hold_supervisor.task.task import Call

# While a call waits for a slot, its client hears from us this often (``queued``),
# and ``running`` once it starts: a silent stack is then a stuck one, and a running
# call's client waits no longer than the task's timeout, its grace and a margin.
CALL_BEAT = 2.0
_LOOK = 0.1  # how often a queued call's state is looked at (its start told at once)
# Beyond the units' graces, in a bound told to a client: the kill, the survivor
# check, a busy machine.
_MARGIN = 10.0


_ASKED = ", ".join(o for o in StackOp if o != StackOp.CANCEL)  # CANCEL: on a call's line only


def on_request(st: StackState, msg: Message, reply: Reply) -> None:
    """In a control connection's thread: answer ps here; hand the rest to the main thread."""
    op = msg.get("op")
    if op == StackOp.PS:
        reply.send(_ps(st), done=True)
    elif op == StackOp.CALL:
        _serve_call(st, msg, reply)
    elif op == StackOp.DOWN:
        st.post(OnMain(lambda: _down(st, reply)))
    elif op == StackOp.RESTART:
        st.post(OnMain(lambda: _restart(st, str(msg.get("unit")), reply)))
    else:
        reply.send(
            {
                "ev": StackEv.ERROR,
                "error": f"unknown op {op!r}; accepted: {_ASKED}",
            },
            done=True,
        )


def _ps(st: StackState) -> dict[str, Any]:
    now = time.monotonic()
    runners = [t.runner for t in st.tasks.values() if t.runner is not None]
    # Each unit's figures (usage): read here, in the connection's thread.
    since = st.since_ticks  # no unit's process started before the stack's supervisor
    return {
        "ev": StackEv.PS,
        "stack": st.name,
        "pid": os.getpid(),
        "file": os.path.abspath(st.source),
        "phase": st.phase,
        "uptime": round(now - st.started_at, 3),
        "run_dir": st.run_dir,
        "units": [
            {**u.snapshot(now), "usage": st.figures.doc(u.name, u.leaf, u.tree, u.tree_id, since)}
            for u in st.units.values()
        ]
        + [
            {
                **_task_row(t.runner.snapshot(st.phase == "running" and st.cause is None)),
                "usage": st.figures.doc(t.name, t.leaf, None, t.tree_id, since),
            }
            for t in st.tasks.values()
            if t.runner is not None
        ],
        "calls": [c.snapshot(now) for r in runners for c in r.running()],
    }


def _task_row(snap: dict[str, Any]) -> dict[str, Any]:
    """A task unit's row with the fields of a service's (a task is essential: it
    ends only with the stack; it has no liveness check)."""
    return {**snap, "essential": True, "liveness": ""}


# ---------------------------------------------------------------------- call


def _serve_call(st: StackState, msg: Message, reply: Reply) -> None:
    """In the connection's thread: one call of a task unit, from request to result.

    Answers ``accepted`` (with the call id) once it is in, then ``result``
    (``done``). The call is cancelled if the client goes away (the
    connection closes: Ctrl-C, SIGKILL) or asks to (``{"op": "cancel"}``
    on the same connection); the result then still comes, to whoever is
    left to read it.
    """
    taken = _task_to_call(st, msg, reply)
    if taken is None:
        return
    from hold_supervisor.task.task import CallRefused  # loaded already: open_tasks made the runner

    t, text_args = taken
    assert t.runner is not None
    try:
        call = t.runner.submit(
            msg.get("args", {}), text_args=text_args, no_wait=bool(msg.get("no_wait"))
        )
    except CallRefused as e:
        reply.send({"ev": StackEv.ERROR, "code": e.code, "errors": e.errors}, done=True)
        return
    reply.send(
        {
            "ev": StackEv.ACCEPTED,
            "call": call.id,
            "unit": t.name,
            "state": call.state,
            "timeout": t.runner.timeout,
            "grace": t.spec.stop.grace,
            "beat": CALL_BEAT,
        }
    )
    _follow_call(call, reply)
    r = call.result()
    ans = {"ev": StackEv.RESULT, **r.to_json(stdout=False)}
    ans["stdout_b64"] = base64.b64encode(r.stdout).decode()
    reply.send(ans, done=True)


def _task_to_call(
    st: StackState, msg: Message, reply: Reply
) -> tuple[TaskUnit, dict[str, str]] | None:
    """The task unit the call names and its text arguments, if the stack takes calls
    now; else None, the refusal sent."""
    name = msg.get("unit")
    t = st.tasks.get(name) if isinstance(name, str) else None
    if t is None or t.runner is None:
        tasks = ", ".join(st.tasks) or "none"
        what = "a service, not a task" if name in st.units else "no unit"
        why = f"{name!r} is {what} of stack {st.name} (task units: {tasks})"
        if isinstance(name, str) and name not in st.units:
            why += did_you_mean(name, list(st.tasks))
        reply.send({"ev": StackEv.ERROR, "code": 2, "errors": [why]}, done=True)
        return None
    if st.phase != "running" or st.cause is not None:
        state = "stopping" if st.cause is not None else st.phase
        why = f"stack {st.name} is {state}: calls are taken while it is up"
        reply.send({"ev": StackEv.ERROR, "code": BUSY, "errors": [why]}, done=True)
        return None
    text_args = msg.get("text_args") or {}
    if not isinstance(text_args, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in text_args.items()
    ):
        why = "text_args: a mapping of names to text"
        reply.send({"ev": StackEv.ERROR, "code": 2, "errors": [why]}, done=True)
        return None
    return t, text_args


def _follow_call(call: Call, reply: Reply) -> None:
    """Wait for ``call`` to end while watching its client: gone (end of file,
    reset) or asking ``{"op": "cancel"}`` cancels it. Returns once it is done.

    The client hears ``queued`` every :data:`CALL_BEAT` seconds while the call
    waits for a slot, and ``running`` once it has one (looked at every 0.1 s)."""
    wake_r, wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    lock = threading.Lock()
    closed = False

    def done(_c: Call) -> None:
        # Under the lock: never a write to the number once it is closed (and reused).
        with lock:
            if not closed:
                os.write(wake_w, b"x")

    try:
        call.add_done_callback(done)
        poller = select.poll()
        poller.register(wake_r, select.POLLIN)
        client = reply.fileno()
        if client >= 0:
            poller.register(client, select.POLLIN | select.POLLRDHUP)
        asked = LineBuffer(MAX_LINE)
        running_told = False
        beat_at = time.monotonic() + CALL_BEAT
        while not call.done():
            queued = call.state == CallState.QUEUED
            if not queued and not running_told:
                running_told = True
                reply.send({"ev": StackEv.RUNNING, "call": call.id})
            elif queued and time.monotonic() >= beat_at:
                beat_at = time.monotonic() + CALL_BEAT
                reply.send({"ev": StackEv.QUEUED, "call": call.id})
            for fd, _ev in poller.poll(_LOOK * 1000 if queued else None):
                if fd != client:
                    continue
                data = reply.recv()
                if not data:
                    poller.unregister(client)
                    call.cancel("the caller went away (hold call ended)")
                    continue
                asked.push(data)
                why = _asks_cancel(asked)
                if why is not None:
                    poller.unregister(client)
                    call.cancel(why)
    finally:
        with lock:
            closed = True
            os.close(wake_r)
            os.close(wake_w)


def _asks_cancel(asked: LineBuffer) -> str | None:
    """Why the call is to be cancelled, from the lines its client sent since: it
    asked (``{"op": "cancel"}``), or it sent a line that is not valid (the
    connection is then out of step, and ends as if closed); None: go on.
    Nothing else is asked on a call's connection: other requests are passed over."""
    while True:
        try:
            msg = asked.next()
        except BadJSON as e:
            return f"the caller sent a line that is not valid ({e})"
        if msg is None:
            return None
        if msg.get("op") == StackOp.CANCEL:
            return "cancelled by the caller"


# ---------------------------------------------------------------------- down, restart


def _down(st: StackState, reply: Reply) -> None:
    """Main thread: stop the stack; the reply waits for the end (see stackstop.finish)."""
    reply.send({"ev": StackEv.STOPPING, "within": _stop_bound(st)})
    st.down_waiters.append(reply)
    if st.cause is None:
        st.cause = Cause("down", "hold down", OK)


def _stop_bound(st: StackState) -> float:
    """How long the stop may take at most (seconds), as :func:`hold_supervisor.stack.stop.stop_all`
    goes: the calls (each task's grace), the jobs' end, the units level by level
    (each level's longest grace), the survivor check. ``hold down`` waits that long."""
    calls = sum(t.spec.stop.grace + _MARGIN for t in st.tasks.values())
    jobs = max((u.spec.stop.grace for u in st.units.values()), default=0.0) + _MARGIN
    units = sum(max(u.spec.stop.grace for u in lv) + 5.0 for lv in levels(st))
    return round(calls + jobs + units + _MARGIN, 1)


def _restart(st: StackState, name: str, reply: Reply) -> None:
    """Main thread: a restart asked by ``hold restart``, if the unit is in a state to."""
    u = st.units.get(name)
    if u is None:
        why = f"no unit {name!r} in stack {st.name} (units: {', '.join(st.units)})"
        if name in st.tasks:
            why = f"unit {name} is a task: it runs per call (hold call), never restarted"
        else:
            why += did_you_mean(name, list(st.units))
        reply.send({"ev": StackEv.ERROR, "code": USAGE, "error": why}, done=True)
        return
    if u.spec.kind == "oneshot":
        why = f"unit {name} is a oneshot ({u.state}): it runs once, when the stack starts"
        reply.send({"ev": StackEv.ERROR, "code": USAGE, "error": why}, done=True)
        return
    if (
        st.cause is not None
        or u.job is not None
        or u.state not in (UnitState.READY, UnitState.EXITED, UnitState.BACKOFF)
    ):
        why = f"unit {name} is {u.state}; try again when it is ready"
        reply.send({"ev": StackEv.ERROR, "code": BUSY, "error": why}, done=True)
        return
    u.restart_at = None
    u.total_restarts += 1
    u.final = False
    u.stop_watching()
    advance(u, UnitState.RESTARTING)
    st.say(f"{name}: restarting (asked by hold restart)")
    # How long it may take: its stop (grace, kill, check) and its start until ready.
    ready = u.spec.ready.timeout if u.spec.ready is not None else 0.0
    within = u.spec.stop.grace + ready + 2 * _MARGIN
    reply.send({"ev": StackEv.RESTARTING, "unit": name, "within": within})
    launch(st, u, _manual_restart_job, reply=reply)


def _manual_restart_job(st: StackState, u: Unit, reply: Reply) -> None:
    """Worker: stop the unit's tree, start it again, answer ``hold restart``."""
    try:
        if u.tree is not None:
            u.tree.owned = owned_pids()
            report = stop_tree(u.tree, sig=u.spec.stop.signal, grace=u.spec.stop.grace)
            reap(u.child)
            if report.survivors:
                why = "survivors after the stop for a restart"
                st.post(Result(u, Outcome("failed", SURVIVORS, why)))
                reply.send(
                    {"ev": StackEv.ERROR, "code": SURVIVORS, "error": report.summary()}, done=True
                )
                return
        outcome = start_and_wait(st, u, True)
    except BaseException as e:
        outcome = Outcome("failed", UNIT_FAILED, f"internal error: {e!r}")
    st.post(Result(u, outcome))
    ending, code, why = outcome
    if ending == "ready":
        reply.send({"ev": StackEv.RESTARTED, "unit": u.name, "pid": u.pid}, done=True)
    else:
        why = f"{u.name}: {why or ending}"
        reply.send({"ev": StackEv.ERROR, "code": code or UNIT_FAILED, "error": why}, done=True)
