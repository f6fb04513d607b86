"""One call of a task unit (:mod:`hold_supervisor.task.task`): its handle
(:class:`Call`), its result (:class:`CallResult`), the line it waits in for a
slot, and its record. How its process runs is :mod:`hold_supervisor.task.runner`.

What a call gets, and when:

* **Arguments are checked before anything starts** against the unit's
  ``args``: an unknown name, a wrong type, a value out of range or too long,
  a missing required one, or more than
  :data:`~hold_supervisor.task.args.ARGS_LIMIT` bytes of JSON raises
  :class:`~hold_supervisor.task.args.ArgsRefused` (exit 2). Arguments only ever reach the task's
  stdin: they cannot choose its command, its CPUs or its environment.
* **Concurrency**: at most ``concurrency`` calls run at once; the others wait
  in arrival order (FIFO), or are refused with
  :class:`~hold_supervisor.task.args.Busy` (exit 75) when the caller asked not
  to wait. A slot is given back only once the call's whole tree is stopped.
* **Isolation** from the first instruction, as :func:`hold_supervisor.spawn.child.spawn`
  gives it: the unit's CPU lane, descriptors 0-2 only, the unit's minimal
  environment, a session of its own and, where cgroups may be written, a
  leaf of its own *inside the unit's leaf*, so the unit's tree (what a
  guardian registered before the stack started) covers every call.
* **A parked stub** (cgroup mode): the runner keeps one ``/bin/sh`` ready in
  the next call's leaf, isolated the same, that execs the task's command
  when a call comes (a move into a leaf costs 10-20 ms; see
  :mod:`hold_supervisor.task.parked`). Nothing of the task runs before a call.
* **Time**: the timeout counts from the moment the task is started, and is
  enforced by the call's own thread, not by whoever collects the result: a
  caller that asks late gets a call that ended on time. At the timeout the
  whole tree is stopped (the unit's stop signal and grace, then the kill and
  the survivor check); the result's exit code is 124.
* **Cancellation** (:meth:`Call.cancel`, the caller going away, the runner
  closing) stops the tree the same way, at once; exit code 130. A call
  still waiting for a slot is taken out of the line; nothing started.
* **When the task ends**, whatever it left running is stopped too (a task
  owns nothing beyond its own result), then the survivor check runs; a
  survivor makes the exit code 3.
* **The result** (:class:`CallResult`): stdout (at most
  :data:`~hold_supervisor.task.runner.STDOUT_LIMIT` bytes kept, with a flag
  when cut), the last :data:`~hold_supervisor.task.runner.STDERR_TAIL` bytes of
  stderr, the exit code, wall time, the CPU mask the task ran on, the
  digest of its arguments, and the stop report.
* **The record**: one JSON line per call in the unit's log (call id, args
  digest, outcome, exit, wall time, survivors).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hold_supervisor.documents import CallRecord, RunRecord
from hold_supervisor.exitcodes import CANCELLED, EXPIRED, SURVIVORS, signalled
from hold_supervisor.parse import format_cpus
from hold_supervisor.proc.stop import StopReport, Survivor
from hold_supervisor.proc.tree import Tree
from hold_supervisor.states import CallState, advance_call
from hold_supervisor.task.args import args_json
from hold_supervisor.unitlog import stamp

if TYPE_CHECKING:
    from hold_supervisor.task.task import TaskRunner

CALL_MARKER = "HOLD_CALL"  # HOLD_CALL=<call id>, beside HOLD_TREE=<the unit's tree id>


@dataclass(frozen=True)
class Launch:
    """What every call of one task unit runs, and how its tree is stopped
    (fixed when the :class:`~hold_supervisor.task.task.TaskRunner` is made)."""

    unit: str
    argv: tuple[str, ...]
    env: Mapping[str, str]  # the task's whole environment, without CALL_MARKER
    cpus: frozenset[int]
    timeout: float
    stop_signal: int
    grace: float
    cwd: str | None = None  # the unit's working directory (None: the supervisor's)


@dataclass(frozen=True)
class CallResult:
    """What one call gave back.

    ``outcome``: ``exited`` (the task ended by itself), ``timeout``,
    ``cancelled``, or ``failed`` (it could not be started: ``detail`` says
    why). ``exit_code`` is what a command-line caller exits with: the task's
    own status (128+N if a signal N ended it), 124 at the timeout, 130 when
    cancelled, 3 if anything survived the stop, 126/127 if the command could
    not be run. ``returncode``: the task's own status as the kernel gave it
    (negative: the signal), None if it never ran or would not die.
    ``wall``: seconds from the start of the task to the end of its stop;
    ``queued``: seconds it waited for a slot first.
    """

    call_id: str
    unit: str
    outcome: str
    exit_code: int
    returncode: int | None
    stdout: bytes
    stdout_truncated: bool
    stdout_bytes: int  # how many the task wrote in all
    stderr_tail: bytes
    stderr_truncated: bool
    wall: float
    queued: float
    cpus: frozenset[int]
    args_sha256: str
    pid: int | None
    detail: str = ""
    survivors: tuple[Survivor, ...] = ()
    report: StopReport | None = field(default=None, compare=False, repr=False)

    def to_json(self, *, stdout: bool = True) -> dict[str, Any]:
        """A JSON-ready dict (stdout and stderr as text, undecodable bytes replaced)."""
        out: dict[str, Any] = {
            "call": self.call_id,
            "unit": self.unit,
            "outcome": self.outcome,
            "exit": self.exit_code,
            "returncode": self.returncode,
            "stdout_truncated": self.stdout_truncated,
            "stdout_bytes": self.stdout_bytes,
            "stderr_tail": self.stderr_tail.decode("utf-8", "replace"),
            "stderr_truncated": self.stderr_truncated,
            "wall_s": round(self.wall, 6),
            "queued_s": round(self.queued, 6),
            "cpus": format_cpus(self.cpus),
            "args_sha256": self.args_sha256,
            "pid": self.pid,
            "detail": self.detail,
            "survivors": [s._asdict() for s in self.survivors],
        }
        if stdout:
            out["stdout"] = self.stdout.decode("utf-8", "replace")
        return out


def exit_code(outcome: str, returncode: int | None, survived: bool) -> int:
    """A started call's exit code: a survivor first, then the timeout or the
    cancel, then the task's own status (a signal as 128+N)."""
    if survived:
        return SURVIVORS
    if outcome == "timeout":
        return EXPIRED
    if outcome == "cancelled":
        return CANCELLED
    if returncode is None:
        return SURVIVORS  # it would not die
    if returncode < 0:
        return signalled(-returncode)
    return returncode


def call_record(r: CallResult) -> str:
    """The call's line in the unit's log (:class:`hold_supervisor.documents.CallRecord`)."""
    now = time.time()
    return CallRecord(
        round(now, 3),
        stamp(now),
        r.call_id,
        r.unit,
        r.args_sha256,
        r.outcome,
        r.exit_code,
        round(r.wall, 4),
        round(r.queued, 4),
        r.pid,
        format_cpus(r.cpus),
        tuple(f"{s.pid} ({s.found_by}): {s.command}" for s in r.survivors),
        r.detail or None,
    ).text()


def run_record(stack: str, pid: int) -> str:
    """The line a task unit's log gets when a run of the stack begins (no ``call``)."""
    now = time.time()
    return RunRecord(round(now, 3), stamp(now), stack, pid).text()


class Slots:
    """A counting semaphore that serves waiters in arrival order, and lets a
    waiter leave the line (a cancelled call)."""

    def __init__(self, n: int) -> None:
        self.free = n
        self.line: deque[Call] = deque()
        self.cond = threading.Condition()

    def try_take(self) -> bool:
        """A slot now if one is free and nobody is waiting for it (no overtaking)."""
        with self.cond:
            if self.free > 0 and not self.line:
                self.free -= 1
                return True
            return False

    def take(self, call: Call) -> bool:
        """Wait in line for a slot; False if the call was cancelled while waiting."""
        with self.cond:
            self.line.append(call)
            try:
                while not call.cancel_requested and not (self.line[0] is call and self.free > 0):
                    self.cond.wait()
            finally:
                self.line.remove(call)
                # The next in line may be able to go now (or the head left).
                self.cond.notify_all()
            if call.cancel_requested:
                return False
            self.free -= 1
            return True

    def give(self) -> None:
        with self.cond:
            self.free += 1
            self.cond.notify_all()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def waiting(self) -> int:
        with self.cond:
            return len(self.line)


class CallTree(Tree):
    """A call's tree: found by its own marker (``HOLD_CALL=<call id>``), not the
    unit's ``HOLD_TREE``, which every call of the unit carries for the guardian."""

    __slots__ = ()

    @property
    def marker(self) -> bytes:
        return f"{CALL_MARKER}={self.tree_id}".encode()


class Call:
    """A handle on one call: its state, and its result once it has one.

    ``state``: ``queued`` (waiting for a slot), ``running``, ``stopping``,
    ``done``. :meth:`cancel` may be called from any thread, at any time.
    Made by :meth:`TaskRunner.submit <hold_supervisor.task.task.TaskRunner.submit>`:
    ``run`` is what its thread runs, ``slots`` the line it waits in.
    """

    def __init__(
        self,
        runner: TaskRunner,
        args: dict[str, Any],
        slot_taken: bool,
        *,
        run: Callable[[Call], None],
        slots: Slots,
    ) -> None:
        self.runner = runner
        self.id = os.urandom(6).hex()
        self.args = args
        data = args_json(args)
        self.stdin_data = data
        self.args_sha256 = hashlib.sha256(data).hexdigest()
        self.state = CallState.QUEUED
        self.pid: int | None = None
        self.submitted_at = time.monotonic()
        self.started_at: float | None = None
        self.cancel_requested = False
        self.cancel_reason = ""
        self.slot_taken = slot_taken  # a slot was taken for it already (no_wait)
        self._slots = slots
        self._result: CallResult | None = None
        self._done = threading.Event()
        self._callbacks: list[Callable[[Call], None]] = []
        self._lock = threading.Lock()
        # Wakes the call's thread from its poll when it is cancelled.
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self.thread = threading.Thread(
            target=run, args=(self,), name=f"call-{runner.name}-{self.id}", daemon=True
        )

    @property
    def wake_fd(self) -> int:
        """Readable once the call is cancelled: for its thread's poll."""
        return self._wake_r

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> CallResult:
        """The result, waiting for it up to ``timeout`` seconds (None: until the call
        ends, which its own timeout bounds). Raises ``TimeoutError`` if not yet."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"call {self.id} of {self.runner.name} has not ended yet")
        assert self._result is not None
        return self._result

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop the call at once: out of the line if it is waiting; otherwise its
        tree is stopped (stop signal, grace, kill, survivor check). The result
        then says ``cancelled`` (exit 130) unless the call had already ended."""
        with self._lock:
            if self._done.is_set() or self.cancel_requested:
                return
            self.cancel_requested = True
            self.cancel_reason = reason
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass
        self._slots.wake()

    def add_done_callback(self, fn: Callable[[Call], None]) -> None:
        """Call ``fn(call)`` once the result is there (at once if it already is),
        in the call's thread: it must not block."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def __enter__(self) -> Call:
        return self

    def __exit__(self, *exc: object) -> None:
        """Leaving the block without the result cancels the call, and waits for its stop."""
        if not self.done():
            self.cancel("the caller went away")
            self.result()

    def snapshot(self, now: float) -> dict[str, Any]:
        return {
            "call": self.id,
            "unit": self.runner.name,
            "state": self.state,
            "pid": self.pid,
            "running_s": round(now - self.started_at, 3) if self.started_at else None,
            "queued_s": round((self.started_at or now) - self.submitted_at, 3),
            "cpus": format_cpus(self.runner.cpus),
            "args_sha256": self.args_sha256,
        }

    def failed(self, code: int, why: str, queued: float) -> CallResult:
        """The result of a call that never started (``cancelled`` for exit 130)."""
        outcome = "cancelled" if code == CANCELLED else "failed"
        return CallResult(
            self.id,
            self.runner.name,
            outcome,
            code,
            None,
            b"",
            False,
            0,
            b"",
            False,
            0.0,
            queued,
            self.runner.cpus,
            self.args_sha256,
            None,
            why,
        )

    def finish(self, result: CallResult) -> None:
        """Done: the result is there, the callbacks are told (by the call's thread)."""
        with self._lock:
            self._result = result
            advance_call(self, CallState.DONE)
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
            self._wake_r = self._wake_w = -1
        for fn in callbacks:
            try:
                fn(self)
            except Exception:
                pass  # a caller's callback must not take the call's thread down
