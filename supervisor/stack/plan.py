"""Preparing a stack, and letting go of what preparing took.

Everything that may refuse comes before anything starts (:func:`prepare`): the
stack's lock (one run per name), the units' logs, named ports free, auto ports
picked, commands found, probes built. Then, as the run begins: the environments
with the ticket's variables, the trees (cgroup leaves, or the subreaper), the output
pipes with their reader threads (:mod:`hold_supervisor.stack.unitoutput`), the task runners,
the ``stack.json`` record.
"""

from __future__ import annotations

import fcntl
import functools
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from hold_supervisor.documents import StackRecord, StackRunState
from hold_supervisor.environ import minimal_env
from hold_supervisor.errors import SupervisorError
from hold_supervisor.exitcodes import TOOL, USAGE
from hold_supervisor.proc.cgroup import CgroupUnavailable
from hold_supervisor.safefile import (
    UnsafePath,
    check_file,
    ensure_dir,
    open_for_update,
    write_atomic,
)
from hold_supervisor.spawn.child import Child, SpawnError, resolve, spawn
from hold_supervisor.spawn.containment import leaf_path
from hold_supervisor.stack import readiness
from hold_supervisor.stack.notify import NotifyProbe, NotifySocket
from hold_supervisor.stack.state import StackError, StackState
from hold_supervisor.stack.unitoutput import open_pipes as open_pipes  # stackrun's
from hold_supervisor.stack.unitoutput import start_readers as start_readers
from hold_supervisor.stack.units import TaskUnit, Unit
from hold_supervisor.stackfile.spec import ReadySpec, fill, filled_env
from hold_supervisor.unitlog import RotatingLog

if TYPE_CHECKING:
    from hold_supervisor.task.task import CallResult

# ---------------------------------------------------------------------- prepare


def prepare(st: StackState) -> None:
    """Everything that may refuse (see the module docstring); :class:`StackError` with
    every reason, having let go of what it took."""
    take_lock(st)
    try:
        open_logs(st)
        check_ports(st)
        assign(st)
    except BaseException:
        release(st)
        raise
    st.prepared = True


def take_lock(st: StackState) -> None:
    """The stack's name: an flock on ``stack.lock`` holding our pid."""
    try:  # nothing of ours through a link planted in our directories
        ensure_dir(os.path.dirname(os.path.abspath(st.run_dir)), owned=False)
        ensure_dir(st.run_dir)
        ensure_dir(os.path.join(st.run_dir, "logs"))
        fd = open_for_update(os.path.join(st.run_dir, "stack.lock"))
    except UnsafePath as e:
        raise StackError([str(e)], 2) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise StackError(
            [f"stack {st.name} is already running (pid {other or '?'}); see hold ps {st.name}"]
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    st.lock_fd = fd


def open_logs(st: StackState) -> None:
    """Each unit's log, and the check of the record we will write: refused
    (exit 2, nothing started) if a link or someone else's file is there."""
    try:
        check_file(os.path.join(st.run_dir, "stack.json"))
        for u in st.every():
            u.log = RotatingLog(os.path.join(st.run_dir, "logs", f"{u.name}.log"))
    except UnsafePath as e:
        raise StackError([str(e)], 2) from None


def check_ports(st: StackState) -> None:
    """Every named port (the unit's, a tcp probe's) free now."""
    errors: list[str] = []
    for u in st.units.values():
        named: list[tuple[int, tuple[str, ...]]] = []
        if isinstance(u.spec.port, int):
            named.append((u.spec.port, ("port",)))
        r = u.spec.ready
        if r is not None and r.tcp is not None and r.tcp != "{port}" and int(r.tcp) != u.spec.port:
            named.append((int(r.tcp), ("ready", "tcp")))
        for port, keys in named:
            who = readiness.port_taken(port)
            if who is not None:
                errors.append(f"{st.where(u.name, *keys)}: port {port} is already taken by {who}")
    if errors:
        raise StackError(errors)


def assign(st: StackState) -> None:
    """Ports picked, then each unit's working directory, scratch, command,
    environment and probe filled in; :class:`StackError` for every command that is
    not found and every scratch that cannot be made."""
    st.ports = _pick_ports(st)
    errors: list[str] = []
    code = USAGE
    for u in st.every():  # services and one-shots, then task units
        try:
            _assign_unit(st, u)
        except SpawnError as e:
            errors.append(f"{st.where(u.name, 'cmd')}: {e}")
            code = e.exit_code
        except _NoScratch as e:
            errors.append(f"{st.where(u.name, 'scratch')}: {e}")
    if errors:
        raise StackError(errors, code)


class _NoScratch(SupervisorError):
    """A unit's scratch could not be made (the reason is the message): the
    :class:`~hold_supervisor.spawn.scratch.ScratchError`, whose module is imported only for
    a unit that has one."""

    exit_code = USAGE


def _assign_unit(st: StackState, u: Unit | TaskUnit) -> None:
    spec = u.spec
    if spec.scratch is not None and isinstance(u, Unit):
        # Only for a unit that has one: secrets and hashlib are ~4 ms of a start.
        from hold_supervisor.spawn.scratch import Scratch, ScratchError, default_root, sweep

        try:
            root = st.scratch_root or default_root()
            sweep(root)  # what killed runs left
            u.scratch = Scratch(root, keep=spec.scratch.keep, min_free=spec.scratch.min_free)
        except ScratchError as e:
            raise _NoScratch(str(e)) from None
    f = functools.partial(
        fill,
        unit=u.name,
        ports=st.ports,
        run_dir=st.run_dir,
        stack_dir=st.spec.stack_dir,
        scratch=u.scratch.path if isinstance(u, Unit) and u.scratch else "",
    )
    u.cwd = os.path.join(st.spec.stack_dir, f(spec.cwd or "."))
    u.argv = tuple(f(a) for a in spec.cmd)
    if isinstance(u, Unit) and spec.ready is not None and spec.ready.notify:
        u.notify = NotifySocket(_notify_path(st, u))
    u.env = env_of(st, u)
    resolve(u.argv[0], u.env.get("PATH"), u.cwd)
    if isinstance(u, Unit):
        u.probe = probe_of(u, spec.ready, f)


def _notify_path(st: StackState, u: Unit) -> str:
    """The unit's NOTIFY_SOCKET: in the run directory if the path fits a socket
    address (108 bytes), else an abstract name (the sender's pid is checked anyway)."""
    path = os.path.join(st.run_dir, f"notify-{u.name}.sock")
    if len(path.encode()) < 100:
        try:
            os.unlink(path)  # a stale socket of ours from a killed run
        except FileNotFoundError:
            pass
        return path
    return f"\0hold-notify-{u.tree_id}"


def _pick_ports(st: StackState) -> dict[str, int]:
    """Each service's port: its own number, or a free one for ``auto``."""
    taken = {u.spec.port for u in st.units.values() if isinstance(u.spec.port, int)}
    ports: dict[str, int] = {}
    for u in st.units.values():
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
    return ports


def probe_of(u: Unit, r: ReadySpec | None, f: Callable[[str], str]) -> readiness.Probe | None:
    """The unit's probe for ``r`` (readiness, or liveness as a ReadySpec), its
    placeholders filled by ``f``."""
    if r is None:
        return None
    if r.http is not None:
        assert u.port is not None
        return readiness.HttpProbe(u.port, f(r.http))
    if r.tcp is not None:
        tcp_port = u.port if r.tcp == "{port}" else int(r.tcp)
        assert tcp_port is not None
        return readiness.TcpProbe(tcp_port)
    if r.log is not None:
        return readiness.LogProbe(r.log)
    if r.file is not None:
        return readiness.FileProbe(os.path.join(u.cwd or "/", f(r.file)))
    if r.exec is not None:
        return readiness.ExecProbe(tuple(f(a) for a in r.exec), _probe_starter(u))
    if r.notify and u.notify is not None:
        return NotifyProbe(u.notify)
    return None


def env_of(st: StackState, u: Unit | TaskUnit) -> dict[str, str]:
    """The unit's whole environment: minimal, its ``env``, the caller's, its names."""
    scratch = u.scratch.path if isinstance(u, Unit) and u.scratch is not None else ""
    extra = {
        **filled_env(u.spec, u.name, st.ports, st.run_dir, st.spec.stack_dir, scratch),
        **st.extra_env,
        "HOLD_STACK": st.name,
        "HOLD_UNIT": u.name,
    }
    if scratch:
        extra["HOLD_SCRATCH"] = scratch
    if isinstance(u, Unit) and u.notify is not None:
        extra["NOTIFY_SOCKET"] = u.notify.path.replace("\0", "@", 1)
    return minimal_env(st.environ, tree_id=u.tree_id, pass_names=u.spec.pass_env, extra=extra)


def _probe_starter(u: Unit) -> Callable[[tuple[str, ...]], Child]:
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
                cwd=u.cwd,
            )
        finally:
            os.close(devnull)

    return start


# ---------------------------------------------------------------------- as the run begins


def make_trees(st: StackState) -> None:
    """Each unit's cgroup leaf (or this process a subreaper), told to the caller
    (``on_tree_prepared``) before anything starts."""
    try:
        for u in st.every():
            u.leaf = st.containment.home(f"hold-{u.tree_id}")
        if st.on_tree_prepared is not None:
            for u in st.every():
                st.on_tree_prepared(u.name, u.tree_id, u.leaf)
    except CgroupUnavailable as e:
        remove_leaves(st)
        raise StackError([f"cgroups: {e}"], TOOL) from None
    except BaseException:
        remove_leaves(st)
        raise


def open_tasks(st: StackState) -> None:
    """Each task unit's runner; it takes the unit's log over."""
    if not st.tasks:
        return
    # Here, not at the top: the calls' machinery (and what it imports) is for a
    # stack with task units only, and a stack without them starts sooner and smaller.
    from hold_supervisor.task.task import TaskRunner

    for t in st.tasks.values():
        log, t.log = t.log, None  # the runner's from now on (it closes it)
        t.runner = TaskRunner(
            t.name,
            t.spec,
            env=t.env,
            argv=t.argv,
            leaf=t.leaf,
            log=log,
            on_end=functools.partial(_on_call_end, st),
            cwd=t.cwd,
        )


def _on_call_end(st: StackState, r: CallResult) -> None:
    """In the call's thread: say what went wrong (each call is in the unit's log)."""
    if r.outcome == "exited" and not r.survivors:
        return
    why = r.detail or r.outcome
    text = f"{r.unit}: call {r.call_id} {r.outcome} (exit {r.exit_code}, {r.wall:.2f}s)"
    if r.outcome != "exited":
        text += f": {why}"
    if r.survivors:
        text += f"; {len(r.survivors)} process(es) SURVIVED its stop"
    st.say(text)


def write_record(
    st: StackState, state: StackRunState, code: int | None = None, cause: str | None = None
) -> None:
    """``stack.json``: who runs the stack, from which file, and how it ended."""
    rec = StackRecord(
        st.name, os.getpid(), os.path.abspath(st.source), time.time(), state, code, cause
    )
    write_atomic(os.path.join(st.run_dir, "stack.json"), rec.encode())


# ---------------------------------------------------------------------- letting go


def remove_leaves(st: StackState) -> None:
    for u in st.every():
        try:
            st.containment.release(u.leaf)
        except OSError as e:
            st.say(f"{u.name}: cgroup leaf {leaf_path(u.leaf)} not removed: {e}")
        u.leaf = None


def release(st: StackState) -> None:
    """Let go of the stack's name (its lock), the logs, notify sockets and
    scratch directories that prepare() made (removed unless kept)."""
    for u in st.every():
        if u.log is not None:
            u.log.close()  # opened by prepare(); closing twice is nothing
        if isinstance(u, Unit):
            _let_go_of_files(st, u)
    if st.lock_fd >= 0:
        os.close(st.lock_fd)  # the flock goes with it
        st.lock_fd = -1


def _let_go_of_files(st: StackState, u: Unit) -> None:
    if u.notify is not None:
        u.notify.close()
        u.notify = None
    scratch, u.scratch = u.scratch, None
    if scratch is None:
        return
    if scratch.keep:
        st.say(f"{u.name}: scratch kept: {scratch.keep_it()}")
        return
    report = scratch.remove()
    if not report.clean:
        st.say(f"{u.name}: {report.describe()}")
