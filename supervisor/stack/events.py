"""What the main thread does with what happened to a unit: a job's result (ready,
failed, aborted), a ready unit's exit, a cleaned tree; the restart policy; the
stack coming up; and the first cause to stop it.

Workers post events (:meth:`~hold_supervisor.stack.state.StackState.post`, one
class per kind: :mod:`~hold_supervisor.stack.eventtypes`); :func:`handle_events`
takes them in the main thread, the only one that moves a unit's state once its
job is over, and dispatches on their class.
"""

from __future__ import annotations

import functools
import queue
import time

from hold_supervisor.cause import Cause
from hold_supervisor.exitcodes import EXPIRED, NOT_READY, SURVIVORS, UNIT_FAILED
from hold_supervisor.parse import format_cpus
from hold_supervisor.proc.stop import StopReport, stop_tree
from hold_supervisor.spawn.child import owned_pids
from hold_supervisor.stack.eventtypes import (
    Alive,
    Cleaned,
    OnMain,
    Outcome,
    Result,
    Say,
    Skipped,
    Spawned,
    not_an_event,
)
from hold_supervisor.stack.liveness import Liveness, stop_unhealthy
from hold_supervisor.stack.notify import tell_systemd
from hold_supervisor.stack.plan import probe_of
from hold_supervisor.stack.readiness import Answer
from hold_supervisor.stack.start import launch, launch_starts
from hold_supervisor.stack.state import StackState
from hold_supervisor.stack.unitoutput import catch_up
from hold_supervisor.stack.units import Unit, reap, reap_if_exited, status_text
from hold_supervisor.stackfile.spec import fill
from hold_supervisor.states import UnitState, advance


def handle_events(st: StackState) -> None:
    """Take every event the workers posted; one that is none of
    :data:`~hold_supervisor.stack.eventtypes.Event` is an error (the stack stops)."""
    while True:
        try:
            ev = st.events.get_nowait()
        except queue.Empty:
            return
        match ev:
            case Say(text):
                st.say(text)
            case Spawned(u):
                u.spawned_once = True
                port = f", port {u.port}" if u.port is not None else ""
                cpus = f", cpus {format_cpus(u.spec.cpus)}" if u.spec.cpus else ""
                st.say(f"{u.name}: started, pid {u.pid}{port}{cpus}")
                launch_starts(st)  # what waits for it to be started
            case Result(u, outcome):
                _on_result(st, u, outcome)
            case Skipped(u, why):
                fail(st, Cause("start", f"unit {u.name} cannot start: {why}", UNIT_FAILED), u)
            case Alive(u, watcher, answer):
                on_alive(st, u, watcher, answer)
            case Cleaned(u, report, delay):
                _on_cleaned(st, u, report, delay)
            case OnMain(fn):
                fn()
            case _:
                raise not_an_event(ev)


def _on_result(st: StackState, u: Unit, outcome: Outcome) -> None:
    ending, code, why = outcome
    job, u.job = u.job, None
    if job is not None:
        job.join()
    if ending == "ready":
        advance(u, UnitState.READY)
        u.ready_at = time.monotonic()
        u.detail = why
        st.say(f"{u.name}: ready after {u.ready_at - u.spawned_at:.2f}s ({why})")
        _watch_liveness(st, u)
        launch_starts(st)
        maybe_up(st)
        return
    if ending == "completed":
        advance(u, UnitState.COMPLETED)
        reap(u.child)
        u.detail = why
        st.say(f"{u.name}: completed ({why})")
        launch_starts(st)
        maybe_up(st)
        return
    if ending == "aborted":
        # Only the stop aborts a job; a unit that never spawned stays waiting.
        if u.tree is not None:
            advance(u, UnitState.STOPPING)
        return
    # Failed: exited before ready, not ready in time, or could not spawn.
    advance(u, UnitState.FAILED)
    u.detail = why
    reap_if_exited(u)
    if u.spec.kind == "oneshot":
        _end_for_good(st, u, Cause("start", f"oneshot {u.name} failed: {why}", code), why)
        return
    if st.phase == "starting" and u.total_restarts == 0 and u.spec.essential:
        what = {
            NOT_READY: "failed its readiness check",
            EXPIRED: "did not become ready in time",
        }.get(code, "failed to start")
        fail(st, Cause("start", f"unit {u.name} {what}: {why}", code), u)
        return
    _after_end(st, u, failed=True, code=code, why=why)


def _watch_liveness(st: StackState, u: Unit) -> None:
    """A ready unit with ``liveness:`` is checked every period from now on."""
    spec = u.spec.liveness
    if spec is None or u.tree is None:
        return
    f = functools.partial(
        fill,
        unit=u.name,
        ports=st.ports,
        run_dir=st.run_dir,
        stack_dir=st.spec.stack_dir,
        scratch=u.scratch.path if u.scratch else "",
    )
    probe = probe_of(u, spec.as_probe(), f)
    assert probe is not None
    u.live = "ok (not checked yet)"
    u.liveness = Liveness(u, probe, u.tree, period=spec.period, timeout=spec.timeout, post=st.post)


def on_alive(st: StackState, u: Unit, watcher: Liveness, answer: Answer) -> None:
    """A liveness answer: count failures in a row; at the threshold, stop the unit
    (its exit is then a failure, and its restart policy decides)."""
    spec = u.spec.liveness
    if watcher is not u.liveness or spec is None or u.state is not UnitState.READY:
        return  # from a check of a process that is gone
    if answer.ok:
        watcher.failures = 0
        u.live = "ok"
        return
    watcher.failures += 1
    u.live = f"failing {watcher.failures}/{spec.failures}: {answer.detail}"
    if watcher.failures < spec.failures or u.unhealthy or u.child is None:
        return
    u.unhealthy = f"liveness failed {spec.failures} times in a row ({answer.detail})"
    st.say(f"{u.name}: {u.unhealthy}: stopping it")
    stop_unhealthy(u.child, u.spec.stop.signal, u.spec.stop.grace)


def maybe_up(st: StackState) -> None:
    """Once every service is ready (at once when there are none), the stack is up
    and its task units take calls."""
    if st.phase == "starting" and all(x.settled() for x in st.units.values()):
        st.phase = "running"
        st.up_at = time.monotonic()
        st.draw()
        st.display.end_table()
        took = st.up_at - st.started_at
        n = len(st.units) + len(st.tasks)
        st.say(
            f"stack {st.name} is up ({n} units, {took:.2f}s); "
            f"hold ps {st.name} / hold down {st.name}"
        )
        tell_systemd("READY=1", f"STATUS=stack {st.name} is up")
        if st.on_ready is not None:
            st.on_ready()


def fail(st: StackState, cause: Cause, u: Unit) -> None:
    """The stack's cause to stop, if it has none yet, told with the unit's last output."""
    if st.cause is not None:
        return
    st.cause = cause
    catch_up(u)  # what it printed before it ended, in its last output
    lines = list(u.tail)[-10:]
    text = f"{cause.detail}"
    if lines:
        text += f"\n  last output of {u.name}:\n" + "\n".join(f"  | {ln}" for ln in lines)
    else:
        text += f"\n  ({u.name} printed nothing)"
    st.say(text)


def on_exit(st: StackState, u: Unit) -> None:
    """A ready unit's process ended (its pidfd became readable)."""
    assert u.child is not None
    code = u.child.poll()
    if code is None:
        return
    u.stop_watching()
    u.returncode = code
    advance(u, UnitState.EXITED)
    why = f"exited with {status_text(code)}"
    if u.unhealthy:
        why = f"{u.unhealthy}; stopped: {why}"
    st.say(f"{u.name}: {why} after {time.monotonic() - u.spawned_at:.2f}s")
    _after_end(st, u, failed=code != 0 or bool(u.unhealthy), code=UNIT_FAILED, why=why)
    u.unhealthy = ""


def _after_end(st: StackState, u: Unit, *, failed: bool, code: int, why: str) -> None:
    """Restart per policy (after stopping what it left), or end it for good."""
    r = u.spec.restart
    up_for = time.monotonic() - u.ready_at if u.ready_at is not None else 0.0
    if u.ready_at is not None and up_for >= r.reset_after:
        u.restarts = 0
    wanted = r.policy == "always" or (r.policy == "on-failure" and failed)
    if wanted and u.restarts < r.max:
        u.restarts += 1
        u.total_restarts += 1
        delay = min(r.backoff * 2 ** (u.restarts - 1), r.max_backoff)
        advance(u, UnitState.BACKOFF)
        st.say(f"{u.name}: restart {u.restarts} of {r.max} in {delay:g}s")
        u.restart_at = None
        launch(st, u, _clean_job, delay=delay)
        return
    if not wanted:
        how = "not restarted" + (f" (restart policy {r.policy})" if r.policy != "no" else "")
    else:
        how = f"restarts exhausted ({u.restarts} of {r.max} in a row)"
    # A service is meant to run until the stack stops: one that ends for good,
    # even with status 0, is a failure of the stack (never exit 0 for it).
    status = code if failed else UNIT_FAILED
    _end_for_good(
        st,
        u,
        Cause("unit", f"unit {u.name} {why}; {how}: stopping the stack", status),
        f"{why}; {how}",
    )


def _end_for_good(st: StackState, u: Unit, cause: Cause, why: str) -> None:
    """An essential unit's end stops the stack; another's is told, and what waits
    on it is skipped."""
    u.final = True
    if u.spec.essential:
        fail(st, cause, u)
        return
    st.say(f"{u.name}: {why}; not essential: the stack goes on without it")
    if u.tree is not None and u.job is None:
        launch(st, u, _clean_job, delay=0.0)  # what it left is stopped; no restart follows
    launch_starts(st)
    maybe_up(st)


def _clean_job(st: StackState, u: Unit, delay: float) -> None:
    """Worker: stop what the ended unit left behind, before it starts again."""
    report = None
    try:
        if u.tree is not None:
            u.tree.owned = owned_pids()
            report = stop_tree(u.tree, sig=u.spec.stop.signal, grace=u.spec.stop.grace)
        reap(u.child)
    finally:
        st.post(Cleaned(u, report, delay))


def _on_cleaned(st: StackState, u: Unit, report: StopReport | None, delay: float) -> None:
    """The tree of an ended unit is stopped: its restart is due after the backoff."""
    job, u.job = u.job, None
    if job is not None:
        job.join()
    if report is not None and report.stopped:
        st.say(f"{u.name}: stopped what it left: {report.summary()}")
    if report is not None and report.survivors:
        fail(
            st,
            Cause("unit", f"unit {u.name}: processes it left survived the stop", SURVIVORS),
            u,
        )
        return
    if st.cause is None and not u.final:
        u.restart_at = time.monotonic() + delay
