"""On-demand task units: one isolated, bounded run per call.

A task unit (``kind: task`` in a stack file) is not a service: nothing runs
until a call comes, and each call starts the unit's command once, gives it
the call's arguments as JSON on its stdin, and collects its result. The
executor of a tool-calling stack is the example: it must never compete with
model decoding for CPUs, see nothing of the server's descriptors or environment,
and end, with all it started, when its time is up or nobody wants its answer.

:class:`TaskRunner` does this for one task unit; a stack (``hold up``) has one
per task unit and serves ``hold call`` with it, and a server that embeds the
supervisor can use one directly, without any daemon::

    with TaskRunner.from_file("stack.yaml", "executor") as runner:
        result = runner.call({"iterations": 10})      # a CallResult
        call = runner.submit({"iterations": 10})      # or a handle:
        call.cancel()                                 #   stopped at once

What a call gets, and when (arguments checked first, ``concurrency`` at once,
FIFO, a parked stub, timeout, cancel, result, record) is said in
:mod:`hold_supervisor.task.calls`; how its process runs (and its scratch), in
:mod:`hold_supervisor.task.runner`.

Threads: each call has one thread that owns all of it (child, pipes, leaf);
:meth:`TaskRunner.close` cancels and joins them all: no call outlives the runner.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hold_supervisor.environ import minimal_env
from hold_supervisor.exitcodes import CANCELLED, TOOL
from hold_supervisor.parse import format_cpus
from hold_supervisor.proc.cgroup import CgroupUnavailable, Leaf
from hold_supervisor.spawn.containment import Containment, choose, first_home, within
from hold_supervisor.stackfile.spec import ArgSpec, UnitSpec, fill
from hold_supervisor.states import CallState, UnitState
from hold_supervisor.task.args import (
    ARGS_LIMIT,
    ArgsRefused,
    Busy,
    CallRefused,
    Closed,
    check_args,
    parse_text_arg,
)
from hold_supervisor.task.calls import Call, CallResult, Launch, Slots, call_record
from hold_supervisor.task.parked import Parking
from hold_supervisor.task.runner import (
    STDERR_TAIL,
    STDOUT_LIMIT,
    run_cold,
    run_in_scratch,
    run_parked,
)
from hold_supervisor.unitlog import RotatingLog

DEFAULT_TIMEOUT = 60.0  # a task unit without `timeout`
_JOIN_MARGIN = 10.0  # beyond a stop's grace, for a call thread to finish


class TaskRunner:
    """Runs the calls of one task unit; see the module docstring.

    ``spec``: the unit (``kind: task``; its ``cpus`` are required). ``argv``:
    its command with placeholders filled (default: ``spec.cmd`` as written).
    ``env``: the task's whole environment (built by :func:`minimal_env`,
    carrying the unit's ``HOLD_TREE`` marker); each call adds
    ``HOLD_CALL=<id>``. ``leaf``: the unit's cgroup leaf, inside which each
    call gets its own; None to find calls by walking /proc (the calls follow
    the unit's choice: :func:`~hold_supervisor.spawn.containment.within`; either
    way this process becomes a child subreaper, by the first call at the
    latest). ``log``: where each call's record goes (one JSON line).
    ``on_end``: told each result (in the call's thread). ``cwd``: each call's
    working directory.
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
        cwd: str | None = None,
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
        self.calls = within(leaf)  # each call in a leaf inside the unit's (or walked)
        self.log = log
        self.on_end = on_end
        sig, grace = spec.stop.signal, spec.stop.grace
        self._launch = Launch(name, self.argv, self.env, self.cpus, self.timeout, sig, grace, cwd)
        self._slots = Slots(self.concurrency)
        self._calls: dict[str, Call] = {}
        self._lock = threading.Lock()
        self._log_lock = threading.Lock()
        self._closed = False
        self._owned_home: tuple[Containment, Leaf | None] | None = None
        self.finished = 0
        # Not for a task with a scratch per call (its environment is the call's).
        self._stubs = Parking(self._launch, self.calls, on=not spec.scratch)
        self._stubs.refill()

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
        containment = choose(cgroups)
        # The log before the leaf: a link planted there is refused (UnsafePath)
        # before anything is made.
        log = RotatingLog(log_path) if log_path is not None else None
        try:
            containment, leaf = first_home(containment, f"hold-{tree_id}", cgroups)
        except CgroupUnavailable:
            if log is not None:
                log.close()
            raise
        runner = cls(name, spec, env=env, argv=argv, leaf=leaf, log=log, on_end=on_end)
        runner._owned_home = (containment, leaf)
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
        directory). Raises :class:`~hold_supervisor.stackfile.load.StackFileError` for
        a bad file, ``ValueError`` for a unit that is not a task or a
        placeholder with nothing to fill it.
        """
        from hold_supervisor.stackfile.load import (
            load as load_stack,  # YAML: only here
        )

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
        return cls.standalone(unit, dataclasses.replace(u, env=env), argv=argv, **kw)

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
            call = Call(self, checked, taken, run=self._run_call, slots=self._slots)
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
        self._stubs.shut()
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
        self._stubs.close()  # no call is left to refill it
        if self._owned_home is not None:
            containment, leaf = self._owned_home
            if not any(r.survivors for r in results):
                containment.release(leaf)
            self._owned_home = None
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
                result = call.failed(TOOL, f"internal error: {e!r}", 0.0)
            with self._lock:
                self.finished += 1
            self._record(result)
            call.finish(result)
            if self.on_end is not None:
                try:
                    self.on_end(result)
                except Exception:
                    pass  # the caller's hook must not take the call's thread down
            self._stubs.refill()  # after the result: off the caller's path
        finally:
            # Last: close() joins the threads of the calls it finds here.
            with self._lock:
                self._calls.pop(call.id, None)

    def _run(self, call: Call) -> CallResult:
        if not call.slot_taken and not self._slots.take(call):
            queued = time.monotonic() - call.submitted_at
            return call.failed(CANCELLED, call.cancel_reason, queued)
        try:
            return self._run_slot(call)
        finally:
            self._slots.give()

    def _run_slot(self, call: Call) -> CallResult:
        queued = time.monotonic() - call.submitted_at
        if call.cancel_requested:
            return call.failed(CANCELLED, call.cancel_reason, queued)
        parked = self._stubs.take()
        if parked is not None:
            try:
                return run_parked(self._launch, call, parked, queued)
            finally:
                parked.pipes.close_all()
                self.calls.release(parked.leaf, only_if_empty=True)
        try:
            leaf = self.calls.home(f"hold-{call.id}")
        except CgroupUnavailable as e:
            return call.failed(TOOL, f"cgroups: {e}", queued)
        try:
            if self.spec.scratch is not None:
                return run_in_scratch(self._launch, call, leaf, queued, self.spec.scratch)
            return run_cold(self._launch, call, leaf, queued)
        finally:
            self.calls.release(leaf, only_if_empty=True)

    def _record(self, r: CallResult) -> None:
        if self.log is None:
            return
        with self._log_lock:
            try:
                self.log.write(call_record(r))
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
