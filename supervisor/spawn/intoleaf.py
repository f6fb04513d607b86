"""Start a program born inside its cgroup leaf: ``clone3(CLONE_INTO_CGROUP)``.

Why: moving a process into a cgroup afterwards (a write to ``cgroup.procs``,
what the ``/bin/sh`` stub of :mod:`hold_supervisor.spawn.child` does) takes the cgroup
threadgroup lock for writing, and on a kernel without ``favordynmods`` that
waits for an RCU grace period: 6 ms on an idle 2-core machine, 10-20 ms under
load -- the largest single cost of ``npu-hold -- true``. A child created with
``CLONE_INTO_CGROUP`` (Linux 5.7) is attached during ``clone3`` under the read
side of that lock: no grace period, and no shell to exec either.

Python 3.11 has no ``clone3`` and glibc wraps it only from 2.39
(``pidfd_spawn``), so the syscall goes through ``ctypes``. Without
``CLONE_VM`` the child is a copy of this process, like ``fork()`` without
Python's after-fork hooks; that is sound only where those hooks would have
nothing to do, so this path is taken only when the caller is the main thread
of a single-threaded process (no other thread can hold a lock the child would
inherit held). Elsewhere -- and wherever the kernel or a seccomp filter
refuses ``clone3`` -- :func:`clone_into` returns None and the caller uses the
stub.

The child runs a few lines of Python and then ``execve``: every signal not at its
default disposition put back to it, its session or process group, its descriptors, its
working directory, an empty signal mask -- what ``posix_spawn`` is asked for
on the stub path. An ``exec`` failure comes back over a close-on-exec pipe, so
it is reported synchronously, as ``posix_spawn`` reports it.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import os
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, NoReturn

from hold_supervisor.proc import scan

_SYS_CLONE3 = 435  # the same number on every Linux architecture (the generic syscall table)
_CLONE_INTO_CGROUP = 0x200000000
_FIELDS = (
    "flags",
    "pidfd",
    "child_tid",
    "parent_tid",
    "exit_signal",
    "stack",
    "stack_size",
    "tls",
    "set_tid",
    "set_tid_size",
    "cgroup",
)
_ALL_SIGNALS = tuple(s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP))

# Why clone3 cannot be used in this process, once the kernel has said so
# (ENOSYS: too old or filtered; E2BIG/EINVAL: no CLONE_INTO_CGROUP).
_refused: int | None = None
_syscall: Callable[..., int] | None = None


class _Exec(NamedTuple):
    """What the child does between the clone and the program (built in the parent)."""

    path: str
    argv: Sequence[str]
    env: Mapping[str, str]
    actions: Sequence[tuple[int, ...]]
    new_session: bool
    cwd: str | None
    resets: Sequence[int]  # signals to put back to SIG_DFL


class ChdirFailed(OSError):
    """The child could not enter its working directory (nothing was executed)."""


def clone_into(
    leaf: str,
    path: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    actions: Sequence[tuple[int, ...]],
    *,
    new_session: bool,
    cwd: str | None,
) -> int | None:
    """Start ``path`` with ``argv`` and ``env`` inside the cgroup directory ``leaf``.

    ``actions`` are ``posix_spawn`` file actions (``POSIX_SPAWN_DUP2`` and
    ``POSIX_SPAWN_CLOSE``), done in order. Returns the child's pid; None if
    this path cannot be taken here (see the module docstring: the caller uses
    its stub). Raises :class:`OSError` from ``execve`` (the child is reaped
    then) and :class:`ChdirFailed` if ``cwd`` could not be entered.
    """
    if _refused is not None or not _single_threaded():
        return None
    call = _clone3()
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    try:
        dirfd = os.open(leaf, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        os.close(err_r)
        os.close(err_w)
        return None  # the stub says why, as it always has
    # Those not at their default already, as Python knows them (it read every
    # disposition at start-up, an inherited SIG_IGN included): a sigaction per
    # signal in the child would be 0.3 ms of every spawn.
    resets = [s for s in _ALL_SIGNALS if signal.getsignal(s) != signal.SIG_DFL]
    what = _Exec(path, argv, env, actions, new_session, cwd, resets)
    pid = _fork_into(call, dirfd, err_w, what)
    if pid is None:
        os.close(err_r)
        return None
    return _exec_outcome(pid, err_r)


def _fork_into(call: Callable[..., int], dirfd: int, err_w: int, what: _Exec) -> int | None:
    """The clone itself, every signal blocked around it; the pid, or None if refused."""
    global _refused

    struct = (ctypes.c_uint64 * len(_FIELDS))()
    struct[_FIELDS.index("flags")] = _CLONE_INTO_CGROUP
    struct[_FIELDS.index("exit_signal")] = signal.SIGCHLD
    struct[_FIELDS.index("cgroup")] = dirfd
    old = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    try:
        # Blocking runs any Python handler already due *here*, in the parent
        # (pthread_sigmask checks for them); once blocked, no handler can be
        # tripped before the child has reset them all to SIG_DFL.
        signal.pthread_sigmask(signal.SIG_BLOCK, _ALL_SIGNALS)
        size = ctypes.c_size_t(ctypes.sizeof(struct))
        pid = call(ctypes.c_long(_SYS_CLONE3), ctypes.byref(struct), size)
        if pid == 0:
            _child(err_w, what)
        err = ctypes.get_errno()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        os.close(dirfd)
        os.close(err_w)
    if pid < 0:
        if err in (_errno.ENOSYS, _errno.E2BIG, _errno.EINVAL):
            _refused = err
        return None
    return int(pid)


def _exec_outcome(pid: int, err_r: int) -> int | None:
    """Wait until the child has exec'd or failed; its pid, or None if it never ran.

    The child writes ``r`` first thing, then nothing if its ``exec`` works
    (the pipe closes with it) or why it failed. No ``r`` means it was killed
    before it ran: this kernel (6.18) SIGKILLs a child cloned into a cgroup
    that was ever emptied by ``cgroup.kill`` (the kill sequence it compares
    is the parent's cgroup's) -- a stopped unit's leaf used again. Then the
    caller uses the stub, which joins the leaf by a write instead.
    """
    try:
        msg = b""
        while True:
            chunk = os.read(err_r, 64)
            if not chunk:
                break
            msg += chunk
    finally:
        os.close(err_r)
    if msg == b"r":
        return pid
    os.waitpid(pid, 0)  # it exited (or was killed) without running the program: reaped
    if not msg:
        return None
    stage, _, code = msg[1:].decode().partition(":")
    err = int(code or 0)
    if stage == "chdir":
        raise ChdirFailed(err, os.strerror(err))
    raise OSError(err, os.strerror(err))


def _child(err_w: int, what: _Exec) -> NoReturn:
    """In the new process: set up as ``posix_spawn`` would, then exec; never returns."""
    stage = "setup"
    try:
        os.write(err_w, b"r")  # it runs: see _exec_outcome
        for sig in what.resets:
            signal.signal(sig, signal.SIG_DFL)
        if what.new_session:
            os.setsid()
        else:
            os.setpgid(0, 0)
        for act in what.actions:
            if act[0] == os.POSIX_SPAWN_DUP2:
                if act[1] == act[2]:
                    os.set_inheritable(act[1], True)  # dup2(fd, fd) would keep close-on-exec
                else:
                    os.dup2(act[1], act[2])
            elif act[0] == os.POSIX_SPAWN_CLOSE:
                try:
                    os.close(act[1])
                except OSError:
                    pass
        if what.cwd is not None:
            stage = "chdir"
            os.chdir(what.cwd)
        stage = "exec"
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        os.execve(what.path, list(what.argv), what.env)
    except BaseException as e:  # whatever it was, the parent hears of it
        code = e.errno if isinstance(e, OSError) and e.errno else 0
        try:
            os.write(err_w, f"{stage}:{code}".encode())
        except BaseException:
            pass
    finally:
        os._exit(127)


def _single_threaded() -> bool:
    """Whether this is the main thread of a process with no other thread
    (C threads included: the kernel's count, not :mod:`threading`'s)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        return scan.thread_count("self") == 1
    except OSError:
        return False


def _clone3() -> Callable[..., int]:
    """libc's ``syscall``, loaded once (ctypes costs ~1.4 ms to import: only here)."""
    global _syscall
    if _syscall is None:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syscall
        fn.restype = ctypes.c_long
        _syscall = fn
    return _syscall


def preload() -> None:
    """Load what a clone needs (``ctypes``, ~1.5-3 ms) now, off the spawn's path:
    ``npu-hold`` calls this while the daemon checks the device it asked for."""
    if _refused is None:
        _clone3()
