"""On-demand task units: one isolated, bounded run per call.

A task unit (``kind: task`` in a stack file) is not a service: nothing runs
until a call comes, and each call starts the unit's command once, gives it
the call's arguments as JSON on its stdin, and collects its result. The
executor of a tool-calling stack is the example: it must never compete with
model decoding for CPUs, must see nothing of the server's descriptors or
environment, and must end -- with everything it started -- when its time is
up or nobody wants its answer any more.

:class:`TaskRunner` does this for one task unit; a stack (``hold up``) has one
per task unit and serves ``hold call`` with it, and a server that embeds the
supervisor can use one directly, without any daemon::

    with TaskRunner.from_file("stack.yaml", "executor") as runner:
        result = runner.call({"iterations": 10})      # a CallResult
        call = runner.submit({"iterations": 10})      # or a handle:
        call.cancel()                                 #   stopped at once

What a call gets, and when:

* **Arguments are checked before anything starts** against the unit's
  ``args``: an unknown name, a wrong type, a value out of range or too long,
  a missing required one, or more than :data:`ARGS_LIMIT` bytes of JSON
  raises :class:`ArgsRefused` (exit 2). Arguments only ever reach the task's
  stdin: they cannot choose its command, its CPUs or its environment.
* **Concurrency**: at most ``concurrency`` calls run at once; the others wait
  in arrival order (FIFO), or are refused with :class:`Busy` (exit 75) when
  the caller asked not to wait. A slot is given back only once the call's
  whole tree is stopped.
* **Isolation** from the first instruction, as :func:`supervisor.spawn.spawn`
  gives it: the unit's CPU lane, descriptors 0-2 only, the unit's minimal
  environment, a session of its own and, where cgroups may be written, a
  leaf of its own *inside the unit's leaf*, so the unit's tree (what a
  guardian registered before the stack started) covers every call.
* **A parked stub** (cgroup mode): moving a new process into its leaf (a
  write to ``cgroup.procs``) waits for an RCU grace period in the kernel,
  10-20 ms unless another move happened just before -- longer than the rest
  of a call. So the runner keeps one stub ready: ``/bin/sh`` spawned with the
  task's isolation into the next call's leaf, waiting on its stdin for a go
  line. A call writes its id and its arguments, and the stub execs the
  task's command at once. Nothing of the task runs before a call; the stub
  is replaced after each call, off the caller's path, and stopped with the
  runner.
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
* **The result** (:class:`CallResult`): stdout (at most :data:`STDOUT_LIMIT`
  bytes kept, with a flag when cut), the last :data:`STDERR_TAIL` bytes of
  stderr, the exit code, wall time, the CPU mask the task ran on, the
  digest of its arguments, and the stop report.
* **The record**: one JSON line per call in the unit's log (call id, args
  digest, outcome, exit, wall time, survivors).

Threads: each call has one thread that owns everything of it (its child, its
pipes, its leaf); :meth:`TaskRunner.close` cancels every call and joins every
thread, so no call outlives the runner.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from supervisor import procscan
from supervisor.cgroup import CgroupUnavailable, Hierarchy, Leaf, hierarchy_for
from supervisor.environ import minimal_env
from supervisor.exitcodes import CANCELLED, EXPIRED, SURVIVORS, TOOL, signalled
from supervisor.parse import format_cpus
from supervisor.spawn import Child, SpawnError, owned_pids, read_cpus_allowed, spawn
from supervisor.stackfile import ArgSpec, UnitSpec
from supervisor.states import CallState, UnitState, advance_call
from supervisor.stop import StopReport, Survivor, stop_tree
from supervisor.taskargs import (
    ARGS_LIMIT,
    ArgsRefused,
    Busy,
    CallRefused,
    Closed,
    args_json,
    check_args,
    parse_text_arg,
)
from supervisor.tree import Tree
from supervisor.unitlog import RotatingLog

DEFAULT_TIMEOUT = 60.0  # a task unit without `timeout`
STDOUT_LIMIT = 1 << 20  # bytes of stdout kept per call
STDERR_TAIL = 64 << 10  # bytes of stderr kept per call (the last ones)

CALL_MARKER = "HOLD_CALL"  # HOLD_CALL=<call id>, beside HOLD_TREE=<the unit's tree id>
# The parked stub: into its leaf, then wait for the go line (the call's id; sh's
# `read` takes no byte past the newline, so the arguments stay for the task),
# then become the task. An empty go line (or end of file) is "not needed".
_PARKED_STUB = (
    'echo $$ > "$0" || exit 125; IFS= read -r HOLD_CALL && [ -n "$HOLD_CALL" ] || exit 0; '
    'export HOLD_CALL; {unset_pwd}exec "$@"'
)
_DRAIN_AFTER_STOP = 1.0  # seconds to read what is left in the pipes once the tree is gone
_JOIN_MARGIN = 10.0  # beyond a stop's grace, for a call thread to finish


# ---------------------------------------------------------------------- results


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


# ---------------------------------------------------------------------- slots


class _Slots:
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


# ---------------------------------------------------------------------- one call


class _CallTree(Tree):
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
    """

    def __init__(self, runner: TaskRunner, args: dict[str, Any], slot_taken: bool) -> None:
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
        self._slot_taken = slot_taken
        self._result: CallResult | None = None
        self._done = threading.Event()
        self._callbacks: list[Callable[[Call], None]] = []
        self._lock = threading.Lock()
        # Wakes the call's thread from its poll when it is cancelled.
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self.thread = threading.Thread(
            target=runner._run_call, args=(self,), name=f"call-{runner.name}-{self.id}", daemon=True
        )

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
        self.runner._slots.wake()

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

    def _finish(self, result: CallResult) -> None:
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


# ---------------------------------------------------------------------- the runner


class TaskRunner:
    """Runs the calls of one task unit; see the module docstring.

    ``spec``: the unit (``kind: task``; its ``cpus`` are required). ``argv``:
    its command with placeholders filled (default: ``spec.cmd`` as written).
    ``env``: the task's whole environment (built by :func:`minimal_env`,
    carrying the unit's ``HOLD_TREE`` marker); each call adds
    ``HOLD_CALL=<id>``. ``leaf``: the unit's cgroup leaf, inside which each
    call gets its own; None to find calls by walking /proc (the caller is
    then expected to be a child subreaper). ``log``: where each call's record
    goes (one JSON line). ``on_end``: told each result (in the call's thread).
    """

    def __init__(
        self,
        name: str,
        spec: UnitSpec,
        *,
        env: Mapping[str, str],
        argv: Sequence[str] | None = None,
        leaf: Leaf | None = None,
        log: RotatingLog | None = None,
        on_end: Callable[[CallResult], None] | None = None,
    ) -> None:
        if spec.kind != "task":
            raise ValueError(f"unit {name} is a {spec.kind}, not a task")
        if not spec.cpus:
            raise ValueError(f"task unit {name} has no CPU lane (cpus is required)")
        self.name = name
        self.spec = spec
        self.argv = tuple(argv if argv is not None else spec.cmd)
        self.env = dict(env)
        self.cpus: frozenset[int] = spec.cpus
        self.timeout = spec.timeout or DEFAULT_TIMEOUT
        self.concurrency = spec.concurrency or 1
        self.arg_specs: dict[str, ArgSpec] = dict(spec.args or {})
        self.leaf = leaf
        self.calls_base = Hierarchy(leaf.path) if leaf is not None else None
        self.log = log
        self.on_end = on_end
        self._slots = _Slots(self.concurrency)
        self._calls: dict[str, Call] = {}
        self._lock = threading.Lock()
        self._log_lock = threading.Lock()
        self._closed = False
        self._owned_leaf: tuple[Leaf, Hierarchy] | None = None
        self.finished = 0
        self._parked: _Parked | None = None
        self._parking = False
        self._refill()

    # ------------------------------------------------------------------ embedding

    @classmethod
    def standalone(
        cls,
        name: str,
        spec: UnitSpec,
        *,
        argv: Sequence[str] | None = None,
        environ: Mapping[str, str] | None = None,
        extra_env: Mapping[str, str] | None = None,
        cgroups: str = "auto",
        log_path: str | None = None,
        on_end: Callable[[CallResult], None] | None = None,
    ) -> TaskRunner:
        """A runner of its own, for a program that embeds the supervisor (no daemon).

        Builds the task's environment from ``environ`` (default: ours) as a
        stack would: the allowlist, ``pass_env``, the unit's ``env`` (as
        written: no placeholders are filled here) and ``extra_env``.
        ``cgroups``: ``auto`` (a leaf for the unit if this process may
        create one, else walk /proc), ``required`` or ``off``. Without a
        leaf this process becomes a child subreaper, so a task's orphans stay
        findable. Close it (or use it as a context manager): every call is
        stopped, and the unit's leaf removed.
        """
        if cgroups not in ("auto", "required", "off"):
            raise ValueError(f"cgroups {cgroups!r} is not valid: auto, required or off")
        tree_id = os.urandom(6).hex()
        env = minimal_env(
            os.environ if environ is None else environ,
            tree_id=tree_id,
            pass_names=spec.pass_env,
            extra={**spec.env, **(extra_env or {}), "HOLD_UNIT": name},
        )
        hierarchy = hierarchy_for(cgroups)
        # The log before the leaf: a link planted there is refused (UnsafePath)
        # before anything is made.
        log = RotatingLog(log_path) if log_path is not None else None
        leaf = None
        if hierarchy is not None:
            try:
                leaf = hierarchy.create(f"hold-{tree_id}")
            except CgroupUnavailable:
                if cgroups == "required":
                    if log is not None:
                        log.close()
                    raise
                hierarchy = None
        if leaf is None:
            from supervisor.reaper import become_subreaper

            become_subreaper()
        runner = cls(name, spec, env=env, argv=argv, leaf=leaf, log=log, on_end=on_end)
        if leaf is not None and hierarchy is not None:
            runner._owned_leaf = (leaf, hierarchy)
        return runner

    @classmethod
    def from_file(
        cls,
        path: str,
        unit: str,
        *,
        ports: Mapping[str, int] | None = None,
        run_dir: str | None = None,
        **kw: Any,
    ) -> TaskRunner:
        """:meth:`standalone` for task ``unit`` of the stack file at ``path``.

        Placeholders in its command and environment are filled from ``ports``
        (``{units.NAME.port}``) and ``run_dir`` (default: the current
        directory). Raises :class:`~supervisor.stackfile.StackFileError` for
        a bad file, ``ValueError`` for a unit that is not a task or a
        placeholder with nothing to fill it.
        """
        from supervisor.stackfile import fill
        from supervisor.stackfile import load as load_stack

        spec = load_stack(path)
        u = spec.units.get(unit)
        if u is None or u.kind != "task":
            tasks = [n for n, s in spec.units.items() if s.kind == "task"]
            raise ValueError(
                f"{path}: no task unit {unit!r} (task units: {', '.join(tasks) or 'none'})"
            )
        where = run_dir if run_dir is not None else os.getcwd()
        try:
            argv = [fill(a, unit=unit, ports=ports or {}, run_dir=where) for a in u.cmd]
            env = {
                k: fill(v, unit=unit, ports=ports or {}, run_dir=where) for k, v in u.env.items()
            }
        except KeyError as e:
            raise ValueError(f"{path}: unit {unit}: no port given for {e}") from None
        return cls.standalone(unit, u.model_copy(update={"env": env}), argv=argv, **kw)

    def __enter__(self) -> TaskRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ calls

    def check(self, args: object, text_args: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The arguments as a call would take them; raises :class:`ArgsRefused`."""
        return check_args(self.name, self.arg_specs, args, text_args)

    def submit(
        self,
        args: object,
        *,
        text_args: Mapping[str, str] | None = None,
        no_wait: bool = False,
    ) -> Call:
        """Start a call and return its handle at once.

        Refusals come first, before anything starts: :class:`ArgsRefused`,
        :class:`Busy` (``no_wait`` and every slot taken), :class:`Closed`.
        """
        checked = self.check(args, text_args)
        with self._lock:
            if self._closed:
                raise Closed([f"task {self.name} takes no more calls (its stack is stopping)"])
            taken = False
            if no_wait:
                taken = self._slots.try_take()
                if not taken:
                    raise Busy(
                        [
                            f"task {self.name} is busy: {self.concurrency} call(s) running "
                            f"(concurrency {self.concurrency}), {self._slots.waiting()} waiting"
                        ]
                    )
            call = Call(self, checked, taken)
            self._calls[call.id] = call
        call.thread.start()
        return call

    def call(
        self,
        args: object,
        *,
        text_args: Mapping[str, str] | None = None,
        no_wait: bool = False,
    ) -> CallResult:
        """Run one call to its end; its result. If this thread is interrupted while
        it waits (KeyboardInterrupt...), the call is cancelled and stopped first."""
        with self.submit(args, text_args=text_args, no_wait=no_wait) as call:
            return call.result()

    def running(self) -> list[Call]:
        """Calls not yet done (queued, running or stopping), oldest first."""
        with self._lock:
            return [c for c in self._calls.values() if not c.done()]

    def cancel_all(self, reason: str = "the task runner is closing") -> None:
        """Take no more calls, and cancel every one there is (without waiting)."""
        with self._lock:
            self._closed = True
            calls = list(self._calls.values())
        for c in calls:
            c.cancel(reason)

    def close(self) -> list[CallResult]:
        """Take no more calls, cancel the ones there are, wait for each to be stopped;
        their results. Removes the unit's leaf if this runner made it."""
        self.cancel_all()
        with self._lock:
            calls = list(self._calls.values())
        results: list[CallResult] = []
        limit = time.monotonic() + self.spec.stop.grace + _JOIN_MARGIN
        for c in calls:
            c.thread.join(timeout=max(0.0, limit - time.monotonic()))
            if c.done():
                results.append(c.result())
        with self._lock:  # no call is left to refill it
            parked, self._parked = self._parked, None
        if parked is not None:
            self._discard(parked)
        if self._owned_leaf is not None:
            leaf, hierarchy = self._owned_leaf
            if not any(r.survivors for r in results):
                leaf.remove(hierarchy.base)
            self._owned_leaf = None
        if self.log is not None:
            with self._log_lock:
                self.log.close()
        return results

    # ------------------------------------------------------------------ the call's thread

    def _run_call(self, call: Call) -> None:
        try:
            try:
                result = self._run(call)
            except BaseException as e:  # an internal error still ends the call
                result = self._failed(call, TOOL, f"internal error: {e!r}", 0.0)
            with self._lock:
                self.finished += 1
            self._record(result)
            call._finish(result)
            if self.on_end is not None:
                try:
                    self.on_end(result)
                except Exception:
                    pass  # the caller's hook must not take the call's thread down
            self._refill()  # after the result: off the caller's path
        finally:
            # Last: close() joins the threads of the calls it finds here.
            with self._lock:
                self._calls.pop(call.id, None)

    def _failed(self, call: Call, code: int, why: str, queued: float) -> CallResult:
        outcome = "cancelled" if code == CANCELLED else "failed"
        return CallResult(
            call.id, self.name, outcome, code, None, b"", False, 0, b"", False,
            0.0, queued, self.cpus, call.args_sha256, None, why,
        )  # fmt: skip

    def _run(self, call: Call) -> CallResult:
        if not call._slot_taken and not self._slots.take(call):
            queued = time.monotonic() - call.submitted_at
            return self._failed(call, CANCELLED, call.cancel_reason, queued)
        try:
            return self._run_slot(call)
        finally:
            self._slots.give()

    def _run_slot(self, call: Call) -> CallResult:
        queued = time.monotonic() - call.submitted_at
        if call.cancel_requested:
            return self._failed(call, CANCELLED, call.cancel_reason, queued)
        parked = self._take_parked()
        if parked is not None:
            try:
                return self._go(call, parked, queued)
            finally:
                parked.pipes.close_all()
                self._drop_leaf(parked.leaf)
        leaf = None
        if self.calls_base is not None:
            try:
                leaf = self.calls_base.create(f"hold-{call.id}")
            except CgroupUnavailable as e:
                return self._failed(call, TOOL, f"cgroups: {e}", queued)
        try:
            return self._spawn_and_watch(call, leaf, queued)
        finally:
            self._drop_leaf(leaf)

    def _drop_leaf(self, leaf: Leaf | None) -> None:
        # A leaf with a survivor stays: the unit's tree still finds it there.
        if leaf is not None and self.calls_base is not None and leaf.pids() == []:
            leaf.remove(self.calls_base.base)

    # ------------------------------------------------------------------ the parked stub

    def _refill(self) -> None:
        """Park a stub for the next call, if there is none (cgroup mode only)."""
        if self.calls_base is None:
            return
        with self._lock:
            if self._closed or self._parked is not None or self._parking:
                return
            self._parking = True
        parked = None
        try:
            parked = self._park()
        finally:
            with self._lock:
                self._parking = False
                if parked is not None and not self._closed and self._parked is None:
                    self._parked, parked = parked, None
            if parked is not None:  # closed meanwhile
                self._discard(parked)

    def _park(self) -> _Parked | None:
        assert self.calls_base is not None
        try:
            leaf = self.calls_base.create(f"hold-{os.urandom(6).hex()}")
        except CgroupUnavailable:
            return None  # the cold path will say why
        pipes = _Pipes()
        try:
            in_r, in_w = pipes.make()
            out_r, out_w = pipes.make()
            err_r, err_w = pipes.make()
            stub = _PARKED_STUB.format(unset_pwd="" if "PWD" in self.env else "unset PWD; ")
            try:
                child = spawn(
                    ["/bin/sh", "-c", stub, leaf.procs_file, *self.argv],
                    env=self.env,
                    cpus=self.cpus,
                    stdin=in_r,
                    stdout=out_w,
                    stderr=err_w,
                )
            finally:
                for fd in (in_r, out_w, err_w):
                    pipes.close(fd)
        except (SpawnError, OSError):
            pipes.close_all()
            self._drop_leaf(leaf)
            return None
        return _Parked(child, leaf, pipes, in_w, out_r, err_r)

    def _take_parked(self) -> _Parked | None:
        with self._lock:
            parked, self._parked = self._parked, None
        if parked is not None and parked.child.poll() is not None:
            self._discard(parked)  # it died while parked (someone killed it)
            return None
        return parked

    def _discard(self, parked: _Parked) -> None:
        """Stop a parked stub that no call will use (nothing of the task ran in it)."""
        try:
            os.write(parked.in_w, b"\n")  # "not needed": it exits by itself
        except OSError:
            pass
        tree = Tree(os.path.basename(parked.leaf.path), parked.child.ident,
                    parked.child.pid, parked.child.pid, leaf=parked.leaf)  # fmt: skip
        stop_tree(tree, grace=1.0)
        parked.child.collect()
        parked.pipes.close_all()
        self._drop_leaf(parked.leaf)

    def _go(self, call: Call, parked: _Parked, queued: float) -> CallResult:
        """Run ``call`` in the parked stub: its id and arguments on its stdin."""
        data = call.id.encode() + b"\n" + call.stdin_data
        os.set_blocking(parked.in_w, False)
        t0 = time.monotonic()
        try:
            pending = memoryview(data)[_write_some(parked.in_w, data) :]
        except OSError:  # EPIPE: it died just now; its status will say how
            pending = memoryview(b"")
        if not pending:
            parked.pipes.close(parked.in_w)
        child = parked.child
        call.pid = child.pid
        call.started_at = t0
        advance_call(call, CallState.RUNNING)
        try:
            cpus = read_cpus_allowed(child.pid)
        except (OSError, RuntimeError):
            cpus = self.cpus
        tree = _CallTree(call.id, child.ident, child.pid, child.pid, leaf=parked.leaf)
        fds = (parked.in_w if pending else -1, parked.out_r, parked.err_r)
        return self._watch(call, child, tree, t0, queued, cpus, parked.pipes, pending, fds)

    def _spawn_and_watch(self, call: Call, leaf: Leaf | None, queued: float) -> CallResult:
        pipes = _Pipes()
        try:
            in_r, in_w = pipes.make()
            out_r, out_w = pipes.make()
            err_r, err_w = pipes.make()
            # The arguments go in before the task starts, so it never waits on
            # us; what the pipe cannot take now is written as the task reads.
            os.set_blocking(in_w, False)
            pending = memoryview(call.stdin_data)[_write_some(in_w, call.stdin_data) :]
            if not pending:
                pipes.close(in_w)
            env = {**self.env, CALL_MARKER: call.id}
            t0 = time.monotonic()
            try:
                child = spawn(
                    self.argv,
                    env=env,
                    cpus=self.cpus,
                    stdin=in_r,
                    stdout=out_w,
                    stderr=err_w,
                    cgroup=leaf,
                )
            except SpawnError as e:
                return self._failed(call, e.exit_code, str(e), queued)
            finally:
                for fd in (in_r, out_w, err_w):
                    pipes.close(fd)
            call.pid = child.pid
            call.started_at = t0
            advance_call(call, CallState.RUNNING)
            try:
                cpus = read_cpus_allowed(child.pid)  # a zombie still has it
            except (OSError, RuntimeError):
                cpus = self.cpus
            tree = _CallTree(call.id, child.ident, child.pid, child.pid, leaf=leaf)
            in_fd = in_w if pending else -1
            fds = (in_fd, out_r, err_r)
            return self._watch(call, child, tree, t0, queued, cpus, pipes, pending, fds)
        finally:
            pipes.close_all()

    def _watch(
        self,
        call: Call,
        child: Child,
        tree: Tree,
        t0: float,
        queued: float,
        cpus: frozenset[int],
        pipes: _Pipes,
        pending: memoryview,
        fds: tuple[int, int, int],
    ) -> CallResult:
        """Wait for the first way out (the task ends, the timeout, a cancel) while
        feeding stdin and reading stdout/stderr; then stop the tree; the result.
        ``fds``: our ends of the task's stdin (-1 once all is written), stdout, stderr."""
        in_w, out_r, err_r = fds
        out = _Sink(STDOUT_LIMIT, keep_tail=False)
        err = _Sink(STDERR_TAIL, keep_tail=True)
        readers = {out_r: out, err_r: err}
        for fd in readers:
            os.set_blocking(fd, False)
        poller = select.poll()
        poller.register(child.pidfd, select.POLLIN)
        poller.register(call._wake_r, select.POLLIN)
        for fd in readers:
            poller.register(fd, select.POLLIN)
        if in_w >= 0:
            poller.register(in_w, select.POLLOUT)
        deadline = t0 + self.timeout
        outcome = ""
        while not outcome:
            left = deadline - time.monotonic()
            if left <= 0:
                outcome = "timeout"
                break
            for fd, _ev in poller.poll(left * 1000):
                if fd == child.pidfd:
                    if child.poll() is not None:
                        outcome = "exited"
                elif fd in readers:
                    if not readers[fd].read(fd):
                        poller.unregister(fd)
                        del readers[fd]
                elif fd == in_w:
                    try:
                        pending = pending[_write_some(in_w, pending) :]
                    except OSError:  # EPIPE: the task closed its stdin
                        pending = pending[:0]
                    if not pending:
                        poller.unregister(in_w)
                        pipes.close(in_w)
                        in_w = -1
            if call.cancel_requested and not outcome:
                outcome = "cancelled"
        if in_w >= 0:
            pipes.close(in_w)  # a task still reading its arguments gets EOF
        advance_call(call, CallState.STOPPING)
        # Whatever is left -- all of it after a timeout or a cancel, what the
        # task left running after a normal end -- is stopped, then checked.
        tree.owned = owned_pids()
        report = stop_tree(tree, sig=self.spec.stop.signal, grace=self.spec.stop.grace)
        returncode = child.collect()
        _drain(readers, time.monotonic() + _DRAIN_AFTER_STOP)
        if tree.leaf is None:
            _reap_orphans_of(tree)
        wall = time.monotonic() - t0
        survivors = tuple(report.survivors)
        if survivors:
            code = SURVIVORS
        elif outcome == "timeout":
            code = EXPIRED
        elif outcome == "cancelled":
            code = CANCELLED
        elif returncode is None:
            code = SURVIVORS
        elif returncode < 0:
            code = signalled(-returncode)
        else:
            code = returncode
        detail = {
            "timeout": f"time limit of {self.timeout:g}s reached",
            "cancelled": call.cancel_reason,
        }.get(outcome, "")
        return CallResult(
            call.id, self.name, outcome, code, returncode,
            bytes(out.data), out.truncated, out.total,
            bytes(err.data), err.truncated,
            wall, queued, cpus, call.args_sha256, child.pid, detail, survivors, report,
        )  # fmt: skip

    def _record(self, r: CallResult) -> None:
        if self.log is None:
            return
        rec = {
            "time": round(time.time(), 3),
            "call": r.call_id,
            "unit": r.unit,
            "args_sha256": r.args_sha256,
            "outcome": r.outcome,
            "exit": r.exit_code,
            "wall_s": round(r.wall, 4),
            "queued_s": round(r.queued, 4),
            "pid": r.pid,
            "cpus": format_cpus(r.cpus),
            "survivors": [f"{s.pid} ({s.found_by}): {s.command}" for s in r.survivors],
        }
        if r.detail:
            rec["detail"] = r.detail
        with self._log_lock:
            try:
                self.log.write("call " + json.dumps(rec, sort_keys=True))
            except (OSError, ValueError):
                pass  # a full disk must not turn a result into an error

    def snapshot(self, running: bool) -> dict[str, Any]:
        """The unit as ``hold ps`` shows it (``running``: the stack is up)."""
        calls = self.running()
        active = sum(1 for c in calls if c.state is not CallState.QUEUED)
        return {
            "unit": self.name,
            "kind": "task",
            "state": UnitState.READY if running else UnitState.WAITING,
            "pid": None,
            "port": None,
            "restarts": 0,
            "uptime": None,
            "cpus": format_cpus(self.cpus),
            "ready": f"per call: {active} running, {len(calls) - active} queued "
            f"(concurrency {self.concurrency}, timeout {self.timeout:g}s)",
            "detail": "",
            "last_line": "",
            "calls_done": self.finished,
        }


# ---------------------------------------------------------------------- helpers


class _Sink:
    """Output of one pipe: the first ``limit`` bytes, or the last ones (``keep_tail``)."""

    __slots__ = ("data", "keep_tail", "limit", "total", "truncated")

    def __init__(self, limit: int, *, keep_tail: bool) -> None:
        self.data = bytearray()
        self.limit = limit
        self.keep_tail = keep_tail
        self.total = 0
        self.truncated = False

    def read(self, fd: int) -> bool:
        """Take what the pipe has; False at end of file."""
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not chunk:
            return False
        self.total += len(chunk)
        if self.keep_tail:
            self.data += chunk
            if len(self.data) > self.limit:
                del self.data[: len(self.data) - self.limit]
                self.truncated = True
        else:
            room = self.limit - len(self.data)
            if len(chunk) > room:
                self.truncated = True
            # Past the limit the task's output is read and dropped, so that it
            # never blocks on a full pipe.
            self.data += chunk[: max(0, room)]
        return True


class _Parked:
    """A stub waiting for a call: its child, leaf, and our ends of its pipes."""

    __slots__ = ("child", "err_r", "in_w", "leaf", "out_r", "pipes")

    def __init__(
        self, child: Child, leaf: Leaf, pipes: _Pipes, in_w: int, out_r: int, err_r: int
    ) -> None:
        self.child = child
        self.leaf = leaf
        self.pipes = pipes
        self.in_w = in_w
        self.out_r = out_r
        self.err_r = err_r


class _Pipes:
    """The call's pipe ends, each closed exactly once (early, or at the end)."""

    def __init__(self) -> None:
        self.fds: list[int] = []

    def make(self) -> tuple[int, int]:
        r, w = os.pipe2(os.O_CLOEXEC)
        self.fds += [r, w]
        return r, w

    def close(self, fd: int) -> None:
        if fd in self.fds:
            self.fds.remove(fd)
            os.close(fd)

    def close_all(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def _write_some(fd: int, data: bytes | memoryview) -> int:
    if not data:
        return 0
    try:
        return os.write(fd, data)
    except BlockingIOError:
        return 0


def _drain(readers: dict[int, _Sink], deadline: float) -> None:
    """Read the pipes to their end once the tree is stopped (its writers are gone);
    bounded, since a survivor could keep one open."""
    poller = select.poll()
    for fd in readers:
        poller.register(fd, select.POLLIN)
    left_fds = dict(readers)
    while left_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        for fd, _ev in poller.poll(left * 1000):
            if fd in left_fds and not left_fds[fd].read(fd):
                poller.unregister(fd)
                del left_fds[fd]


def _reap_orphans_of(tree: Tree) -> None:
    """Reap the zombies of this call that were re-parented to us (a subreaper).

    Only processes seen as the call's members: never ``waitpid(-1)``, and never
    a child of ours that someone else (a ``Popen`` of the embedding program)
    will wait for.
    """
    me = os.getpid()
    owned = owned_pids()
    for ident in list(tree.seen):
        st = procscan.stat_of(ident.pid)
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


__all__ = [
    "ARGS_LIMIT",
    "STDERR_TAIL",
    "STDOUT_LIMIT",
    "ArgsRefused",
    "Busy",
    "Call",
    "CallRefused",
    "CallResult",
    "Closed",
    "TaskRunner",
    "check_args",
    "parse_text_arg",
]
