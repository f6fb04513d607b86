"""The keeper: without a cgroup, what ends a tree whose launcher was SIGKILLed.

In walk mode the launcher (``hold run``, ``npu-hold``, ``hold up``) is the
child subreaper of its trees: an orphan of a tree (a double-forked, ``setsid``
escapee) is re-parented to it, so the walk finds it whatever it did to its
environment. Kill the launcher with SIGKILL and that ends: the orphans go to
the next subreaper up, or to init, and a descendant that cleared ``HOLD_TREE``
can be found by nobody (the daemon included, which knows the tree by its
marker and its root).

So before its first spawn the launcher splits in two (:func:`split`): this
process (the pid the shell knows) stays behind as the **keeper**, a second
child subreaper *above* the launcher, and the launcher goes on in a new child.
The keeper holds nothing (every descriptor but 0-2 closed: the daemon's
connection, the lifeline, stays the launcher's alone), forwards the signals
it is sent, mirrors a job-control stop, and waits. When the launcher ends:

* normally (it stopped its trees and said so): the keeper exits with its
  status; anything still re-parented to the keeper (a survivor the launcher
  reported) is killed on the way;
* by a signal (SIGKILL): everything below it -- the trees, and every orphan
  the kernel now hands to the keeper -- is ended, TERM then KILL after the
  run's grace, and the keeper exits 128+N.

Killing the keeper instead (``kill -9 PID`` of the command the shell knows)
sends the launcher SIGTERM (``PR_SET_PDEATHSIG``), which stops its trees as
any stop signal does. What is still lost: both killed in the same instant by
someone who knows both pids (the keeper renames itself ``hold-keeper``, so
``pkill npu-hold`` finds the launcher only). A cgroup has no such limit.

Only a single-threaded process may split (``fork`` copies one thread);
:func:`split` declines otherwise.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from collections.abc import Callable

from hold_supervisor.proc import scan
from hold_supervisor.proc.reaper import become_subreaper, is_subreaper

PR_SET_NAME = 15
PR_GET_NAME = 16
PR_SET_PDEATHSIG = 1
NAME = b"hold-keeper"
FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGQUIT)
KILL_WAIT = 5.0  # after SIGKILL, how long the keeper waits for its descendants to go
LOOK = 0.02  # between looks at what is left while ending them


def split(grace: float, spare: Callable[[], set[int]] = set) -> bool:
    """Split off a keeper (this process stays it, and never returns); True in
    the launcher, which goes on. False, and nothing done, where this process
    has more than one thread. ``grace``: between TERM and KILL when the keeper
    ends what its launcher left. ``spare``: asked then, the pids the keeper
    must leave alone with all below them, though they came to it (a ticket
    daemon the launcher started while the keeper was a subreaper: it detaches
    by a double fork, and is re-parented here)."""
    if threading.active_count() > 1:
        return False
    keeper = os.getpid()
    launcher_reaps = is_subreaper()  # the flag is not inherited across fork: kept by hand
    libc = ctypes.CDLL(None, use_errno=True)
    # Before the fork: the launcher's orphans must have somewhere to go from
    # its first instant; and the keeper has its name by then, or whoever sees
    # the launcher's first command could still find the keeper under the
    # launcher's name (renamed after the fork, a loaded machine let a shell
    # started by the launcher answer first). The launcher takes its name back.
    become_subreaper()
    name = _own_name(libc)
    libc.prctl(PR_SET_NAME, ctypes.c_char_p(NAME), 0, 0, 0)
    try:
        pid = os.fork()
    except BaseException:
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
        raise
    if pid == 0:
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
        become_subreaper(launcher_reaps)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != keeper:  # the keeper died before the prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)
        return True
    try:
        _keep(pid, grace, spare)
    finally:
        os._exit(125)  # never back into the caller's code (its finalisers are the launcher's)


def _own_name(libc: ctypes.CDLL) -> bytes:
    """This process's name (``comm``, at most 15 bytes), as ``PR_SET_NAME`` takes it."""
    buf = ctypes.create_string_buffer(16)
    libc.prctl(PR_GET_NAME, buf, 0, 0, 0)
    return buf.value


def _keep(launcher: int, grace: float, spare: Callable[[], set[int]]) -> None:
    signal.set_wakeup_fd(-1)  # the launcher's wakeup pipe, about to be closed here
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.closerange(3, _fd_limit())

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(launcher, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    status = _wait_launcher(launcher)
    if os.WIFSIGNALED(status):
        _end_descendants(grace, spare)
        os._exit(128 + os.WTERMSIG(status))
    _end_descendants(0.0, spare)
    os._exit(os.waitstatus_to_exitcode(status))


def _wait_launcher(launcher: int) -> int:
    """The launcher's wait status once it has ended. A job-control stop is
    mirrored: the shell watches the keeper, so the job shows stopped, and ``fg``
    continues both. Only then: a launcher stopped by someone else (SIGSTOP to
    its pid) must not leave the keeper stopped for good."""
    while True:
        pid, status = os.waitpid(-1, os.WUNTRACED)
        if pid != launcher:
            continue  # an orphan re-parented to us once the launcher is gone
        if os.WIFSTOPPED(status):
            if not _job_in_foreground():
                continue
            os.kill(os.getpid(), signal.SIGSTOP)
            try:
                os.kill(launcher, signal.SIGCONT)
            except ProcessLookupError:
                pass
            continue
        return status


def _job_in_foreground() -> bool:
    """Whether the keeper's process group has the terminal (the launcher hands it
    back before it stops itself at a Ctrl-Z)."""
    try:
        return os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False


def _end_descendants(grace: float, spare: Callable[[], set[int]]) -> None:
    """Every process below the keeper ended: TERM, ``grace``, then KILL; reaped.

    One it may not signal (a setuid program of another user) is left alone: the
    launcher's survivor check named it already, or cannot have, and waiting
    would not change it."""
    if not _reap():
        return  # no child, so nothing below: the usual end, no look at /proc
    me = os.getpid()
    deadline = time.monotonic() + grace
    signum = signal.SIGTERM if grace > 0 else signal.SIGKILL
    told: set[int] = set()
    cannot: set[int] = set()
    give_up = deadline + KILL_WAIT
    while _reap() and time.monotonic() < give_up:
        procs = scan.snapshot()
        spared = {p for p in spare() if p in procs}
        below = scan.descendants([me], procs) - spared - scan.descendants(spared, procs) - cannot
        if not below:
            return
        if signum == signal.SIGTERM and time.monotonic() >= deadline:
            signum = signal.SIGKILL
            told.clear()
        for pid in below - told:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
            except PermissionError:
                cannot.add(pid)
        told |= below
        time.sleep(LOOK)


def _reap() -> bool:
    """Reap whatever child has exited; False once the keeper has no child left."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def _fd_limit() -> int:
    try:
        return os.sysconf("SC_OPEN_MAX")
    except (ValueError, OSError):
        return 1024
