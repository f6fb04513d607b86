"""Stopping a stack completely, and proving it.

In order: the jobs are aborted; the running calls stopped first (they may use
the services); the services level by level, dependents before what they
depend on, each level's units at once; then the survivor check over every
tree (and, walking /proc, the orphans this process adopted). :func:`finish`
then closes what the run opened, lets go of the stack's name and answers
``hold down`` -- at once: the units are gone and proven gone, and what is left
of this process (its threads, its interpreter's exit) is nothing anyone waits for.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time

from hold_supervisor.cause import Cause
from hold_supervisor.documents import StackRunState
from hold_supervisor.exitcodes import SURVIVORS, TOOL
from hold_supervisor.proc import scan
from hold_supervisor.proc.stop import StopReport, Survivor, stop_tree
from hold_supervisor.proc.tree import Tree
from hold_supervisor.safefile import UnsafePath
from hold_supervisor.spawn.child import owned_pids
from hold_supervisor.stack import readiness
from hold_supervisor.stack.eventtypes import (
    Alive,
    Cleaned,
    OnMain,
    Result,
    Say,
    Skipped,
    Spawned,
    not_an_event,
)
from hold_supervisor.stack.notify import tell_systemd
from hold_supervisor.stack.plan import release, remove_leaves, write_record
from hold_supervisor.stack.state import StackResult, StackState
from hold_supervisor.stack.unitoutput import close_outputs
from hold_supervisor.stack.units import Unit, reap, reap_if_exited
from hold_supervisor.stack.wire import StackEv
from hold_supervisor.states import UnitState, advance

Reports = list[tuple[str, StopReport]]  # (what was stopped, its report)


def stop_all(st: StackState) -> StackResult:
    """Stop everything the stack started; the result, with every report and survivor."""
    cause = st.cause or Cause("internal", "stopped", TOOL)
    st.abort.set()
    tell_systemd("STOPPING=1")
    for u in st.units.values():
        u.stop_watching()
        u.wake()
        if isinstance(u.probe, readiness.ExecProbe):
            u.probe.abort()
    reports = _stop_calls(st)
    # Jobs notice the abort within a probe interval; a stop in progress
    # finishes its grace. Bounded either way.
    limit = time.monotonic() + max((u.spec.stop.grace for u in st.units.values()), default=0) + 10
    for u in st.units.values():
        if u.job is not None:
            u.job.join(timeout=max(0.0, limit - time.monotonic()))
    _handle_results_quietly(st)
    st.display.end_table()
    started = [u for u in st.units.values() if u.tree is not None]
    # A failure was told in full already; other causes are named here.
    why = "" if cause.kind in ("start", "unit") else f" ({cause.detail})"
    if started:
        names = [u.name for lv in levels(st) for u in lv if u in started]
        st.say(f"stopping {', '.join(names)}{why}")
    _stop_levels(st, reports)
    _check_survivors(st, started, reports)
    survivors = [s for _, r in reports for s in r.survivors]
    code = SURVIVORS if survivors else cause.code
    for u in started:
        advance(u, UnitState.STOPPED if u.pid is None else UnitState.SURVIVED)
    _say_stopped(st, started, reports, survivors, why)
    return StackResult(code, cause, reports, survivors)


def levels(st: StackState) -> list[list[Unit]]:
    """Units by dependency depth, deepest first: the order to stop them in."""
    depth: dict[str, int] = {}
    for name in st.order:
        deps = st.units[name].spec.after
        depth[name] = 1 + max((depth[d] for d in deps), default=-1)
    by_depth: dict[int, list[Unit]] = {}
    for name, d in depth.items():
        by_depth.setdefault(d, []).append(st.units[name])
    return [by_depth[d] for d in sorted(by_depth, reverse=True)]


def _stop_calls(st: StackState) -> Reports:
    """Calls first: a running call may use the services (an executor asking
    the model server), and it takes no new ones from here on."""
    runners = [t.runner for t in st.tasks.values() if t.runner is not None]
    calls = sum(len(r.running()) for r in runners)
    for r in runners:
        r.cancel_all("the stack is stopping")
    reports: Reports = []
    if calls:
        st.say(f"stopping {calls} running call(s)")
    for r in runners:
        for res in r.close():
            if res.report is not None:
                reports.append((f"{res.unit} call {res.call_id}", res.report))
    return reports


def _handle_results_quietly(st: StackState) -> None:
    """Take the last results of jobs after the abort, so their children are reaped.
    What is none of the events is told, and the stop goes on."""
    while True:
        try:
            ev = st.events.get_nowait()
        except queue.Empty:
            return
        match ev:
            case Result(u):
                u.job = None
                reap_if_exited(u)
            case Cleaned(u):
                u.job = None
            case Say(text):
                st.say(text)
            case OnMain(fn):
                fn()  # a late `hold down` waits for the end; a restart is refused
            case Spawned() | Skipped() | Alive():
                pass  # the stop decides what happens to the unit now
            case _:
                st.say(f"internal error while stopping: {not_an_event(ev)}")


def _stop_levels(st: StackState, reports: Reports) -> None:
    """Each level's started units at once, a level after the one above it."""
    for level in levels(st):
        todo = [u for u in level if u.tree is not None]
        threads = []
        for u in todo:
            advance(u, UnitState.STOPPING)
            t = threading.Thread(
                target=_stop_unit, args=(st, u, reports), name=f"stop-{u.name}", daemon=True
            )
            threads.append(t)
            t.start()
        for t in threads:
            t.join()


def _stop_unit(st: StackState, u: Unit, reports: Reports) -> None:
    assert u.tree is not None
    u.tree.owned = owned_pids()
    rep = stop_tree(u.tree, sig=u.spec.stop.signal, grace=u.spec.stop.grace)
    reap(u.child)
    reports.append((u.name, rep))
    how = rep.outcome if rep.outcome != "empty" else "nothing left running"
    st.display.line(
        f"{u.name}: {how} ({len(rep.stopped)} process(es), {rep.duration * 1000:.0f} ms)"
    )


def _check_survivors(st: StackState, started: list[Unit], reports: Reports) -> None:
    """The survivor check over all: every unit's tree again (an escapee of one may
    have appeared in another's after it was stopped) and the orphans adopted by
    this process that no tree claimed."""
    for u in started:
        assert u.tree is not None
        u.tree.forget_dead()
        if u.tree.members():
            rep = stop_tree(u.tree, sig=signal.SIGKILL, grace=0)
            reports.append((u.name, rep))
    for task in st.tasks.values():
        # Every call of the unit, by the unit's leaf (each call's lies in
        # it) and marker: a call whose stop was cut short is found here.
        tt = Tree(task.tree_id, None, None, None, leaf=task.leaf, since=st.since_ticks)
        if tt.members():
            reports.append((task.name, stop_tree(tt, sig=signal.SIGKILL, grace=0)))
    # This process is a subreaper with leaves too (Containment.home): a unit's
    # process that left its leaf, its session and its marker comes here once its
    # parent dies, and no unit's tree names it any more.
    if set(scan.children_of_self()) - owned_pids():
        sweep = Tree(
            f"{os.getpid():x}sweep",
            None,
            None,
            None,
            adopts_orphans=True,
            owned=owned_pids(),
            since=st.since_ticks,
        )
        if sweep.members():
            rep = stop_tree(sweep, grace=0.5)
            reports.append(("(adopted orphans)", rep))
            st.say(f"stopped orphans no unit claimed: {rep.summary()}")


def _say_stopped(
    st: StackState, started: list[Unit], reports: Reports, survivors: list[Survivor], why: str
) -> None:
    if survivors:
        lines = [f"  pid {s.pid} ({s.found_by}): {s.command}" for s in survivors]
        st.say(
            f"stack {st.name}: {len(survivors)} process(es) SURVIVED the stop:\n" + "\n".join(lines)
        )
    else:
        n = sum(len(r.stopped) for _, r in reports)
        took = max((r.duration for _, r in reports), default=0.0)
        escaped = [f"{s.pid} ({name})" for name, r in reports for s in r.escaped]
        verdict = (
            f"survivor check unknown: {len(escaped)} process(es) left their unit's cgroup "
            f"leaf ({', '.join(escaped)}), found and stopped; what they started outside it "
            "cannot be proven gone"
            if escaped
            else "survivor check empty"
        )
        st.say(
            f"stack {st.name} stopped{why}: {n} process(es) in {len(started)} unit(s), "
            f"{took * 1000:.0f} ms for the slowest; {verdict}"
        )


def finish(st: StackState, result: StackResult) -> None:
    """After the stop: close the readers, logs and leaves, write the record, let go
    of the stack's name (a new ``hold up`` of it may start now), answer ``hold down``."""
    _close_outputs(st)
    if not result.survivors:
        remove_leaves(st)
    try:
        write_record(st, StackRunState.STOPPED, result.code, result.cause.detail)
    except (OSError, UnsafePath):
        pass
    if st.on_stopped is not None:
        st.on_stopped()  # the caller's last word with the guardian (the lease ended)
    if st.control is not None:
        st.control.stop_listening()  # the socket gone before the name is free
    release(st)
    answer = {
        "ev": StackEv.STOPPED,
        "code": result.code,
        "survivors": [s._asdict() for s in result.survivors],
    }
    for reply in st.down_waiters:
        reply.send(answer, done=True)
    if st.control is not None:
        st.control.close()


def _close_outputs(st: StackState) -> None:
    """The readers stopped and the pipes closed. Our write ends go first: every unit
    process is gone, so each pipe ends at once and its reader leaves without waiting
    out a poll (an escapee that keeps one open is bounded by the reader's drain)."""
    for u in st.units.values():
        for fd in (u.out_w, u.err_w):
            if fd >= 0:
                os.close(fd)
        u.out_w = u.err_w = -1
        u.reader_stop.set()
    for u in st.units.values():
        if u.reader is not None:
            u.reader.join(timeout=2.0)
        close_outputs(u)
        if u.log is not None:
            u.log.close()
        if isinstance(u.probe, readiness.ExecProbe):
            u.probe.close()
