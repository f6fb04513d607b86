"""Start a program isolated from its first instruction.

What the child gets, and how:

* **its own session** (``setsid``) or, for interactive use, its own process
  group -- through ``posix_spawn`` attributes, so it is done before ``exec``;
* **its CPU mask**: affinity is per thread on Linux and inherited across
  ``fork``/``clone``. We set it on the *calling thread* just before the spawn
  and put the old mask back right after, so the child never runs an
  instruction on another CPU, and spawns from other threads (each setting its
  own thread's mask) cannot interfere. The child's mask is then verified from
  ``/proc/PID/status``;
* **descriptors 0, 1, 2 only** (plus any named): every inheritable descriptor
  of ours gets a close action; non-inheritable ones close at ``exec``;
* **its environment**, given whole (see :mod:`hold_supervisor.environ`);
* **its cgroup leaf**, when it has one: born there by
  ``clone3(CLONE_INTO_CGROUP)`` where this process is single-threaded and the
  kernel allows it (:mod:`hold_supervisor.spawn.intoleaf`: no RCU grace period, no
  shell); elsewhere a two-word ``/bin/sh`` stub writes its own pid into the
  leaf's ``cgroup.procs`` and then ``exec``\\ s the program, and spawn
  returns once it has. Either way the program's first instruction already
  runs inside the leaf, and the caller never sees the child outside it. (A
  ``preexec_fn`` is unsafe in a threaded parent.)

``posix_spawn`` (glibc: ``clone(CLONE_VM|CLONE_VFORK)``) rather than
``subprocess``: it reports ``exec`` failures synchronously, resets signal
dispositions in the child, and keeps ``hold run``'s start-up cheap.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import stat
import time
from collections.abc import Iterator, Mapping, Sequence

from hold_supervisor.errors import SupervisorError
from hold_supervisor.exitcodes import NOT_EXECUTABLE, NOT_FOUND, TOOL
from hold_supervisor.parse import format_cpus
from hold_supervisor.proc import scan, spawned
from hold_supervisor.proc.cgroup import Leaf
from hold_supervisor.proc.identity import Handle, ProcessId, read_stat
from hold_supervisor.spawn.intoleaf import ChdirFailed, clone_into

_CGROUP_STUB = 'echo $$ > "$0" || exit 125; exec "$@"'
# The shell sets and exports PWD itself; the child gets it only if the caller gave it.
_CGROUP_STUB_NO_PWD = 'echo $$ > "$0" || exit 125; unset PWD; exec "$@"'
# With a working directory: posix_spawn has no chdir action in Python (and a
# chdir in a threaded parent would move every thread), so the stub does it.
_CWD_STUB = 'cd -- "$0" || exit 125; exec "$@"'
_CWD_STUB_NO_PWD = 'cd -- "$0" || exit 125; unset PWD; exec "$@"'
_BOTH_STUB = 'echo $$ > "$0" || exit 125; cd -- "$1" || exit 125; shift; exec "$@"'
_BOTH_STUB_NO_PWD = (
    'echo $$ > "$0" || exit 125; cd -- "$1" || exit 125; shift; unset PWD; exec "$@"'
)

# Every signal a child should start with at its default disposition.
_ALL_SIGNALS = tuple(s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP))


class SpawnError(SupervisorError):
    """The program could not be started; ``exit_code`` is what a CLI should exit with."""

    def __init__(self, msg: str, exit_code: int) -> None:
        super().__init__(msg)
        self.exit_code = exit_code


def resolve(program: str, path: str | None, cwd: str | None = None) -> str:
    """Find ``program`` as ``execvp`` would with the *child's* PATH, from the
    child's working directory ``cwd`` (None: ours).

    Raises :class:`SpawnError` with 127 (not found) or 126 (not executable).
    """
    if "/" in program:
        candidates = [program]
    else:
        candidates = [os.path.join(d or ".", program) for d in (path or "").split(":")]
    if cwd is not None:
        candidates = [os.path.join(cwd, c) for c in candidates]
    denied: str | None = None
    for cand in candidates:
        try:
            st = os.stat(cand)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            denied = denied or f"{cand}: is a directory"
            continue
        if os.access(cand, os.X_OK):
            return cand
        denied = denied or f"{cand}: permission denied"
    if denied is not None:
        raise SpawnError(f"{program}: not executable ({denied})", NOT_EXECUTABLE)
    raise SpawnError(f"{program}: command not found", NOT_FOUND)


def owned_pids() -> frozenset[int]:
    """Our children that a spawn made and their owners have not reaped yet."""
    return spawned.pids()


class Child:
    """A spawned process and its one reaper.

    The caller owns it: exactly one of :meth:`wait`/:meth:`poll` collects the
    exit status, through the pidfd, so a reused pid can never be waited on.
    """

    __slots__ = ("argv", "cpus", "handle", "ident", "new_session", "returncode")

    def __init__(
        self,
        ident: ProcessId,
        handle: Handle,
        argv: tuple[str, ...],
        cpus: frozenset[int] | None,
        new_session: bool,
    ) -> None:
        self.ident = ident
        self.handle = handle
        self.argv = argv
        self.cpus = cpus
        self.new_session = new_session
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        return self.ident.pid

    @property
    def pidfd(self) -> int:
        """Readable once the child has exited (for select/poll)."""
        return self.handle.fd

    def poll(self) -> int | None:
        """The exit status if the child has exited (reaping it), else None."""
        if self.returncode is None:
            self._reap(os.WNOHANG)
        return self.returncode

    def collect(self, timeout: float = 1.0) -> int | None:
        """Reap a child that has been stopped: its status, or None if it has
        not exited within ``timeout`` (it may be a survivor)."""
        if self.returncode is None and self.poll() is None:
            poller = select.poll()
            poller.register(self.handle.fd, select.POLLIN)
            poller.poll(timeout * 1000)
            self.poll()
        return self.returncode

    def wait(self) -> int:
        """Block until the child exits; its status (negative signal number if killed)."""
        if self.returncode is None:
            self._reap(0)
        assert self.returncode is not None
        return self.returncode

    def _reap(self, flags: int) -> None:
        try:
            res = os.waitid(os.P_PIDFD, self.handle.fd, os.WEXITED | flags)
        except ChildProcessError:
            # Already reaped by someone else: a bug elsewhere, never a success.
            raise RuntimeError(f"pid {self.pid} was reaped behind its owner's back") from None
        if res is None:
            return
        if res.si_code == os.CLD_EXITED:
            self.returncode = res.si_status
        else:
            self.returncode = -res.si_status
        spawned.forget(self.pid)
        self.handle.close()

    def send_signal(self, sig: int) -> None:
        """Signal the child itself (never a process that reused its pid)."""
        if self.returncode is None:
            self.handle.send_signal(sig)


def close_actions(keep: set[int]) -> list[tuple[int, int]]:
    """A close action for every inheritable descriptor of ours not in ``keep``.

    Non-inheritable (close-on-exec) descriptors need none. glibc ignores a
    close action for a descriptor that another thread closed meanwhile.
    """
    actions: list[tuple[int, int]] = []
    for fd, _path in scan.fds("self"):
        if fd < 3 or fd in keep:
            continue
        try:
            if os.get_inheritable(fd):
                actions.append((os.POSIX_SPAWN_CLOSE, fd))
        except OSError:
            continue  # the listdir descriptor itself, or one closed meanwhile
    return actions


def read_cpus_allowed(pid: int) -> frozenset[int]:
    """The child's CPU mask as the kernel reports it in ``/proc/PID/status``."""
    line = scan.status_line(pid, b"Cpus_allowed_list:")
    if line is None:
        raise RuntimeError(f"pid {pid}: no Cpus_allowed_list")
    out: set[int] = set()
    for part in line.split(b":", 1)[1].strip().split(b","):
        lo, _, hi = part.partition(b"-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(out)


def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cpus: frozenset[int] | None = None,
    new_session: bool = True,
    stdin: int | None = None,
    stdout: int | None = None,
    stderr: int | None = None,
    pass_fds: Sequence[int] = (),
    cgroup: Leaf | None = None,
    cwd: str | None = None,
) -> Child:
    """Start ``argv`` isolated as the module docstring says; return its :class:`Child`.

    ``env`` is the child's whole environment. ``stdin``/``stdout``/``stderr``
    are descriptors to put at 0/1/2 (None: share ours). ``new_session`` False
    gives the child its own process group only (for an interactive command
    that must stay in the terminal's session). ``cpus`` None leaves the mask
    as the caller's; an empty set is refused. ``cwd``: the child's working
    directory (None: ours); a relative program is found from there.

    Raises :class:`SpawnError` (127/126 for a missing or non-executable
    program) before anything runs.
    """
    program = _checked(argv, env, cpus, cwd)
    actions = _fd_actions(stdin, stdout, stderr, pass_fds)
    # The pid is written down before anyone may ask whether it is an orphan
    # (see hold_supervisor.proc.spawned: a child can exit before spawn returns).
    with spawned.registering() as register, _pinned(cpus):
        try:
            pid = None
            if cgroup is not None:  # born in the leaf where the kernel allows it
                pid = clone_into(
                    cgroup.path, program, argv, env, actions, new_session=new_session, cwd=cwd
                )
            stub = pid is None and cgroup is not None
            if pid is None:
                pid = _posix_spawn(program, argv, env, actions, new_session, cgroup, cwd)
        except ChdirFailed as e:
            raise SpawnError(f"working directory {cwd}: {e.strerror}", TOOL) from None
        except FileNotFoundError:
            raise SpawnError(f"{argv[0]}: command not found", NOT_FOUND) from None
        except PermissionError:
            raise SpawnError(f"{argv[0]}: permission denied", NOT_EXECUTABLE) from None
        except OSError as e:
            raise SpawnError(f"{argv[0]}: {e.strerror}", NOT_EXECUTABLE) from None
        register(pid)
    # The child is ours and unreaped, so its pid cannot be reused yet: the
    # identity read here is the child's own.
    ident = ProcessId(pid, read_stat(pid).starttime)
    child = Child(ident, Handle.open(ident), tuple(argv), cpus, new_session)
    if stub:
        assert cgroup is not None
        _await_leaf(child, cgroup)
    if cpus is not None:
        _verify_mask(child, cpus)
    return child


# How long the stub has to write itself into the leaf (a shell's start, then
# one write): milliseconds; a stub stuck past this is killed.
_STUB_WAIT = 10.0


def _await_leaf(child: Child, leaf: Leaf) -> None:
    """Return once the stub has written ``child`` into ``leaf``, or has exited
    (its status says why: 125); else kill it and raise :class:`SpawnError`.

    ``posix_spawn`` returns once the stub's shell is exec'd, before the shell
    has run a line: until it has, the child is outside its leaf, and a stop
    of a tree that is its leaf (``hold run``'s, or the daemon's handoff of an
    emptied leaf) would find nobody and leave it to run on. Not reaped here:
    the caller collects its status."""
    deadline = time.monotonic() + _STUB_WAIT
    delay = 0.0002
    exited = select.poll()
    exited.register(child.handle.fd, select.POLLIN)  # a pidfd reads once the process exits
    while child.pid not in leaf.pids():
        if exited.poll(0):
            return
        if time.monotonic() >= deadline:
            child.send_signal(signal.SIGKILL)
            child.collect(_STUB_WAIT)
            raise SpawnError(
                f"{child.argv[0]}: its start did not reach the cgroup leaf {leaf.path} "
                f"within {_STUB_WAIT:g} s (killed)",
                TOOL,
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.005)


def _posix_spawn(
    program: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    actions: list[tuple[int, ...]],
    new_session: bool,
    cgroup: Leaf | None,
    cwd: str | None,
) -> int:
    """``posix_spawn`` of the program, or of the stub that gets it into ``cgroup``/``cwd``."""
    path, args = _exec_of(program, argv, env, cgroup, cwd)
    return os.posix_spawn(
        path,
        args,
        env,
        file_actions=actions,
        setsigmask=(),
        setsigdef=_ALL_SIGNALS,
        **({"setsid": True} if new_session else {"setpgroup": 0}),
    )


def _checked(
    argv: Sequence[str], env: Mapping[str, str], cpus: frozenset[int] | None, cwd: str | None
) -> str:
    """What is refused before anything runs; the program found (as ``execvp`` would)."""
    if not argv:
        raise SpawnError("no command given", 2)
    if cpus is not None and not cpus:
        raise SpawnError("empty CPU mask: refusing to start without pinning", 2)
    program = resolve(argv[0], env.get("PATH"), cwd)
    if cwd is not None and not os.path.isdir(cwd):
        raise SpawnError(f"working directory {cwd}: no such directory", 2)
    return program


def _fd_actions(
    stdin: int | None, stdout: int | None, stderr: int | None, pass_fds: Sequence[int]
) -> list[tuple[int, ...]]:
    """The child's descriptors: the three given at 0-2, ``pass_fds`` at their own
    numbers, every other inheritable one of ours closed."""
    actions: list[tuple[int, ...]] = []
    for target, fd in ((0, stdin), (1, stdout), (2, stderr)):
        if fd is not None:
            actions.append((os.POSIX_SPAWN_DUP2, fd, target))
    # dup2(fd, fd) clears close-on-exec (glibc >= 2.29), which is how a
    # named descriptor survives the exec at its own number.
    actions.extend((os.POSIX_SPAWN_DUP2, fd, fd) for fd in pass_fds)
    actions.extend(close_actions(set(pass_fds)))
    return actions


def _exec_of(
    program: str, argv: Sequence[str], env: Mapping[str, str], cgroup: Leaf | None, cwd: str | None
) -> tuple[str, list[str]]:
    """What to exec: the program itself, or the stub that joins the leaf and/or
    enters the working directory first and then execs it."""
    pwd = "PWD" in env
    if cgroup is not None and cwd is not None:
        stub = _BOTH_STUB if pwd else _BOTH_STUB_NO_PWD
        return "/bin/sh", ["sh", "-c", stub, cgroup.procs_file, cwd, *argv]
    if cgroup is not None:
        stub = _CGROUP_STUB if pwd else _CGROUP_STUB_NO_PWD
        return "/bin/sh", ["sh", "-c", stub, cgroup.procs_file, *argv]
    if cwd is not None:
        stub = _CWD_STUB if pwd else _CWD_STUB_NO_PWD
        return "/bin/sh", ["sh", "-c", stub, cwd, *argv]
    return program, list(argv)


@contextlib.contextmanager
def _pinned(cpus: frozenset[int] | None) -> Iterator[None]:
    """This thread on ``cpus`` (None: as it is) for the spawn, its mask back after."""
    if cpus is None:
        yield
        return
    saved = os.sched_getaffinity(0)
    try:
        try:
            os.sched_setaffinity(0, cpus)  # 0: this thread only
        except OSError as e:
            raise SpawnError(f"CPU mask {format_cpus(cpus)}: {e.strerror}", 2) from None
        # The kernel quietly drops CPUs that are offline or outside our
        # cpuset and pins to the rest; a mask naming one is refused instead.
        got = frozenset(os.sched_getaffinity(0))
        if got != cpus:
            raise SpawnError(
                f"CPU mask {format_cpus(cpus)}: CPU {format_cpus(cpus - got)} may not be used here",
                2,
            )
        yield
    finally:
        os.sched_setaffinity(0, saved)


def _verify_mask(child: Child, cpus: frozenset[int]) -> None:
    try:
        seen = read_cpus_allowed(child.pid)
    except OSError:
        return  # exited already; it could only have run on the mask it inherited
    # A program may narrow its own mask (OpenMP binding does); wider means
    # the mask we set did not take.
    if not seen <= cpus:
        child.send_signal(signal.SIGKILL)
        child.wait()
        raise SpawnError(
            f"CPU mask not applied: asked {format_cpus(cpus)}, child has {format_cpus(seen)}", TOOL
        )
