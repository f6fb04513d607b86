"""The run of a prepared stack: its scope, and the main thread's event loop.

:func:`run_prepared` is one scope: it takes the stop signals over, opens the
output pipes, spawns the units that wait on nothing while it has no other thread
(:func:`~hold_supervisor.stack.start.spawn_first`), starts the output readers, the task
runners and the control socket, runs :func:`_loop`
until there is a cause to stop, and always ends with the stop
(:func:`~hold_supervisor.stack.stop.stop_all`), whatever went wrong.

The loop is one ``poll`` over the signal wakeup descriptor, the workers' event
pipe, the pidfds of ready units and the caller's descriptors (the ticket
daemon), with the next timer (a restart's backoff, ``--for``) as its timeout.
"""

from __future__ import annotations

import functools
import os
import select
import signal
import time

from hold_supervisor.cause import Cause
from hold_supervisor.documents import StackRunState
from hold_supervisor.exitcodes import OK, TOOL
from hold_supervisor.parse import format_cpus
from hold_supervisor.safefile import UnsafePath
from hold_supervisor.sigwake import signals_to_pipe
from hold_supervisor.spawn.child import owned_pids
from hold_supervisor.stack.control import on_request
from hold_supervisor.stack.controlsock import ControlServer
from hold_supervisor.stack.events import handle_events, maybe_up, on_exit
from hold_supervisor.stack.plan import open_pipes, open_tasks, start_readers, write_record
from hold_supervisor.stack.start import launch, launch_first, launch_starts, spawn_first, start_job
from hold_supervisor.stack.state import StackResult, StackState
from hold_supervisor.stack.stop import finish, stop_all
from hold_supervisor.stack.units import Unit, drain
from hold_supervisor.states import UnitState

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def run_prepared(st: StackState) -> StackResult:
    """Start, supervise until a cause to stop, stop everything; the result."""
    st.ev_r, st.ev_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        with signals_to_pipe((*STOP_SIGNALS, signal.SIGCHLD)) as sig_r:
            return _supervise(st, sig_r)
    finally:
        for fd in (st.ev_r, st.ev_w):
            os.close(fd)


def _supervise(st: StackState, sig_r: int) -> StackResult:
    open_pipes(st)
    try:
        _say_starting(st)
        # While this is the process's only thread: the first units are born in their
        # cgroup leaves (clone3), which a job thread's spawn cannot be (issue 13).
        spawn_first(st)
        start_readers(st)
        launch_first(st)
        open_tasks(st)
        st.control = ControlServer(
            os.path.join(st.run_dir, "control.sock"), functools.partial(on_request, st)
        )
        try:
            write_record(st, StackRunState.RUNNING)
        except (OSError, UnsafePath) as e:  # checked at prepare; a link planted since
            st.say(f"warning: the stack's record is not written: {e}")
        _loop(st, sig_r)
    except BaseException as e:  # an internal error still stops everything
        st.cause = Cause("internal", f"internal error: {e!r}", TOOL)
        raise
    finally:
        result = stop_all(st)
        finish(st, result)
    return result


def _loop(st: StackState, sig_r: int) -> None:
    launch_starts(st)
    maybe_up(st)
    tick = 0.1 if st.display.live else None  # the live table's clock while starting
    while st.cause is None:
        poller, watched = _poller(st, sig_r)
        timeout = _next_timer(st)
        if tick is not None and st.phase == "starting":
            timeout = tick if timeout is None else min(timeout, tick)
        for fd, _ in poller.poll(None if timeout is None else max(0.0, timeout) * 1000):
            if fd == sig_r:
                _on_signals(st, sig_r)
            elif fd == st.ev_r:
                drain(fd)
            elif fd in watched:
                on_exit(st, watched[fd])
            elif fd in st.extra:
                cause = st.extra[fd](fd)
                if cause is not None and st.cause is None:
                    st.cause = cause
        handle_events(st)
        _run_timers(st)
        if st.phase == "starting":
            st.draw()


def _say_starting(st: StackState) -> None:
    n = len(st.units) + len(st.tasks)
    st.say(f"starting stack {st.name} ({n} units) from {st.source}")
    for task in st.tasks.values():
        if task.runner is not None:
            r = task.runner
            st.say(
                f"{task.name}: task, runs per call once the stack is up (cpus "
                f"{format_cpus(r.cpus)}, timeout {r.timeout:g}s, concurrency "
                f"{r.concurrency}); hold call {st.name} {task.name}"
            )


def _poller(st: StackState, sig_r: int) -> tuple[select.poll, dict[int, Unit]]:
    """What this turn waits on; ``watched``: the pidfds of ready units without a job."""
    poller = select.poll()
    poller.register(sig_r, select.POLLIN)
    poller.register(st.ev_r, select.POLLIN)
    for fd in st.extra:
        poller.register(fd, select.POLLIN)
    watched: dict[int, Unit] = {}
    for u in st.units.values():
        if (
            u.state is UnitState.READY
            and u.job is None
            and u.child is not None
            and u.child.returncode is None
        ):
            watched[u.child.pidfd] = u
            poller.register(u.child.pidfd, select.POLLIN)
    return poller, watched


def _next_timer(st: StackState) -> float | None:
    now = time.monotonic()
    times = [u.restart_at - now for u in st.units.values() if u.restart_at is not None]
    if st.run_for is not None and st.up_at is not None:
        times.append(st.up_at + st.run_for - now)
    return min(times) if times else None


def _run_timers(st: StackState) -> None:
    """``--for`` ran out; restarts whose backoff is over."""
    now = time.monotonic()
    if (
        st.cause is None
        and st.run_for is not None
        and st.up_at is not None
        and now >= st.up_at + st.run_for
    ):
        st.cause = Cause("time", f"ran for {st.run_for:g}s as asked", OK)
        return
    for u in st.units.values():
        if st.cause is None and u.restart_at is not None and now >= u.restart_at:
            u.restart_at = None
            launch(st, u, start_job, restart=True)


def _on_signals(st: StackState, fd: int) -> None:
    for signum in drain(fd):
        if signum == signal.SIGCHLD:
            st.containment.reap_orphans(owned_pids())
        elif signum in STOP_SIGNALS and st.cause is None:
            name = signal.Signals(signum).name
            st.cause = Cause("signal", f"{name} received", OK)
