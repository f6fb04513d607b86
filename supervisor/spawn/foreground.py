"""Run one command in the foreground until it ends, then stop all it started.

This is ``hold run`` without the CLI: ``timeout(1)`` semantics (exit 124 at
the time limit; signals forwarded), plus a stop of the whole tree with the
survivor check on every way out. A caller composes it with other things to
watch (``hold`` adds the lease's connection to the daemon) through ``extra``.

Waiting is one ``poll`` over the child's pidfd (readable when it exits), the
signal wakeup descriptor, and the caller's descriptors, with the time limit
as the poll timeout: nothing wakes up periodically.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import NamedTuple

from hold_supervisor.cause import Cause
from hold_supervisor.exitcodes import EXPIRED, SURVIVORS, signalled
from hold_supervisor.proc import cgroup as cg
from hold_supervisor.proc.identity import ProcessId
from hold_supervisor.proc.reaper import is_subreaper
from hold_supervisor.proc.stop import StopReport, stop_tree
from hold_supervisor.proc.tree import Tree
from hold_supervisor.sigwake import drain, signals_to_pipe
from hold_supervisor.spawn.child import Child, owned_pids, spawn
from hold_supervisor.spawn.containment import Containment, WalkContainment, first_home

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


class RunResult(NamedTuple):
    exit_code: int
    cause: Cause
    returncode: int | None  # the command's own status (negative: killed by that signal)
    report: StopReport


# Called with the descriptor that became readable; returns a cause to stop, or None.
Extra = Callable[[int], Cause | None]


def is_foreground_tty(fd: int = 0) -> bool:
    """True when ``fd`` is a terminal whose foreground process group is ours."""
    try:
        return os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False


class Foreground:
    """One command, run to its end; see the module docstring.

    ``interactive``: the command gets its own process group in our session
    and the terminal's foreground (so a shell keeps Ctrl-C and job control,
    as under ``timeout --foreground``); otherwise its own session.
    ``containment``: where the tree lives (:func:`~hold_supervisor.spawn.containment.choose`);
    default the walk of /proc. Either way this process becomes a child subreaper.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        tree_id: str,
        cpus: frozenset[int] | None = None,
        timeout: float | None = None,
        grace: float = 10.0,
        stop_signal: int = signal.SIGTERM,
        containment: Containment | None = None,
        interactive: bool = False,
    ) -> None:
        self.argv = list(argv)
        self.env = env
        self.tree_id = tree_id
        self.cpus = cpus
        self.timeout = timeout
        self.grace = grace
        self.stop_signal = stop_signal
        self.containment = containment if containment is not None else WalkContainment()
        self.interactive = interactive
        self.leaf: cg.Leaf | None = None
        self.child: Child | None = None
        self.tree: Tree | None = None
        self.started = 0.0
        self._prepared = False
        self._ran = False

    @contextlib.contextmanager
    def until_run(self) -> Iterator[None]:
        """The prepared leaf's lifetime as a scope: on the way out of it, however,
        the leaf is removed unless :meth:`run` took it over (run removes it itself)."""
        try:
            yield
        finally:
            if not self._ran:
                self.discard()

    def prepare(self, mode: str = "auto") -> cg.Leaf | None:
        """Create the tree's home (a cgroup leaf, or none) before the spawn; the caller
        may register it. ``mode``: the configured ``cgroups:``; under ``auto`` a leaf
        that cannot be made gives way to the walk (:func:`first_home`), under
        ``required`` :class:`~hold_supervisor.proc.cgroup.CgroupUnavailable` says why."""
        self._prepared = True
        # Signals wait until the leaf is written down here: a handler that
        # raises (hold run's SIGTERM) between the mkdir and that would leave a
        # leaf that no scope of ours removes (once in 8 suites on a busy host,
        # a waiter stopped as it was granted).
        held = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        try:
            self.containment, self.leaf = first_home(self.containment, f"hold-{self.tree_id}", mode)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        return self.leaf

    def discard(self) -> None:
        """Undo :meth:`prepare` when the command will not be run after all."""
        self._remove_leaf()
        self.leaf = None

    def run(
        self,
        extra: Mapping[int, Extra] | None = None,
        on_started: Callable[[Tree], None] | None = None,
    ) -> RunResult:
        """Spawn, wait for the first way out, stop the tree, report.

        Raises :class:`~hold_supervisor.spawn.child.SpawnError` if the command cannot
        start (nothing is left running then).
        """
        with self._signals_taken() as wake_r:
            if not self._prepared:
                self.prepare()
            try:
                child = self._spawn()
            except BaseException:
                self._remove_leaf()
                raise
            # Only now is the leaf ours to remove (below): a signal whose handler
            # raises (hold run's, until ours are taken) can come before, and then
            # the caller's scope (:meth:`until_run`) must still remove it. Once
            # in 8 soaked suites a waiter SIGTERMed as it was granted left it.
            self._ran = True
            self.child = child
            self.tree = tree = Tree(
                tree_id=self.tree_id,
                root=child.ident,
                pgid=child.pid,
                sid=child.pid if not self.interactive else None,
                leaf=self.leaf,
                adopts_orphans=True,  # the only tree of this subreaper (Containment.home)
                owned=owned_pids(),
                # Spawned into its leaf (if any): its looks read the leaf, not every process.
                born_in_leaf=True,
                # Without one, they read what lives below this subreaper (a
                # process that is none would lose orphans to init: all of /proc).
                subtree_of=ProcessId.of(os.getpid()) if is_subreaper() else None,
            )
            if self.interactive:
                self._give_terminal(child.pid)
            if on_started is not None:
                on_started(tree)
            cause = self._wait(child, wake_r, dict(extra or {}))
            sig = cause.signal if cause.kind == "signal" and cause.signal else self.stop_signal
            tree.owned = owned_pids()
            report = stop_tree(tree, sig=sig, grace=self.grace)
            returncode = child.collect()
            if self.interactive:
                self._give_terminal(os.getpgrp())
            self._remove_leaf()
        return RunResult(_status(report, cause, returncode), cause, returncode, report)

    def _signals_taken(self) -> contextlib.AbstractContextManager[int]:
        """The forwarded signals and SIGCHLD on a wakeup pipe (its read end given);
        SIGTTOU ignored when interactive (we hand the terminal back and forth)."""
        ignore = (signal.SIGTTOU,) if self.interactive else ()
        return signals_to_pipe((*FORWARDED, signal.SIGCHLD), ignore=ignore)

    def _spawn(self) -> Child:
        self.started = time.monotonic()
        return spawn(
            self.argv,
            env=self.env,
            cpus=self.cpus,
            new_session=not self.interactive,
            cgroup=self.leaf,
        )

    def _wait(self, child: Child, wake: int, extra: Mapping[int, Extra]) -> Cause:
        poller = select.poll()
        poller.register(child.pidfd, select.POLLIN)
        poller.register(wake, select.POLLIN)
        for fd in extra:
            poller.register(fd, select.POLLIN)
        deadline = None if self.timeout is None else self.started + self.timeout
        while True:
            wait_ms = None
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return Cause("expired", detail=f"time limit of {self.timeout:g}s reached")
                wait_ms = left * 1000
            # The others' word first: whoever ends the run from outside (a ticket
            # daemon's release or expiry) says why before it stops the command, so
            # when both are ready in one poll -- we ran late -- the exit is the
            # consequence, and the reason is what the caller must get.
            for fd, _ in sorted(poller.poll(wait_ms), key=lambda r: r[0] not in extra):
                if fd == child.pidfd:
                    if child.poll() is not None:
                        return Cause("exited")
                elif fd == wake:
                    for signum in drain(wake):
                        if signum == signal.SIGCHLD:
                            self._on_sigchld(child)
                        elif signum in FORWARDED:
                            return Cause("signal", signal.Signals(signum).name, signal=signum)
                elif fd in extra:
                    cause = extra[fd](fd)
                    if cause is not None:
                        return cause

    def _on_sigchld(self, child: Child) -> None:
        self.containment.reap_orphans(owned_pids())
        if not self.interactive:
            return
        # The command was stopped from the terminal (Ctrl-Z): like a shell,
        # take the terminal back and stop ourselves, so the shell above us
        # sees the job stopped; when continued, hand it back and continue it.
        try:
            res = os.waitid(os.P_PIDFD, child.pidfd, os.WSTOPPED | os.WNOHANG)
        except ChildProcessError:
            return
        if res is None or res.si_code != os.CLD_STOPPED:
            return
        self._give_terminal(os.getpgrp())
        os.kill(os.getpid(), signal.SIGSTOP)
        self._give_terminal(child.pid)
        try:
            os.killpg(child.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def _give_terminal(self, pgid: int) -> None:
        try:
            os.tcsetpgrp(0, pgid)
        except OSError:
            return
        if pgid != os.getpgrp():
            # It may have stopped on SIGTTIN before it had the terminal.
            try:
                os.killpg(pgid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def _remove_leaf(self) -> None:
        self.containment.release(self.leaf)


def _status(report: StopReport, cause: Cause, returncode: int | None) -> int:
    """hold run's exit status: survivors first, then the time limit, then the command's."""
    if report.survivors:
        return SURVIVORS
    if cause.kind == "expired":
        return EXPIRED
    if returncode is None:
        return SURVIVORS
    return signalled(-returncode) if returncode < 0 else returncode
