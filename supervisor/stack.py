"""A running stack: units started in dependency order, supervised, and stopped completely.

The shape, trio-like: :meth:`Stack.run` is one scope. Everything it starts
-- unit processes, reader threads, probe commands, worker threads, the
control socket -- ends before it returns, and the survivor check proves the
processes did.

Threads and who owns what:

* the **main thread** (the caller's) runs the event loop: one ``poll`` over
  the signal wakeup descriptor, an event pipe from the workers, the pidfds of
  running units and the caller's descriptors (the ticket daemon), with the
  next timer as its timeout. It makes every state transition;
* a **worker** per job (start a unit and wait until it is ready; stop what a
  crashed unit left; a manual restart) does the blocking part and reports
  back through the event pipe. While a unit has a job, the job owns its
  :class:`~supervisor.spawn.Child` (reaps it); otherwise the main thread does.
  So each child has exactly one reaper at a time, never ``waitpid(-1)``;
* a **reader** per unit copies the unit's output pipe to its log file (and to
  its log probe), reading with a deadline so it can always be told to stop,
  even when an escapee keeps the pipe open;
* the **control server** answers ``ps`` itself and hands ``down`` and
  ``restart`` to the main thread; a ``call`` is served in its connection's
  thread, by the task unit's :class:`~supervisor.task.TaskRunner` (each call
  has a thread of its own, which owns its child).

Task units (``kind: task``) are not started: each call runs the unit once
(:mod:`supervisor.task`). Like a service, a task unit has one tree id,
marker and cgroup leaf for the stack's life, registered with the guardian
before anything starts; each call's leaf lies inside the unit's, so the
guardian's stop of the unit reaches every call. Calls are taken while the
stack is up, and are stopped first when it stops.

Each unit has one tree id, marker and cgroup leaf for the stack's whole
life, so a restart needs no new registration with a guardian: the caller is
told about every tree before anything starts (``on_tree_prepared``) and about
each new root after each spawn (``on_started``).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import functools
import json
import os
import queue
import select
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

from supervisor import readiness
from supervisor.cause import Cause
from supervisor.cgroup import Hierarchy, Leaf
from supervisor.display import Display
from supervisor.environ import minimal_env
from supervisor.errors import SupervisorError
from supervisor.exitcodes import BUSY, NOT_READY, OK, SURVIVORS, TOOL, UNIT_FAILED, USAGE
from supervisor.identity import read_stat
from supervisor.output import LineReader
from supervisor.parse import format_cpus
from supervisor.safefile import UnsafePath, check_file, ensure_dir, open_for_update, write_atomic
from supervisor.spawn import Child, SpawnError, owned_pids, resolve, spawn
from supervisor.stackctl import ControlServer, Message, Reply
from supervisor.stackfile import StackSpec, UnitSpec, fill, filled_env
from supervisor.states import UnitState, advance
from supervisor.stop import StopReport, Survivor, reap_adopted, stop_tree
from supervisor.task import Call, CallRefused, CallResult, TaskRunner
from supervisor.tree import Tree
from supervisor.unitlog import RotatingLog

TAIL = 20  # output lines kept per unit for messages
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


class StackError(SupervisorError):
    """Refused before anything started; ``code`` is the exit status, ``errors`` every reason."""

    def __init__(self, errors: list[str], code: int = USAGE) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors
        self.code = code
        self.exit_code = code


# Called with the descriptor that became readable; a cause to stop the stack, or None.
Extra = Callable[[int], Cause | None]


class StackResult(NamedTuple):
    code: int
    cause: Cause
    reports: list[tuple[str, StopReport]]
    survivors: list[Survivor]


# ---------------------------------------------------------------------- units


class Unit:
    """One unit at run time. Attributes are written by the main thread, or by the
    unit's job while it has one; readers (ps, the display) take a snapshot."""

    def __init__(self, name: str, spec: UnitSpec) -> None:
        self.name = name
        self.spec = spec
        self.port: int | None = None
        self.tree_id = os.urandom(6).hex()
        self.leaf: Leaf | None = None
        self.argv: tuple[str, ...] = spec.cmd
        self.env: dict[str, str] = {}
        self.probe: readiness.Probe | None = None
        self.state = UnitState.WAITING
        self.child: Child | None = None
        self.tree: Tree | None = None
        self.spawned_at = 0.0
        self.ready_at: float | None = None
        self.restarts = 0  # in a row, for the policy
        self.total_restarts = 0
        self.returncode: int | None = None
        self.detail = ""  # the latest probe answer or reason
        self.tail: deque[str] = deque(maxlen=TAIL)
        self.last_line = ""
        self.restart_at: float | None = None
        self.job: threading.Thread | None = None
        self.log: RotatingLog | None = None
        self.out_r = self.out_w = -1
        self.wake_r = self.wake_w = -1
        self.reader: threading.Thread | None = None
        self.reader_stop = threading.Event()

    @property
    def pid(self) -> int | None:
        c = self.child
        return c.pid if c is not None and c.returncode is None else None

    def wake(self) -> None:
        try:
            os.write(self.wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def snapshot(self, now: float) -> dict[str, Any]:
        since = (
            self.ready_at if self.state is UnitState.READY and self.ready_at else self.spawned_at
        )
        return {
            "unit": self.name,
            "state": self.state,
            "pid": self.pid,
            "port": self.port,
            "restarts": self.total_restarts,
            "uptime": round(now - since, 3) if self.pid is not None and since else None,
            "cpus": format_cpus(self.spec.cpus) if self.spec.cpus else "",
            "ready": self.spec.ready.describe() if self.spec.ready else "at start",
            "detail": self.detail,
            "last_line": self.last_line,
            "tree": self.tree_id,
        }


class TaskUnit:
    """A task unit at run time: its tree (id, leaf), command and environment, and the
    runner that serves its calls once the stack runs."""

    def __init__(self, name: str, spec: UnitSpec) -> None:
        self.name = name
        self.spec = spec
        self.tree_id = os.urandom(6).hex()
        self.leaf: Leaf | None = None
        self.argv: tuple[str, ...] = spec.cmd
        self.env: dict[str, str] = {}
        self.log: RotatingLog | None = None  # opened at prepare, handed to the runner
        self.runner: TaskRunner | None = None


def _status(code: int | None) -> str:
    if code is None:
        return "unknown status"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


def _peek_exit(child: Child) -> int | None:
    """The child's exit status if it has exited, *without* reaping it."""
    if child.returncode is not None:
        return child.returncode
    try:
        res = os.waitid(os.P_PIDFD, child.pidfd, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return child.returncode
    if res is None:
        return None
    return res.si_status if res.si_code == os.CLD_EXITED else -res.si_status


def _reap(child: Child | None, timeout: float = 1.0) -> None:
    """Collect a child that has been stopped (bounded; it may be a survivor)."""
    if child is not None:
        child.collect(timeout)


# ---------------------------------------------------------------------- the stack


class Stack:
    """One run of a stack file; see the module docstring.

    ``run_dir``: the stack's directory (logs, control socket, lock).
    ``hierarchy``: where to make cgroup leaves; None to walk /proc (this
    process then becomes a child subreaper). ``environ``: what ``pass_env``
    names are taken from. ``extra_env``: set for every unit, over its own
    ``env`` (the ticket's variables). ``extra``: descriptors to watch, each
    with a function that may return a :class:`Cause` to stop. ``run_for``:
    stop this long after the stack is up. ``on_ready``: called once, when
    every unit is first ready.
    """

    def __init__(
        self,
        spec: StackSpec,
        *,
        run_dir: str,
        hierarchy: Hierarchy | None,
        environ: Mapping[str, str],
        extra_env: Mapping[str, str] | None = None,
        display: Display | None = None,
        on_tree_prepared: Callable[[str, str, Leaf | None], None] | None = None,
        on_started: Callable[[str, Tree], None] | None = None,
        extra: Mapping[int, Extra] | None = None,
        run_for: float | None = None,
        on_ready: Callable[[], None] | None = None,
        source: str = "",
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self.run_dir = run_dir
        self.hierarchy = hierarchy
        self.environ = environ
        self.extra_env = dict(extra_env or {})
        self.display = display or Display()
        self.on_tree_prepared = on_tree_prepared
        self.on_started = on_started
        self.extra = dict(extra or {})
        self.run_for = run_for
        self.on_ready = on_ready
        self.source = source or spec.path
        # Services are started and supervised; task units run per call.
        self.order = [n for n in spec.order() if spec.units[n].kind == "service"]
        self.units = {n: Unit(n, spec.units[n]) for n in self.order}
        self.tasks = {n: TaskUnit(n, u) for n, u in spec.units.items() if u.kind == "task"}
        self.events: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.abort = threading.Event()
        self.cause: Cause | None = None
        self.phase = "starting"
        self.up_at: float | None = None
        self.started_at = time.monotonic()
        self.since_ticks = read_stat(os.getpid()).starttime
        self.down_waiters: list[Reply] = []
        self._lock_fd = -1
        self._ev_r = self._ev_w = -1
        self._control: ControlServer | None = None
        self._prepared = False
        self._ran = False  # run() took over what prepare() took
        self.ports: dict[str, int] = {}

    # ------------------------------------------------------------------ helpers

    def say(self, text: str) -> None:
        self.display.line(text)

    def _post(self, *event: Any) -> None:
        self.events.put(event)
        try:
            os.write(self._ev_w, b"e")
        except (BlockingIOError, OSError):
            pass

    def _where(self, unit: str, *keys: str) -> str:
        return self.spec.where("units", unit, *keys)

    # ------------------------------------------------------------------ prepare

    def _lock(self) -> None:
        try:  # nothing of ours through a link planted in our directories
            ensure_dir(os.path.dirname(os.path.abspath(self.run_dir)), owned=False)
            ensure_dir(self.run_dir)
            ensure_dir(os.path.join(self.run_dir, "logs"))
            fd = open_for_update(os.path.join(self.run_dir, "stack.lock"))
        except UnsafePath as e:
            raise StackError([str(e)], 2) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise StackError(
                [
                    f"stack {self.name} is already running (pid {other or '?'}); "
                    f"see hold ps {self.name}"
                ]
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _check_ports(self) -> None:
        errors: list[str] = []
        for u in self.units.values():
            named: list[tuple[int, tuple[str, ...]]] = []
            if isinstance(u.spec.port, int):
                named.append((u.spec.port, ("port",)))
            r = u.spec.ready
            if (
                r is not None
                and r.tcp is not None
                and r.tcp != "{port}"
                and int(r.tcp) != u.spec.port
            ):
                named.append((int(r.tcp), ("ready", "tcp")))
            for port, keys in named:
                who = readiness.port_taken(port)
                if who is not None:
                    errors.append(
                        f"{self._where(u.name, *keys)}: port {port} is already taken by {who}"
                    )
        if errors:
            raise StackError(errors)

    def _assign(self) -> None:
        taken = {u.spec.port for u in self.units.values() if isinstance(u.spec.port, int)}
        ports: dict[str, int] = {}
        for u in self.units.values():
            if isinstance(u.spec.port, int):
                u.port = u.spec.port
            elif u.spec.port == "auto":
                port = readiness.pick_free_port()
                while port in taken:
                    port = readiness.pick_free_port()
                taken.add(port)
                u.port = port
            if u.port is not None:
                ports[u.name] = u.port
        errors: list[str] = []
        code = USAGE
        for u in self.units.values():
            f = functools.partial(fill, unit=u.name, ports=ports, run_dir=self.run_dir)
            u.argv = tuple(f(a) for a in u.spec.cmd)
            self.ports = ports
            u.env = self._env_of(u)
            try:
                resolve(u.argv[0], u.env.get("PATH"))
            except SpawnError as e:
                errors.append(f"{self._where(u.name, 'cmd')}: {e}")
                code = e.exit_code
            r = u.spec.ready
            if r is None:
                continue
            if r.http is not None:
                assert u.port is not None
                u.probe = readiness.HttpProbe(u.port, f(r.http))
            elif r.tcp is not None:
                tcp_port = u.port if r.tcp == "{port}" else int(r.tcp)
                assert tcp_port is not None
                u.probe = readiness.TcpProbe(tcp_port)
            elif r.log is not None:
                u.probe = readiness.LogProbe(r.log)
            elif r.file is not None:
                u.probe = readiness.FileProbe(f(r.file))
            elif r.exec is not None:
                argv = tuple(f(a) for a in r.exec)
                u.probe = readiness.ExecProbe(argv, self._probe_starter(u))
        for t in self.tasks.values():
            f = functools.partial(fill, unit=t.name, ports=ports, run_dir=self.run_dir)
            t.argv = tuple(f(a) for a in t.spec.cmd)
            t.env = self._env_of(t)
            try:
                resolve(t.argv[0], t.env.get("PATH"))
            except SpawnError as e:
                errors.append(f"{self._where(t.name, 'cmd')}: {e}")
                code = e.exit_code
        if errors:
            raise StackError(errors, code)

    def _env_of(self, u: Unit | TaskUnit) -> dict[str, str]:
        extra = {
            **filled_env(u.spec, u.name, self.ports, self.run_dir),
            **self.extra_env,
            "HOLD_STACK": self.name,
            "HOLD_UNIT": u.name,
        }
        return minimal_env(self.environ, tree_id=u.tree_id, pass_names=u.spec.pass_env, extra=extra)

    def _probe_starter(self, u: Unit) -> Callable[[tuple[str, ...]], Child]:
        def start(argv: tuple[str, ...]) -> Child:
            devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
            try:
                # The unit's isolation, and its marker and leaf: a probe that
                # is still running when the unit stops (or when we are
                # killed) is part of the unit's tree and goes with it.
                return spawn(
                    argv,
                    env=u.env,
                    cpus=u.spec.cpus,
                    stdin=devnull,
                    stdout=devnull,
                    stderr=devnull,
                    cgroup=u.leaf,
                )
            finally:
                os.close(devnull)

        return start

    def _open_logs(self) -> None:
        """Each unit's log, and the check of the record we will write: refused
        (exit 2, nothing started) if a link or someone else's file is there."""
        try:
            check_file(os.path.join(self.run_dir, "stack.json"))
            every: list[Unit | TaskUnit] = [*self.units.values(), *self.tasks.values()]
            for u in every:
                u.log = RotatingLog(os.path.join(self.run_dir, "logs", f"{u.name}.log"))
        except UnsafePath as e:
            raise StackError([str(e)], 2) from None

    def _open_outputs(self) -> None:
        for u in self.units.values():
            assert u.log is not None  # opened by prepare()
            u.out_r, u.out_w = os.pipe2(os.O_CLOEXEC)
            u.wake_r, u.wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            u.reader = threading.Thread(
                target=self._read_output, args=(u,), name=f"out-{u.name}", daemon=True
            )
            u.reader.start()

    def _open_tasks(self) -> None:
        for t in self.tasks.values():
            log, t.log = t.log, None  # the runner's from now on (it closes it)
            t.runner = TaskRunner(
                t.name,
                t.spec,
                env=t.env,
                argv=t.argv,
                leaf=t.leaf,
                log=log,
                on_end=self._on_call_end,
            )

    def _on_call_end(self, r: CallResult) -> None:
        """In the call's thread: say what went wrong (each call is in the unit's log)."""
        if r.outcome == "exited" and not r.survivors:
            return
        why = r.detail or r.outcome
        text = f"{r.unit}: call {r.call_id} {r.outcome} (exit {r.exit_code}, {r.wall:.2f}s)"
        if r.outcome != "exited":
            text += f": {why}"
        if r.survivors:
            text += f"; {len(r.survivors)} process(es) SURVIVED its stop"
        self.say(text)

    def _read_output(self, u: Unit) -> None:
        reader = LineReader(u.out_r)
        log = u.log
        assert log is not None
        probe = u.probe if isinstance(u.probe, readiness.LogProbe) else None
        draining = False
        while True:
            if u.reader_stop.is_set() and not draining:
                # Told to stop: take what is already in the pipe, then go.
                draining = True
            try:
                line = reader.readline(time.monotonic() + (0.05 if draining else 0.25))
            except TimeoutError:
                if draining:
                    return
                continue
            if line is None:
                return
            try:
                log.write(line)
            except OSError:
                pass
            u.tail.append(line)
            u.last_line = line
            if probe is not None:
                probe.feed(line)
            u.wake()

    def _write_record(self, **more: Any) -> None:
        rec = {
            "name": self.name,
            "pid": os.getpid(),
            "file": os.path.abspath(self.source),
            "started": time.time(),
            **more,
        }
        write_atomic(os.path.join(self.run_dir, "stack.json"), json.dumps(rec).encode())

    # ------------------------------------------------------------------ run

    def prepare(self) -> None:
        """Everything that may refuse, before anything starts: the stack's lock (one
        run per name), named ports free, auto ports picked, commands found.

        Raises :class:`StackError` (with every reason); on success the caller
        must go on to :meth:`run` or call :meth:`release`.
        """
        self._lock()
        try:
            self._open_logs()
            self._check_ports()
            self._assign()
        except BaseException:
            self.release()
            raise
        self._prepared = True

    def run(self, extra_env: Mapping[str, str] | None = None) -> StackResult:
        """Start, supervise until a cause to stop, stop everything; the result.

        ``extra_env`` (the ticket's variables) is set for every unit, over its
        own ``env``. Calls :meth:`prepare` first if the caller has not.
        """
        self._ran = True
        if not self._prepared:
            self.prepare()
        try:
            if extra_env:
                self.extra_env.update(extra_env)
            for u in self.units.values():
                u.env = self._env_of(u)
            for t in self.tasks.values():
                t.env = self._env_of(t)
            self._make_trees()
            return self._run_prepared()
        finally:
            self.release()

    def _make_trees(self) -> None:
        from supervisor.cgroup import CgroupUnavailable

        try:
            every: list[Unit | TaskUnit] = [*self.units.values(), *self.tasks.values()]
            if self.hierarchy is not None:
                for u in every:
                    u.leaf = self.hierarchy.create(f"hold-{u.tree_id}")
            else:
                from supervisor.reaper import become_subreaper

                become_subreaper()
            if self.on_tree_prepared is not None:
                for u in every:
                    self.on_tree_prepared(u.name, u.tree_id, u.leaf)
        except CgroupUnavailable as e:
            self._remove_leaves()
            raise StackError([f"cgroups: {e}"], TOOL) from None
        except BaseException:
            self._remove_leaves()
            raise

    def _remove_leaves(self) -> None:
        every: list[Unit | TaskUnit] = [*self.units.values(), *self.tasks.values()]
        for u in every:
            if u.leaf is not None and self.hierarchy is not None:
                try:
                    u.leaf.remove(self.hierarchy.base)
                except OSError as e:
                    self.say(f"{u.name}: cgroup leaf {u.leaf.path} not removed: {e}")
            u.leaf = None

    @contextlib.contextmanager
    def until_run(self) -> Iterator[None]:
        """What :meth:`prepare` took (the name's lock, the logs) as a scope: let go
        of on every way out of it unless :meth:`run` took them over (it lets go itself)."""
        try:
            yield
        finally:
            if not self._ran:
                self.release()

    def release(self) -> None:
        """Let go of the stack's name (its lock) without running it."""
        every: list[Unit | TaskUnit] = [*self.units.values(), *self.tasks.values()]
        for u in every:
            if u.log is not None:
                u.log.close()  # opened by prepare(); closing twice is nothing
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # the flock goes with it
            self._lock_fd = -1

    def _run_prepared(self) -> StackResult:
        self._ev_r, self._ev_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        sig_r, sig_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        old_handlers: dict[int, Any] = {}
        for signum in (*STOP_SIGNALS, signal.SIGCHLD):
            old_handlers[signum] = signal.signal(signum, _noop)
        old_wakeup = signal.set_wakeup_fd(sig_w, warn_on_full_buffer=False)
        try:
            self._open_outputs()
            self._open_tasks()
            self._control = ControlServer(
                os.path.join(self.run_dir, "control.sock"), self._on_request
            )
            try:
                self._write_record(state="running")
            except (OSError, UnsafePath) as e:  # checked at prepare; a link planted since
                self.say(f"warning: the stack's record is not written: {e}")
            try:
                self._loop(sig_r)
            except BaseException as e:  # an internal error still stops everything
                self.cause = Cause("internal", f"internal error: {e!r}", TOOL)
                raise
            finally:
                result = self._stop_all()
                self._finish(result)
            return result
        finally:
            signal.set_wakeup_fd(old_wakeup)
            for num, handler in old_handlers.items():
                if handler is not None:
                    signal.signal(num, handler)
            for fd in (self._ev_r, self._ev_w, sig_r, sig_w):
                os.close(fd)

    def _finish(self, result: StackResult) -> None:
        """After the stop: answer `hold down`, close the channel, readers, logs, leaves."""
        for reply in self.down_waiters:
            reply.send(
                {
                    "ev": "stopped",
                    "code": result.code,
                    "survivors": [s._asdict() for s in result.survivors],
                },
                done=True,
            )
        if self._control is not None:
            self._control.close()
        for u in self.units.values():
            u.reader_stop.set()
        for u in self.units.values():
            if u.reader is not None:
                u.reader.join(timeout=2.0)
            for fd in (u.out_r, u.out_w, u.wake_r, u.wake_w):
                if fd >= 0:
                    os.close(fd)
            u.out_r = u.out_w = u.wake_r = u.wake_w = -1
            if u.log is not None:
                u.log.close()
            if isinstance(u.probe, readiness.ExecProbe):
                u.probe.close()
        if not result.survivors:
            self._remove_leaves()
        try:
            self._write_record(state="stopped", code=result.code, cause=result.cause.detail)
        except (OSError, UnsafePath):
            pass

    # ------------------------------------------------------------------ the loop

    def _loop(self, sig_r: int) -> None:
        n = len(self.units) + len(self.tasks)
        self.say(f"starting stack {self.name} ({n} units) from {self.source}")
        for task in self.tasks.values():
            if task.runner is not None:
                r = task.runner
                self.say(
                    f"{task.name}: task, runs per call once the stack is up (cpus "
                    f"{format_cpus(r.cpus)}, timeout {r.timeout:g}s, concurrency "
                    f"{r.concurrency}); hold call {self.name} {task.name}"
                )
        self._launch_starts()
        self._maybe_up()
        tick = 0.1 if self.display.live else None
        while self.cause is None:
            poller = select.poll()
            poller.register(sig_r, select.POLLIN)
            poller.register(self._ev_r, select.POLLIN)
            for fd in self.extra:
                poller.register(fd, select.POLLIN)
            watched: dict[int, Unit] = {}
            for u in self.units.values():
                if (
                    u.state is UnitState.READY
                    and u.job is None
                    and u.child is not None
                    and u.child.returncode is None
                ):
                    watched[u.child.pidfd] = u
                    poller.register(u.child.pidfd, select.POLLIN)
            timeout = self._next_timer()
            if tick is not None and self.phase == "starting":
                timeout = tick if timeout is None else min(timeout, tick)
            for fd, _ in poller.poll(None if timeout is None else max(0.0, timeout) * 1000):
                if fd == sig_r:
                    self._on_signals(sig_r)
                elif fd == self._ev_r:
                    _drain(fd)
                elif fd in watched:
                    self._on_exit(watched[fd])
                elif fd in self.extra:
                    cause = self.extra[fd](fd)
                    if cause is not None and self.cause is None:
                        self.cause = cause
            self._handle_events()
            self._run_timers()
            if self.phase == "starting":
                self._draw()

    def _next_timer(self) -> float | None:
        now = time.monotonic()
        times = [u.restart_at - now for u in self.units.values() if u.restart_at is not None]
        if self.run_for is not None and self.up_at is not None:
            times.append(self.up_at + self.run_for - now)
        return min(times) if times else None

    def _run_timers(self) -> None:
        now = time.monotonic()
        if (
            self.cause is None
            and self.run_for is not None
            and self.up_at is not None
            and now >= self.up_at + self.run_for
        ):
            self.cause = Cause("time", f"ran for {self.run_for:g}s as asked", OK)
            return
        for u in self.units.values():
            if self.cause is None and u.restart_at is not None and now >= u.restart_at:
                u.restart_at = None
                self._launch(u, self._start_job, restart=True)

    def _on_signals(self, fd: int) -> None:
        for signum in _drain(fd):
            if signum == signal.SIGCHLD:
                if self.hierarchy is None:
                    reap_adopted(owned_pids())
            elif signum in STOP_SIGNALS and self.cause is None:
                name = signal.Signals(signum).name
                self.cause = Cause("signal", f"{name} received", OK)

    # ------------------------------------------------------------------ starting

    def _launch_starts(self) -> None:
        """Start every waiting unit whose dependencies are all ready."""
        if self.cause is not None:
            return
        for u in self.units.values():
            if u.state is not UnitState.WAITING:
                continue
            if all(self.units[d].state is UnitState.READY for d in u.spec.after):
                self._launch(u, self._start_job, restart=False)

    def _launch(self, u: Unit, target: Callable[..., None], **kw: Any) -> None:
        u.job = threading.Thread(
            target=target, args=(u,), kwargs=kw, name=f"job-{u.name}", daemon=True
        )
        u.job.start()

    def _start_job(self, u: Unit, restart: bool) -> None:
        """Worker: spawn the unit and wait until it is ready (or fails, or is aborted)."""
        try:
            self._post("result", u, *self._start_and_wait(u, restart))
        except BaseException as e:
            self._post("result", u, "failed", UNIT_FAILED, f"internal error: {e!r}")

    def _start_and_wait(self, u: Unit, restart: bool) -> tuple[str, int, str]:
        if self.abort.is_set():
            return ("aborted", 0, "")
        if isinstance(u.probe, readiness.LogProbe):
            u.probe.reset()
        _drain(u.wake_r)
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
        self._post("spawned", u)
        if self.on_started is not None:
            try:
                self.on_started(u.name, u.tree)
            except Exception as e:
                self._post("say", f"{u.name}: could not tell the guardian: {e}")
        return self._wait_ready(u, child, u.tree)

    def _wait_ready(self, u: Unit, child: Child, tree: Tree) -> tuple[str, int, str]:
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
            if self.abort.is_set():
                return ("aborted", 0, "")
            code = _peek_exit(child)
            if code is not None:
                return (
                    "failed",
                    UNIT_FAILED,
                    f"exited with {_status(code)} before it was ready "
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
            _drain(u.wake_r)
            interval = min(interval * 1.5, 0.25)

    # ------------------------------------------------------------------ events

    def _handle_events(self) -> None:
        while True:
            try:
                ev = self.events.get_nowait()
            except queue.Empty:
                return
            kind = ev[0]
            if kind == "say":
                self.say(ev[1])
            elif kind == "spawned":
                u = ev[1]
                port = f", port {u.port}" if u.port is not None else ""
                cpus = f", cpus {format_cpus(u.spec.cpus)}" if u.spec.cpus else ""
                self.say(f"{u.name}: started, pid {u.pid}{port}{cpus}")
            elif kind == "result":
                self._on_result(*ev[1:])
            elif kind == "cleaned":
                self._on_cleaned(ev[1], ev[2])
            elif kind == "call":
                ev[1]()

    def _on_result(self, u: Unit, outcome: str, code: int, why: str) -> None:
        job, u.job = u.job, None
        if job is not None:
            job.join()
        if outcome == "ready":
            advance(u, UnitState.READY)
            u.ready_at = time.monotonic()
            u.detail = why
            self.say(f"{u.name}: ready after {u.ready_at - u.spawned_at:.2f}s ({why})")
            self._launch_starts()
            self._maybe_up()
            return
        if outcome == "aborted":
            # Only the stop aborts a job; a unit that never spawned stays waiting.
            if u.tree is not None:
                advance(u, UnitState.STOPPING)
            return
        # Failed: exited before ready, not ready in time, or could not spawn.
        advance(u, UnitState.FAILED)
        u.detail = why
        self._reap_if_exited(u)
        if self.phase == "starting" and u.total_restarts == 0:
            what = "never became ready" if code == NOT_READY else "failed to start"
            self._fail(
                Cause(
                    "start",
                    f"unit {u.name} {what}: {why}",
                    code,
                ),
                u,
            )
            return
        self._after_end(u, failed=True, code=code, why=why)

    def _maybe_up(self) -> None:
        """Once every service is ready (at once when there are none), the stack is up
        and its task units take calls."""
        if self.phase == "starting" and all(
            x.state is UnitState.READY for x in self.units.values()
        ):
            self.phase = "running"
            self.up_at = time.monotonic()
            self._draw()
            self.display.end_table()
            took = self.up_at - self.started_at
            n = len(self.units) + len(self.tasks)
            self.say(
                f"stack {self.name} is up ({n} units, {took:.2f}s); "
                f"hold ps {self.name} / hold down {self.name}"
            )
            if self.on_ready is not None:
                self.on_ready()

    def _reap_if_exited(self, u: Unit) -> None:
        c = u.child
        if c is not None and c.returncode is None and _peek_exit(c) is not None:
            u.returncode = c.poll()

    def _fail(self, cause: Cause, u: Unit) -> None:
        if self.cause is not None:
            return
        self.cause = cause
        lines = list(u.tail)[-10:]
        text = f"{cause.detail}"
        if lines:
            text += f"\n  last output of {u.name}:\n" + "\n".join(f"  | {ln}" for ln in lines)
        else:
            text += f"\n  ({u.name} printed nothing)"
        self.say(text)

    def _on_exit(self, u: Unit) -> None:
        """A ready unit's process ended (its pidfd became readable)."""
        assert u.child is not None
        code = u.child.poll()
        if code is None:
            return
        u.returncode = code
        advance(u, UnitState.EXITED)
        self.say(
            f"{u.name}: exited with {_status(code)} after {time.monotonic() - u.spawned_at:.2f}s"
        )
        self._after_end(u, failed=code != 0, code=UNIT_FAILED, why=f"exited with {_status(code)}")

    def _after_end(self, u: Unit, *, failed: bool, code: int, why: str) -> None:
        """Restart per policy (after stopping what it left), or stop the stack."""
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
            self.say(f"{u.name}: restart {u.restarts} of {r.max} in {delay:g}s")
            u.restart_at = None
            self._launch(u, self._clean_job, delay=delay)
            return
        if not wanted:
            how = "not restarted" + (f" (restart policy {r.policy})" if r.policy != "no" else "")
        else:
            how = f"restarts exhausted ({u.restarts} of {r.max} in a row)"
        status = code if failed else OK
        self._fail(Cause("unit", f"unit {u.name} {why}; {how}: stopping the stack", status), u)

    def _clean_job(self, u: Unit, delay: float) -> None:
        """Worker: stop what the ended unit left behind, before it starts again."""
        report = None
        try:
            if u.tree is not None:
                u.tree.owned = owned_pids()
                report = stop_tree(u.tree, sig=u.spec.stop.signal, grace=u.spec.stop.grace)
            _reap(u.child)
        finally:
            self._post("cleaned", u, (report, delay))

    def _on_cleaned(self, u: Unit, payload: tuple[StopReport | None, float]) -> None:
        report, delay = payload
        job, u.job = u.job, None
        if job is not None:
            job.join()
        if report is not None and report.stopped:
            self.say(f"{u.name}: stopped what it left: {report.summary()}")
        if report is not None and report.survivors:
            self._fail(
                Cause("unit", f"unit {u.name}: processes it left survived the stop", SURVIVORS),
                u,
            )
            return
        if self.cause is None:
            u.restart_at = time.monotonic() + delay

    # ------------------------------------------------------------------ control

    def _on_request(self, msg: Message, reply: Reply) -> None:
        """In a control connection's thread: answer ps here; hand the rest to the main thread."""
        op = msg.get("op")
        if op == "ps":
            now = time.monotonic()
            reply.send(
                {
                    "ev": "ps",
                    "stack": self.name,
                    "pid": os.getpid(),
                    "file": os.path.abspath(self.source),
                    "phase": self.phase,
                    "uptime": round(now - self.started_at, 3),
                    "run_dir": self.run_dir,
                    "units": [u.snapshot(now) for u in self.units.values()]
                    + [
                        t.runner.snapshot(self.phase == "running" and self.cause is None)
                        for t in self.tasks.values()
                        if t.runner is not None
                    ],
                    "calls": [
                        c.snapshot(now)
                        for t in self.tasks.values()
                        if t.runner is not None
                        for c in t.runner.running()
                    ],
                },
                done=True,
            )
        elif op == "call":
            self._serve_call(msg, reply)
        elif op == "down":
            self._post("call", lambda: self._down(reply))
        elif op == "restart":
            self._post("call", lambda: self._restart(str(msg.get("unit")), reply))
        else:
            reply.send(
                {"ev": "error", "error": f"unknown op {op!r}; accepted: ps, down, restart, call"},
                done=True,
            )

    def _serve_call(self, msg: Message, reply: Reply) -> None:
        """In the connection's thread: one call of a task unit, from request to result.

        Answers ``accepted`` (with the call id) once it is in, then ``result``
        (``done``). The call is cancelled if the client goes away (the
        connection closes: Ctrl-C, SIGKILL) or asks to (``{"op": "cancel"}``
        on the same connection); the result then still comes, to whoever is
        left to read it.
        """
        name = msg.get("unit")
        t = self.tasks.get(name) if isinstance(name, str) else None
        if t is None or t.runner is None:
            tasks = ", ".join(self.tasks) or "none"
            what = "a service, not a task" if name in self.units else "no unit"
            why = f"{name!r} is {what} of stack {self.name} (task units: {tasks})"
            reply.send({"ev": "error", "code": 2, "errors": [why]}, done=True)
            return
        if self.phase != "running" or self.cause is not None:
            state = "stopping" if self.cause is not None else self.phase
            reply.send(
                {
                    "ev": "error",
                    "code": BUSY,
                    "errors": [f"stack {self.name} is {state}: calls are taken while it is up"],
                },
                done=True,
            )
            return
        text_args = msg.get("text_args") or {}
        if not isinstance(text_args, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in text_args.items()
        ):
            reply.send(
                {"ev": "error", "code": 2, "errors": ["text_args: a mapping of names to text"]},
                done=True,
            )
            return
        try:
            call = t.runner.submit(
                msg.get("args", {}), text_args=text_args, no_wait=bool(msg.get("no_wait"))
            )
        except CallRefused as e:
            reply.send({"ev": "error", "code": e.code, "errors": e.errors}, done=True)
            return
        reply.send(
            {
                "ev": "accepted",
                "call": call.id,
                "unit": t.name,
                "state": call.state,
                "timeout": t.runner.timeout,
                "grace": t.spec.stop.grace,
            }
        )
        _follow_call(call, reply)
        r = call.result()
        ans = {"ev": "result", **r.to_json(stdout=False)}
        ans["stdout_b64"] = base64.b64encode(r.stdout).decode()
        reply.send(ans, done=True)

    def _down(self, reply: Reply) -> None:
        reply.send({"ev": "stopping"})
        self.down_waiters.append(reply)
        if self.cause is None:
            self.cause = Cause("down", "hold down", OK)

    def _restart(self, name: str, reply: Reply) -> None:
        u = self.units.get(name)
        if u is None:
            reply.send(
                {
                    "ev": "error",
                    "code": USAGE,
                    "error": f"no unit {name!r} in stack "
                    f"{self.name} (units: {', '.join(self.units)})",
                },
                done=True,
            )
            return
        if (
            self.cause is not None
            or u.job is not None
            or u.state not in (UnitState.READY, UnitState.EXITED, UnitState.BACKOFF)
        ):
            reply.send(
                {
                    "ev": "error",
                    "code": BUSY,
                    "error": f"unit {name} is {u.state}; try again when it is ready",
                },
                done=True,
            )
            return
        u.restart_at = None
        u.total_restarts += 1
        advance(u, UnitState.RESTARTING)
        self.say(f"{name}: restarting (asked by hold restart)")
        self._launch(u, self._manual_restart_job, reply=reply)

    def _manual_restart_job(self, u: Unit, reply: Reply) -> None:
        try:
            if u.tree is not None:
                u.tree.owned = owned_pids()
                report = stop_tree(u.tree, sig=u.spec.stop.signal, grace=u.spec.stop.grace)
                _reap(u.child)
                if report.survivors:
                    self._post(
                        "result",
                        u,
                        "failed",
                        SURVIVORS,
                        "survivors after the stop for a restart",
                    )
                    reply.send(
                        {"ev": "error", "code": SURVIVORS, "error": report.summary()},
                        done=True,
                    )
                    return
            outcome, code, why = self._start_and_wait(u, True)
        except BaseException as e:
            outcome, code, why = "failed", UNIT_FAILED, f"internal error: {e!r}"
        self._post("result", u, outcome, code, why)
        if outcome == "ready":
            reply.send({"ev": "restarted", "unit": u.name, "pid": u.pid}, done=True)
        else:
            reply.send(
                {
                    "ev": "error",
                    "code": code or UNIT_FAILED,
                    "error": f"{u.name}: {why or outcome}",
                },
                done=True,
            )

    # ------------------------------------------------------------------ display

    def _draw(self) -> None:
        if not self.display.live:
            return
        now = time.monotonic()
        rows = []
        for u in self.units.values():
            if u.state is UnitState.STARTING:
                waited = f"{now - u.spawned_at:.1f}s"
            elif u.state is UnitState.READY and u.ready_at is not None:
                waited = f"{u.ready_at - u.spawned_at:.2f}s"
            else:
                waited = ""
            pid = u.pid
            rows.append(
                [
                    u.name,
                    u.state,
                    str(pid) if pid else "-",
                    str(u.port) if u.port else "-",
                    waited,
                    u.last_line[:200],
                ]
            )
        self.display.table(rows)

    # ------------------------------------------------------------------ stopping

    def _levels(self) -> list[list[Unit]]:
        """Units by dependency depth, deepest first: the order to stop them in."""
        depth: dict[str, int] = {}
        for name in self.order:
            deps = self.units[name].spec.after
            depth[name] = 1 + max((depth[d] for d in deps), default=-1)
        levels: dict[int, list[Unit]] = {}
        for name, d in depth.items():
            levels.setdefault(d, []).append(self.units[name])
        return [levels[d] for d in sorted(levels, reverse=True)]

    def _stop_all(self) -> StackResult:
        cause = self.cause or Cause("internal", "stopped", TOOL)
        self.abort.set()
        for u in self.units.values():
            u.wake()
            if isinstance(u.probe, readiness.ExecProbe):
                u.probe.abort()
        # Calls first: a running call may use the services (an executor asking
        # the model server), and it takes no new ones from here on.
        runners = [t.runner for t in self.tasks.values() if t.runner is not None]
        calls = sum(len(r.running()) for r in runners)
        for r in runners:
            r.cancel_all("the stack is stopping")
        reports: list[tuple[str, StopReport]] = []
        if calls:
            self.say(f"stopping {calls} running call(s)")
        for r in runners:
            for res in r.close():
                if res.report is not None:
                    reports.append((f"{res.unit} call {res.call_id}", res.report))
        # Jobs notice the abort within a probe interval; a stop in progress
        # finishes its grace. Bounded either way.
        limit = (
            time.monotonic() + max((u.spec.stop.grace for u in self.units.values()), default=0) + 10
        )
        for u in self.units.values():
            if u.job is not None:
                u.job.join(timeout=max(0.0, limit - time.monotonic()))
        self._handle_results_quietly()
        self.display.end_table()
        started = [u for u in self.units.values() if u.tree is not None]
        # A failure was told in full already; other causes are named here.
        why = "" if cause.kind in ("start", "unit") else f" ({cause.detail})"
        if started:
            names = [u.name for lv in self._levels() for u in lv if u in started]
            self.say(f"stopping {', '.join(names)}{why}")
        for level in self._levels():
            todo = [u for u in level if u.tree is not None]
            threads = []
            for u in todo:
                advance(u, UnitState.STOPPING)
                t = threading.Thread(
                    target=self._stop_unit, args=(u, reports), name=f"stop-{u.name}", daemon=True
                )
                threads.append(t)
                t.start()
            for t in threads:
                t.join()
        # The survivor check over all: every unit's tree again (an escapee of
        # one may have appeared in another's after it was stopped) and, when
        # walking /proc, orphans adopted by this process that no tree claimed.
        for u in started:
            assert u.tree is not None
            u.tree.forget_dead()
            if u.tree.members():
                rep = stop_tree(u.tree, sig=signal.SIGKILL, grace=0)
                reports.append((u.name, rep))
        for task in self.tasks.values():
            # Every call of the unit, by the unit's leaf (each call's lies in
            # it) and marker: a call whose stop was cut short is found here.
            tt = Tree(task.tree_id, None, None, None, leaf=task.leaf, since=self.since_ticks)
            if tt.members():
                reports.append((task.name, stop_tree(tt, sig=signal.SIGKILL, grace=0)))
        if self.hierarchy is None:
            sweep = Tree(
                f"{os.getpid():x}sweep",
                None,
                None,
                None,
                adopts_orphans=True,
                owned=owned_pids(),
                since=self.since_ticks,
            )
            if sweep.members():
                rep = stop_tree(sweep, grace=0.5)
                reports.append(("(adopted orphans)", rep))
                self.say(f"stopped orphans no unit claimed: {rep.summary()}")
        survivors = [s for _, r in reports for s in r.survivors]
        code = SURVIVORS if survivors else cause.code
        for u in started:
            advance(u, UnitState.STOPPED if u.pid is None else UnitState.SURVIVED)
        if survivors:
            lines = [f"  pid {s.pid} ({s.found_by}): {s.command}" for s in survivors]
            self.say(
                f"stack {self.name}: {len(survivors)} process(es) SURVIVED the stop:\n"
                + "\n".join(lines)
            )
        else:
            n = sum(len(r.stopped) for _, r in reports)
            took = max((r.duration for _, r in reports), default=0.0)
            self.say(
                f"stack {self.name} stopped{why}: {n} process(es) in {len(started)} unit(s), "
                f"{took * 1000:.0f} ms for the slowest; survivor check empty"
            )
        return StackResult(code, cause, reports, survivors)

    def _stop_unit(self, u: Unit, reports: list[tuple[str, StopReport]]) -> None:
        assert u.tree is not None
        u.tree.owned = owned_pids()
        rep = stop_tree(u.tree, sig=u.spec.stop.signal, grace=u.spec.stop.grace)
        _reap(u.child)
        reports.append((u.name, rep))
        how = rep.outcome if rep.outcome != "empty" else "nothing left running"
        self.display.line(
            f"{u.name}: {how} ({len(rep.stopped)} process(es), {rep.duration * 1000:.0f} ms)"
        )

    def _handle_results_quietly(self) -> None:
        """Take the last results of jobs after the abort, so their children are reaped."""
        while True:
            try:
                ev = self.events.get_nowait()
            except queue.Empty:
                return
            if ev[0] == "result":
                u = ev[1]
                u.job = None
                self._reap_if_exited(u)
            elif ev[0] == "cleaned":
                ev[1].job = None
            elif ev[0] == "say":
                self.say(ev[1])
            elif ev[0] == "call":
                ev[1]()  # a late `hold down` waits for the end; a restart is refused


def _noop(signum: int, frame: object) -> None:
    """Signals are read from the wakeup descriptor; the handler only has to exist."""


def _drain(fd: int) -> list[int]:
    out: list[int] = []
    while True:
        try:
            data = os.read(fd, 4096)
        except (BlockingIOError, OSError):
            return out
        if not data:
            return out
        out.extend(data)


def _follow_call(call: Call, reply: Reply) -> None:
    """Wait for ``call`` to end while watching its client: gone (end of file,
    reset) or asking ``{"op": "cancel"}`` cancels it. Returns once it is done."""
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
        asked = b""
        while not call.done():
            for fd, _ev in poller.poll():
                if fd != client:
                    continue
                data = reply.recv()
                if not data:
                    poller.unregister(client)
                    call.cancel("the caller went away (hold call ended)")
                    continue
                asked = (asked + data)[-256:]
                if b'"cancel"' in asked:
                    call.cancel("cancelled by the caller")
    finally:
        with lock:
            closed = True
            os.close(wake_r)
            os.close(wake_w)
