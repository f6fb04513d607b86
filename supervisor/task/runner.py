"""One call's process, from its start to its result.

A call starts cold (:func:`run_cold`: spawned into its own leaf, or without
one) or in the parked stub (:func:`run_parked`, see :mod:`hold_supervisor.task.parked`).
Either way the call's thread then feeds the task's stdin, reads its stdout
and stderr, and waits for the first way out -- the task ends, the timeout,
a cancel -- and stops the whole tree (the unit's stop signal and grace, the
kill, the survivor check) before it makes the :class:`CallResult`.
"""

from __future__ import annotations

import dataclasses
import os
import select
import time
from typing import TYPE_CHECKING

from hold_supervisor.exitcodes import USAGE
from hold_supervisor.proc import scan
from hold_supervisor.proc.cache import ProcCache
from hold_supervisor.proc.cgroup import Leaf
from hold_supervisor.proc.stop import stop_tree
from hold_supervisor.proc.tree import Tree
from hold_supervisor.spawn.child import Child, SpawnError, owned_pids, read_cpus_allowed, spawn
from hold_supervisor.spawn.scratch import Scratch, ScratchError, default_root, sweep
from hold_supervisor.states import CallState, advance_call
from hold_supervisor.task.calls import CALL_MARKER, Call, CallResult, CallTree, Launch, exit_code
from hold_supervisor.task.parked import Parked
from hold_supervisor.task.pipes import Pipes, Sink, drain, write_some

if TYPE_CHECKING:
    from hold_supervisor.stackfile.spec import ScratchSpec

STDOUT_LIMIT = 1 << 20  # bytes of stdout kept per call
STDERR_TAIL = 64 << 10  # bytes of stderr kept per call (the last ones)
_DRAIN_AFTER_STOP = 1.0  # seconds to read what is left in the pipes once the tree is gone
# What every call's stop knows of the processes older than it, across calls
# and runners: a look reads only the rest (hold_supervisor.proc.cache says why that
# proves as much): on a machine with a thousand processes, ~1 ms, not ~10.
_PROCS = ProcCache()


def run_in_scratch(
    launch: Launch, call: Call, leaf: Leaf | None, queued: float, spec: ScratchSpec
) -> CallResult:
    """:func:`run_cold` with a fresh scratch directory for this call (``HOLD_SCRATCH``),
    removed once the call's tree is stopped (unless kept). A parked stub is never
    used for such a task: its environment is fixed before the call is known."""
    try:
        root = default_root()
        sweep(root)  # what killed runs left
        scratch = Scratch(root, keep=spec.keep, min_free=spec.min_free)
    except (ScratchError, OSError) as e:
        return call.failed(USAGE, f"scratch: {e}", queued)
    with scratch:
        env = {**launch.env, "HOLD_SCRATCH": scratch.path}
        result = run_cold(dataclasses.replace(launch, env=env), call, leaf, queued)
    note = f"scratch kept: {scratch.path}" if spec.keep else ""
    if scratch.report is not None and not scratch.report.clean:
        note = scratch.report.describe()
    if note:
        result = dataclasses.replace(
            result, detail="; ".join(x for x in (result.detail, note) if x)
        )
    return result


def run_cold(launch: Launch, call: Call, leaf: Leaf | None, queued: float) -> CallResult:
    """Spawn the task for ``call`` (into ``leaf``, if any), then run it to its result."""
    pipes = Pipes()
    try:
        in_r, in_w = pipes.make()
        out_r, out_w = pipes.make()
        err_r, err_w = pipes.make()
        # The arguments go in before the task starts, so it never waits on
        # us; what the pipe cannot take now is written as the task reads.
        os.set_blocking(in_w, False)
        pending = memoryview(call.stdin_data)[write_some(in_w, call.stdin_data) :]
        if not pending:
            pipes.close(in_w)
        env = {**launch.env, CALL_MARKER: call.id}
        t0 = time.monotonic()
        try:
            child = spawn(
                launch.argv,
                env=env,
                cpus=launch.cpus,
                stdin=in_r,
                stdout=out_w,
                stderr=err_w,
                cgroup=leaf,
                cwd=launch.cwd,
            )
        except SpawnError as e:
            return call.failed(e.exit_code, str(e), queued)
        finally:
            for fd in (in_r, out_w, err_w):
                pipes.close(fd)
        running = _Running(launch, call, child, leaf, t0, pipes)
        return running.result(queued, pending, (in_w if pending else -1, out_r, err_r))
    finally:
        pipes.close_all()


def run_parked(launch: Launch, call: Call, parked: Parked, queued: float) -> CallResult:
    """Run ``call`` in the parked stub: its id and arguments on its stdin.
    The caller closes the stub's pipes and drops its leaf afterwards."""
    data = call.id.encode() + b"\n" + call.stdin_data
    os.set_blocking(parked.in_w, False)
    t0 = time.monotonic()
    try:
        pending = memoryview(data)[write_some(parked.in_w, data) :]
    except OSError:  # EPIPE: it died just now; its status will say how
        pending = memoryview(b"")
    if not pending:
        parked.pipes.close(parked.in_w)
    running = _Running(launch, call, parked.child, parked.leaf, t0, parked.pipes)
    fds = (parked.in_w if pending else -1, parked.out_r, parked.err_r)
    return running.result(queued, pending, fds)


class _Running:
    """A started call: its child, tree, pipes and output, until its result."""

    def __init__(
        self, launch: Launch, call: Call, child: Child, leaf: Leaf | None, t0: float, pipes: Pipes
    ) -> None:
        self.launch = launch
        self.call = call
        self.child = child
        self.t0 = t0
        self.pipes = pipes
        call.pid = child.pid
        call.started_at = t0
        advance_call(call, CallState.RUNNING)
        try:
            self.cpus = read_cpus_allowed(child.pid)  # a zombie still has it
        except (OSError, RuntimeError):
            self.cpus = launch.cpus
        # Its own session (spawn's default): what the cache needs.
        self.tree = CallTree(call.id, child.ident, child.pid, child.pid, leaf=leaf, cache=_PROCS)
        self.out = Sink(STDOUT_LIMIT, keep_tail=False)
        self.err = Sink(STDERR_TAIL, keep_tail=True)
        self.readers: dict[int, Sink] = {}  # pipes not yet at their end
        self.in_w = -1  # our end of the task's stdin while arguments are left to write
        self.pending = memoryview(b"")

    def result(self, queued: float, pending: memoryview, fds: tuple[int, int, int]) -> CallResult:
        """Wait for the first way out, stop the tree; the result. ``fds``: our ends
        of the task's stdin (-1 once all is written), stdout, stderr."""
        self.in_w, out_r, err_r = fds
        self.pending = pending
        self.readers = {out_r: self.out, err_r: self.err}
        outcome = self._wait()
        if self.in_w >= 0:
            self.pipes.close(self.in_w)  # a task still reading its arguments gets EOF
        return self._stop(outcome, queued)

    def _wait(self) -> str:
        """Feed stdin and read stdout/stderr until the task ends (``exited``),
        the ``timeout``, or a cancel (``cancelled``)."""
        for fd in self.readers:
            os.set_blocking(fd, False)
        poller = select.poll()
        poller.register(self.child.pidfd, select.POLLIN)
        poller.register(self.call.wake_fd, select.POLLIN)
        for fd in self.readers:
            poller.register(fd, select.POLLIN)
        if self.in_w >= 0:
            poller.register(self.in_w, select.POLLOUT)
        deadline = self.t0 + self.launch.timeout
        outcome = ""
        while not outcome:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            for fd, _ev in poller.poll(left * 1000):
                if self._ready(poller, fd):
                    outcome = "exited"
            if self.call.cancel_requested and not outcome:
                outcome = "cancelled"
        return outcome

    def _ready(self, poller: select.poll, fd: int) -> bool:
        """Serve one ready descriptor; True if it says the task has ended."""
        if fd == self.child.pidfd:
            return self.child.poll() is not None
        if fd in self.readers:
            if not self.readers[fd].read(fd):
                poller.unregister(fd)
                del self.readers[fd]
        elif fd == self.in_w:
            try:
                self.pending = self.pending[write_some(self.in_w, self.pending) :]
            except OSError:  # EPIPE: the task closed its stdin
                self.pending = self.pending[:0]
            if not self.pending:
                poller.unregister(self.in_w)
                self.pipes.close(self.in_w)
                self.in_w = -1
        return False

    def _stop(self, outcome: str, queued: float) -> CallResult:
        """Stop whatever is left -- all of it after a timeout or a cancel, what
        the task left running after a normal end -- then check; the result."""
        advance_call(self.call, CallState.STOPPING)
        tree = self.tree
        tree.owned = owned_pids()
        report = stop_tree(tree, sig=self.launch.stop_signal, grace=self.launch.grace)
        returncode = self.child.collect()
        drain(self.readers, time.monotonic() + _DRAIN_AFTER_STOP)
        reap_orphans_of(tree)  # ours, leaf or not: a subreaper either way (Containment.home)
        wall = time.monotonic() - self.t0
        survivors = tuple(report.survivors)
        code = exit_code(outcome, returncode, bool(survivors))
        detail = {
            "timeout": f"time limit of {self.launch.timeout:g}s reached",
            "cancelled": self.call.cancel_reason,
        }.get(outcome, "")
        out, err, call = self.out, self.err, self.call
        return CallResult(
            call.id,
            self.launch.unit,
            outcome,
            code,
            returncode,
            bytes(out.data),
            out.truncated,
            out.total,
            bytes(err.data),
            err.truncated,
            wall,
            queued,
            self.cpus,
            call.args_sha256,
            self.child.pid,
            detail,
            survivors,
            report,
        )


def reap_orphans_of(tree: Tree) -> None:
    """Reap the zombies of this call that were re-parented to us (a subreaper).

    Only processes seen as the call's members: never ``waitpid(-1)``, and never
    a child of ours that someone else (a ``Popen`` of the embedding program)
    will wait for.
    """
    me = os.getpid()
    owned = owned_pids()
    for ident in list(tree.seen):
        st = scan.stat_of(ident.pid)
        if (
            st is not None
            and st.starttime == ident.starttime
            and st.ppid == me
            and st.is_dead
            and ident.pid not in owned
        ):
            try:
                os.waitpid(ident.pid, os.WNOHANG)
            except ChildProcessError:
                pass
