"""Process identity: a process is ``(pid, starttime)``, never a bare pid.

PIDs are reused (``pid_max`` is often 32768, and a busy machine wraps it in
minutes), so anything that holds on to a process across time keeps its start
time -- field 22 of ``/proc/PID/stat``, in clock ticks since boot -- and checks
it again before acting. Signals go through a pidfd, which pins the process the
moment it is opened: once the start time is confirmed on an open pidfd, a
later reuse of the number cannot redirect the signal.

This module parses ``/proc`` directly instead of going through psutil: it sits
on the hot path of every stop and every survivor check, and one ``read`` of a
small file is all it needs.
"""

from __future__ import annotations

import os
import pwd
import select
import signal
from typing import NamedTuple

from hold_supervisor.errors import SupervisorError

_PF_EXITING = 0x4
_PF_KTHREAD = 0x00200000


class NoSuchProcess(SupervisorError):
    """The process is gone, or the pid now names a different process."""

    def __init__(self, pid: int, msg: str = "no such process") -> None:
        super().__init__(f"pid {pid}: {msg}")
        self.pid = pid


class AccessDenied(SupervisorError):
    """The process exists but this user may not inspect or signal it."""

    def __init__(self, pid: int, msg: str = "access denied") -> None:
        super().__init__(f"pid {pid}: {msg}")
        self.pid = pid


class Stat(NamedTuple):
    """The fields of ``/proc/PID/stat`` that process control needs."""

    pid: int
    comm: str
    state: str
    ppid: int
    pgrp: int
    session: int
    starttime: int
    flags: int = 0  # the kernel's PF_* flags of the task
    # Where its environment ends in its memory (field 51, Linux 3.5+). 0 for a
    # task with no memory of its own (kernel thread, exiting, zombie), for one
    # this user may not ptrace, and for one in the middle of an execve.
    env_end: int = 0

    @property
    def is_dead(self) -> bool:
        """Zombie or dead: holds nothing and runs nothing, only waits to be reaped."""
        return self.state in ("Z", "X", "x")

    @property
    def is_stopped(self) -> bool:
        """Stopped by a signal (``T``) or its tracer (``t``): it runs no instruction,
        so it forks no child and its list of children changes only by their exits."""
        return self.state in ("T", "t")

    @property
    def is_exiting(self) -> bool:
        """In its exit (``PF_EXITING``): already out of its cgroup, not yet a zombie."""
        return bool(self.flags & _PF_EXITING)

    @property
    def in_exec(self) -> bool:
        """Between the two halves of an execve: its new memory has no arguments
        or environment yet (``/proc/PID/environ`` reads empty), though its parent
        may already have seen the exec succeed (see
        :func:`hold_supervisor.proc.scan.environ`). Meaningful only for a process
        this user may ptrace, which is what reading its environment needs."""
        return (
            self.env_end == 0 and not self.is_dead and not self.flags & (_PF_EXITING | _PF_KTHREAD)
        )


def parse_stat(pid: int, data: bytes) -> Stat:
    # comm is in parentheses and may itself contain spaces and ')', so split
    # at the *last* ')'.
    head, _, rest = data.rpartition(b")")
    comm = head.partition(b"(")[2].decode("utf-8", "replace")
    f = rest.split()
    # rest starts at field 3 (state); field N is f[N - 3].
    return Stat(
        pid=pid,
        comm=comm,
        state=f[0].decode(),
        ppid=int(f[1]),
        pgrp=int(f[2]),
        session=int(f[3]),
        starttime=int(f[19]),
        flags=int(f[6]),
        env_end=int(f[48]) if len(f) > 48 else 1,
    )


def read_stat(pid: int) -> Stat:
    """Read ``/proc/PID/stat``: the one reader of it (:func:`hold_supervisor.proc.scan.stat_of`
    is this with None for "gone or unreadable").

    Raises :class:`NoSuchProcess` if there is none, :class:`AccessDenied` if it
    may not be read. Plain system calls rather than a file object: a scan runs
    this once per process on the machine, and the buffered reader costs a
    fifth more.
    """
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, ProcessLookupError):
        raise NoSuchProcess(pid) from None
    except PermissionError:
        raise AccessDenied(pid) from None
    try:
        data = os.read(fd, 4096)
    except ProcessLookupError:
        raise NoSuchProcess(pid) from None
    except PermissionError:
        raise AccessDenied(pid) from None
    finally:
        os.close(fd)
    if not data:
        raise NoSuchProcess(pid)
    return parse_stat(pid, data)


def user_name(uid: int) -> str:
    """The login name of ``uid``, or the number itself where it has none."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def read_cmdline(pid: int) -> str:
    """The command line as one string, or ``[comm]`` for kernel threads and zombies."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError):
        raise NoSuchProcess(pid) from None
    except PermissionError:
        raise AccessDenied(pid) from None
    if raw:
        return raw.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")
    return f"[{read_stat(pid).comm}]"


class ProcessId(NamedTuple):
    """The identity of one process: its pid and its start time (clock ticks since boot)."""

    pid: int
    starttime: int

    @classmethod
    def of(cls, pid: int) -> ProcessId:
        """The identity of the process that has ``pid`` now."""
        return cls(pid, read_stat(pid).starttime)

    def matches(self) -> bool:
        """True while ``pid`` still names this same process (and it has not been reaped)."""
        try:
            return read_stat(self.pid).starttime == self.starttime
        except (NoSuchProcess, AccessDenied):
            return False

    def is_running(self) -> bool:
        """True while this process exists and is not a zombie."""
        try:
            st = read_stat(self.pid)
        except (NoSuchProcess, AccessDenied):
            return False
        return st.starttime == self.starttime and not st.is_dead

    def wait_gone(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until this process has exited; True once it has
        (a zombie has), False if it still runs or may not be looked at."""
        try:
            h = self.open()
        except NoSuchProcess:
            return True
        except AccessDenied:
            return False
        with h:
            return bool(select.select([h.fd], [], [], timeout)[0])

    def open(self) -> Handle:
        """Pin this process with a pidfd; raises :class:`NoSuchProcess` if it is gone."""
        return Handle.open(self)

    def send_signal(self, sig: int) -> None:
        """Signal this process, and never another one that has reused its pid.

        Raises :class:`NoSuchProcess` if the process is gone (or the pid was
        reused), :class:`AccessDenied` if this user may not signal it.
        """
        with self.open() as h:
            h.send_signal(sig)

    def __str__(self) -> str:
        return f"{self.pid}@{self.starttime}"


class Handle:
    """An open pidfd on a process whose identity was confirmed after opening.

    The order matters: open the pidfd first, *then* compare the start time.
    If the start time matches, the pidfd refers to the right process, because
    a pidfd never follows a pid to a new process.
    """

    __slots__ = ("fd", "ident")

    def __init__(self, ident: ProcessId, fd: int) -> None:
        self.ident = ident
        self.fd = fd

    @classmethod
    def open(cls, ident: ProcessId) -> Handle:
        try:
            fd = os.pidfd_open(ident.pid)
        except ProcessLookupError:
            raise NoSuchProcess(ident.pid) from None
        try:
            st = read_stat(ident.pid)
        except BaseException:
            os.close(fd)
            raise
        if st.starttime != ident.starttime:
            os.close(fd)
            raise NoSuchProcess(
                ident.pid, f"pid reused (start time {st.starttime}, expected {ident.starttime})"
            )
        return cls(ident, fd)

    def send_signal(self, sig: int) -> None:
        try:
            signal.pidfd_send_signal(self.fd, sig)
        except ProcessLookupError:
            raise NoSuchProcess(self.ident.pid, "exited") from None
        except PermissionError:
            raise AccessDenied(self.ident.pid, "may not signal") from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
