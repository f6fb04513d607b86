"""Starting a service: its job thread spawns it and waits until it is ready.

A job is a worker thread that owns its unit (and reaps its child) until it
posts its ``result`` to the main thread: ``ready``, ``failed`` (with an exit
status and why) or ``aborted`` (the stack is stopping). Units start in
dependency order: each as soon as every unit it comes ``after`` is ready.
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any

from supervisor import readiness
from supervisor.exitcodes import NOT_READY, UNIT_FAILED
from supervisor.spawn import Child, SpawnError, owned_pids, spawn
from supervisor.stackstate import StackState
from supervisor.states import UnitState, advance
from supervisor.tree import Tree
from supervisor.units import Unit, drain, peek_exit, status_text

Outcome = tuple[str, int, str]  # ("ready" | "failed" | "aborted", exit status, why)


def launch_starts(st: StackState) -> None:
    """Start every waiting unit whose dependencies are all ready."""
    if st.cause is not None:
        return
    for u in st.units.values():
        if u.state is not UnitState.WAITING:
            continue
        if all(st.units[d].state is UnitState.READY for d in u.spec.after):
            launch(st, u, start_job, restart=False)


def launch(st: StackState, u: Unit, target: Callable[..., None], **kw: Any) -> None:
    """Give the unit a job: ``target(st, u, **kw)`` in a thread of its own."""
    u.job = threading.Thread(
        target=target, args=(st, u), kwargs=kw, name=f"job-{u.name}", daemon=True
    )
    u.job.start()


def start_job(st: StackState, u: Unit, restart: bool) -> None:
    """Worker: spawn the unit and wait until it is ready (or fails, or is aborted)."""
    try:
        st.post("result", u, *start_and_wait(st, u, restart))
    except BaseException as e:
        st.post("result", u, "failed", UNIT_FAILED, f"internal error: {e!r}")


def start_and_wait(st: StackState, u: Unit, restart: bool) -> Outcome:
    """In a job: spawn the unit, tell the guardian its root, wait until it is ready."""
    if st.abort.is_set():
        return ("aborted", 0, "")
    if isinstance(u.probe, readiness.LogProbe):
        u.probe.reset()
    drain(u.wake_r)
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
            stderr=u.out_w,
            cgroup=u.leaf,
        )
    except SpawnError as e:
        return ("failed", UNIT_FAILED, str(e))
    finally:
        os.close(devnull)
    u.child = child
    u.tree = Tree(u.tree_id, child.ident, child.pid, child.pid, leaf=u.leaf, owned=owned_pids())
    st.post("spawned", u)
    if st.on_started is not None:
        try:
            st.on_started(u.name, u.tree)
        except Exception as e:
            st.post("say", f"{u.name}: could not tell the guardian: {e}")
    return _wait_ready(st, u, child, u.tree)


def _wait_ready(st: StackState, u: Unit, child: Child, tree: Tree) -> Outcome:
    """Ask the probe (woken by new output) until yes, a fatal no, its timeout, or an exit."""
    ready = u.spec.ready
    probe = u.probe
    if ready is None or probe is None:
        return ("ready", 0, "started (no readiness probe)")
    deadline = u.spawned_at + ready.timeout
    poller = select.poll()
    poller.register(child.pidfd, select.POLLIN)
    poller.register(u.wake_r, select.POLLIN)
    interval = 0.02
    while True:
        if st.abort.is_set():
            return ("aborted", 0, "")
        code = peek_exit(child)
        if code is not None:
            return (
                "failed",
                UNIT_FAILED,
                f"exited with {status_text(code)} before it was ready "
                f"(after {time.monotonic() - u.spawned_at:.2f}s)",
            )
        left = deadline - time.monotonic()
        answer = probe.check(tree, left)
        u.detail = answer.detail
        if answer.ok:
            return ("ready", 0, answer.detail)
        if answer.fatal:
            return ("failed", NOT_READY, answer.detail)
        left = deadline - time.monotonic()
        if left <= 0:
            return (
                "failed",
                NOT_READY,
                f"not ready within {ready.timeout:g}s ({ready.describe()}: {answer.detail})",
            )
        poller.poll(min(interval, left) * 1000)
        drain(u.wake_r)
        interval = min(interval * 1.5, 0.25)
