"""Starting a service: its job thread spawns it and waits until it is ready.

A job is a worker thread that owns its unit (and reaps its child) until it
posts its :class:`~hold_supervisor.stack.eventtypes.Result` to the main thread:
``ready``, ``failed`` (with an exit status and why) or ``aborted`` (the stack is
stopping). Units start in dependency order: each as soon as every unit it comes
``after`` is ready.
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any

from hold_supervisor.exitcodes import EXPIRED, NOT_READY, SURVIVORS, UNIT_FAILED
from hold_supervisor.proc.stop import stop_tree
from hold_supervisor.proc.tree import Tree
from hold_supervisor.spawn.child import Child, SpawnError, owned_pids, spawn
from hold_supervisor.stack import readiness
from hold_supervisor.stack.eventtypes import Outcome, Result, Say, Skipped, Spawned
from hold_supervisor.stack.notify import NotifyProbe
from hold_supervisor.stack.state import StackState
from hold_supervisor.stack.unitoutput import mark, start_note
from hold_supervisor.stack.units import Unit, drain, peek_exit, status_text
from hold_supervisor.states import UnitState, advance


def launch_starts(st: StackState) -> None:
    """Start every waiting unit whose conditions are all met; skip the ones whose
    conditions never can be (a dependency failed for good): an essential one that
    is skipped stops the stack."""
    changed = True
    while changed and st.cause is None:
        changed = False
        for u in st.units.values():
            # A job already given (its thread has not moved the state yet) is not
            # given again: one start per unit.
            if u.state is not UnitState.WAITING or u.job is not None:
                continue
            verdict, why = _conditions(st, u)
            if verdict == "go":
                launch(st, u, start_job, restart=False)
            elif verdict == "never":
                advance(u, UnitState.SKIPPED)
                u.detail = why
                changed = True  # what waits on it may now be skipped too
                if u.spec.essential:
                    st.post(Skipped(u, why))
                else:
                    st.say(f"{u.name}: not started: {why} (not essential: the stack goes on)")


def _conditions(st: StackState, u: Unit) -> tuple[str, str]:
    """``go``, ``wait`` or ``never`` for ``u``'s ``after`` conditions, and why."""
    verdict = "go"
    for name in u.spec.after:
        dep = st.units[name]
        cond = st.spec.condition(u.name, name)
        if cond == "started":
            met = dep.spawned_once
        elif cond == "completed":
            met = dep.state is UnitState.COMPLETED
        else:
            met = dep.state is UnitState.READY
        if met:
            continue
        if dep.state is UnitState.SKIPPED or dep.final:
            return "never", f"{name} {dep.state} ({cond} was needed)"
        verdict = "wait"
    return verdict, ""


def launch(st: StackState, u: Unit, target: Callable[..., None], **kw: Any) -> None:
    """Give the unit a job: ``target(st, u, **kw)`` in a thread of its own."""
    u.job = threading.Thread(
        target=target, args=(st, u), kwargs=kw, name=f"job-{u.name}", daemon=True
    )
    u.job.start()


def start_job(st: StackState, u: Unit, restart: bool) -> None:
    """Worker: spawn the unit and wait until it is ready (or fails, or is aborted)."""
    try:
        st.post(Result(u, start_and_wait(st, u, restart)))
    except BaseException as e:
        st.post(Result(u, Outcome("failed", UNIT_FAILED, f"internal error: {e!r}")))


# Measured on the 2-core machine (a leaf each, python -S): a clone3 spawn blocks
# its caller ~3.5 ms and the program runs ~7 ms sooner than through the stub; one
# after another, the fourth would wait longer than the stub costs it.
FIRST_SPAWNS = 3


def spawn_first(st: StackState) -> None:
    """Spawn the first units that wait on nothing (:data:`FIRST_SPAWNS`), from the
    main thread, before the run has started any other thread: a spawn from a
    single-threaded process can make the unit born in its cgroup leaf (``clone3``,
    :mod:`hold_supervisor.spawn.intoleaf`: no shell, no RCU grace period), which a job
    thread's spawn never can. Each gets its job at once after (:func:`launch_first`),
    which waits until it is ready; the other units start in their jobs, as ever."""
    first = [
        u
        for u in st.units.values()
        if u.state is UnitState.WAITING and u.job is None and _conditions(st, u)[0] == "go"
    ]
    for u in first[:FIRST_SPAWNS]:
        try:
            u.first = _spawn(st, u)
        except Exception as e:  # as a job reports it (start_job)
            u.first = Outcome("failed", UNIT_FAILED, f"internal error: {e!r}")


def launch_first(st: StackState) -> None:
    """The job of each unit :func:`spawn_first` spawned (or failed to), then those of
    the other units that wait on nothing."""
    for u in st.units.values():
        if u.first is not None and u.job is None:
            launch(st, u, start_job, restart=False)
    launch_starts(st)


def start_and_wait(st: StackState, u: Unit, restart: bool) -> Outcome:
    """In a job: spawn the unit (unless :func:`spawn_first` did), tell the guardian
    its root, wait until it is ready."""
    spawned, u.first = u.first, None
    if spawned is None:
        if st.abort.is_set():
            return Outcome("aborted", 0, "")
        spawned = _spawn(st, u)
    if isinstance(spawned, Outcome):
        return spawned
    assert u.tree is not None
    if u.spec.kind == "oneshot":
        return _wait_done(st, u, spawned, u.tree)
    return _wait_ready(st, u, spawned, u.tree)


def _spawn(st: StackState, u: Unit) -> Child | Outcome:
    """Spawn the unit, its tree noted and told to the guardian; the child, or why not."""
    if isinstance(u.probe, (readiness.LogProbe, NotifyProbe)):
        u.probe.reset()
    drain(u.wake_r)
    was, previous = str(u.state), u.returncode
    advance(u, UnitState.STARTING)
    u.detail = ""
    u.returncode = None
    u.ready_at = None
    devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        u.spawned_at = time.monotonic()
        child = spawn(
            u.argv,
            env=u.env,
            cpus=u.spec.cpus,
            stdin=devnull,
            stdout=u.out_w,
            stderr=u.err_w,
            cgroup=u.leaf,
            cwd=_entered(u.cwd, u.env),
        )
    except SpawnError as e:
        return Outcome("failed", UNIT_FAILED, str(e))
    finally:
        os.close(devnull)
    u.child = child
    mark(u, start_note(u, was, previous))
    u.tree = Tree(u.tree_id, child.ident, child.pid, child.pid, leaf=u.leaf, owned=owned_pids())
    st.post(Spawned(u))
    if st.on_started is not None:
        try:
            st.on_started(u.name, u.tree)
        except Exception as e:
            st.post(Say(f"{u.name}: could not tell the guardian: {e}"))
    return child


def _entered(cwd: str | None, env: dict[str, str]) -> str | None:
    """The unit's working directory for :func:`spawn`; None where it is already ours
    (the same directory, by device and inode: the stack file's, run from there), so
    the spawn needs no shell stub to enter it. Not where the unit is given ``PWD``:
    the stub's shell would set it to the directory it entered."""
    if cwd is None or "PWD" in env:
        return cwd
    try:
        here, there = os.stat("."), os.stat(cwd)
    except OSError:
        return cwd  # the spawn says why
    return None if (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino) else cwd


def _wait_done(st: StackState, u: Unit, child: Child, tree: Tree) -> Outcome:
    """A oneshot: wait until it exits (within ``timeout``, if it has one); then what
    it left is stopped. ``completed`` on status 0, else ``failed``."""
    limit = u.spec.timeout
    deadline = None if limit is None else u.spawned_at + limit
    poller = select.poll()
    poller.register(child.pidfd, select.POLLIN)
    poller.register(u.wake_r, select.POLLIN)
    while peek_exit(child) is None:
        if st.abort.is_set():
            return Outcome("aborted", 0, "")
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            break
        poller.poll(None if left is None else left * 1000)
        drain(u.wake_r)
    code = peek_exit(child)
    took = time.monotonic() - u.spawned_at
    tree.owned = owned_pids()
    report = stop_tree(tree, sig=u.spec.stop.signal, grace=u.spec.stop.grace)
    if report.survivors:
        return Outcome(
            "failed", SURVIVORS, f"processes it left survived their stop: {report.summary()}"
        )
    left_note = f"; stopped what it left: {report.summary()}" if report.stopped else ""
    if code is None:
        return Outcome("failed", EXPIRED, f"did not complete within {limit:g}s; stopped{left_note}")
    if code != 0:
        return Outcome("failed", UNIT_FAILED, f"exited with {status_text(code)} after {took:.2f}s")
    return Outcome("completed", 0, f"exited with status 0 after {took:.2f}s{left_note}")


def _wait_ready(st: StackState, u: Unit, child: Child, tree: Tree) -> Outcome:
    """Ask the probe until yes, a fatal no, its timeout, or an exit.

    On a schedule that backs off (20 ms, growing to 250 ms); new output asks
    again at once only a probe that reads output (the log probe). A server that
    logs every request must not be probed for every line it prints (1,600 HTTP
    probes a second, issue 24).
    """
    ready = u.spec.ready
    probe = u.probe
    if ready is None or probe is None:
        return Outcome("ready", 0, "started (no readiness probe)")
    deadline = u.spawned_at + ready.timeout
    poller = select.poll()
    poller.register(child.pidfd, select.POLLIN)
    poller.register(u.wake_r, select.POLLIN)  # drained whatever the probe: its writer never waits
    interval = 0.02
    due = time.monotonic()  # the next scheduled ask
    said = False  # output came since the last ask
    answer: readiness.Answer | None = None
    while True:
        if st.abort.is_set():
            return Outcome("aborted", 0, "")
        code = peek_exit(child)
        if code is not None:
            return Outcome(
                "failed",
                UNIT_FAILED,
                f"exited with {status_text(code)} before it was ready "
                f"(after {time.monotonic() - u.spawned_at:.2f}s)",
            )
        now = time.monotonic()
        if now >= due or (said and probe.on_output):
            answer = probe.check(tree, deadline - now)
            u.detail = answer.detail
            if answer.ok:
                return Outcome("ready", 0, answer.detail)
            if answer.fatal:
                return Outcome("failed", NOT_READY, f"probe {ready.describe()}: {answer.detail}")
            due = time.monotonic() + interval
            interval = min(interval * 1.5, 0.25)
        left = deadline - time.monotonic()
        if left <= 0:
            last = answer.detail if answer is not None else "none yet"
            return Outcome(
                "failed",
                EXPIRED,
                f"not ready within {ready.timeout:g}s "
                f"(probe {ready.describe()}, last answer: {last})",
            )
        poller.poll(max(0.0, min(due - time.monotonic(), left)) * 1000)
        said = bool(drain(u.wake_r))
