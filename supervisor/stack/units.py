"""The unit model of a running stack: a service :class:`Unit` (its state, child, tree,
output pipes and log), a :class:`TaskUnit` (its tree and the runner of its calls),
what ``ps`` and the live table show of a unit, and the small process helpers that the
run loop and the stop share (peek at an exit, reap, drain a wakeup pipe)."""

from __future__ import annotations

import os
import signal
import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from hold_supervisor.parse import format_cpus
from hold_supervisor.proc.cgroup import Leaf
from hold_supervisor.proc.tree import Tree
from hold_supervisor.sigwake import drain as drain  # the wakeup pipes of jobs and units
from hold_supervisor.spawn.child import Child
from hold_supervisor.stack import readiness
from hold_supervisor.stack.eventtypes import Outcome
from hold_supervisor.stack.liveness import Liveness
from hold_supervisor.stack.notify import NotifySocket
from hold_supervisor.stackfile.spec import UnitSpec
from hold_supervisor.states import UnitState
from hold_supervisor.unitlog import RotatingLog

if TYPE_CHECKING:
    from hold_supervisor.spawn.scratch import Scratch  # imported only for a unit that has one
    from hold_supervisor.task.task import TaskRunner  # imported by open_tasks, for task units only

TAIL = 20  # output lines kept per unit for messages


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
        # Spawned by the main thread before the run had a thread (its job takes it
        # over): the child, or the outcome of a spawn that failed.
        self.first: Child | Outcome | None = None
        self.log: RotatingLog | None = None
        self.out_r = self.out_w = -1  # stdout's pipe
        self.err_r = self.err_w = -1  # stderr's pipe
        self.wake_r = self.wake_w = -1
        self.reader: threading.Thread | None = None
        self.reader_stop = threading.Event()
        # Held by the reader while it takes lines and hands them on: whoever
        # waits for the tail to catch up (unitoutput.catch_up) waits for that too.
        self.reading = threading.Lock()
        self.cwd: str | None = None  # absolute, filled at prepare
        self.scratch: Scratch | None = None
        self.notify: NotifySocket | None = None
        self.spawned_once = False  # "started" for what waits on it
        self.final = False  # ended for good (no restart left); only a non-essential one stays
        self.liveness: Liveness | None = None
        self.live = ""  # the liveness check's last word, for ps
        self.unhealthy = ""  # why liveness stopped it (its exit then is a failure)

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
        """The unit as ``hold ps`` shows it."""
        since = (
            self.ready_at if self.state is UnitState.READY and self.ready_at else self.spawned_at
        )
        return {
            "unit": self.name,
            "kind": self.spec.kind,
            "essential": self.spec.essential,
            "state": self.state,
            "pid": self.pid,
            "port": self.port,
            "restarts": self.total_restarts,
            "uptime": round(now - since, 3) if self.pid is not None and since else None,
            "cpus": format_cpus(self.spec.cpus) if self.spec.cpus else "",
            "ready": self._ready_text(),
            "liveness": self.live,
            "detail": self.detail,
            "last_line": self.last_line,
            "tree": self.tree_id,
        }

    def stop_watching(self) -> None:
        """No more liveness checks of the unit's current process."""
        watcher, self.liveness = self.liveness, None
        if watcher is not None:
            watcher.close()

    def _ready_text(self) -> str:
        if self.spec.kind == "oneshot":
            return "when it exits 0"
        return self.spec.ready.describe() if self.spec.ready else "at start"

    def settled(self) -> bool:
        """Nothing more to wait for at start: ready, completed, or (not essential)
        ended for good or skipped."""
        if self.state in (UnitState.READY, UnitState.COMPLETED):
            return True
        return not self.spec.essential and (self.final or self.state is UnitState.SKIPPED)

    def row(self, now: float) -> list[str]:
        """The unit's row in the live table while the stack starts."""
        if self.state is UnitState.STARTING:
            waited = f"{now - self.spawned_at:.1f}s"
        elif self.state is UnitState.READY and self.ready_at is not None:
            waited = f"{self.ready_at - self.spawned_at:.2f}s"
        else:
            waited = ""
        pid = self.pid
        return [
            self.name,
            self.state,
            str(pid) if pid else "-",
            str(self.port) if self.port else "-",
            waited,
            self.last_line[:200],
        ]


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
        self.cwd: str | None = None  # absolute, filled at prepare


def status_text(code: int | None) -> str:
    """An exit status in words: ``status 3``, ``signal SIGTERM``."""
    if code is None:
        return "unknown status"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


def peek_exit(child: Child) -> int | None:
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


def reap(child: Child | None, timeout: float = 1.0) -> None:
    """Collect a child that has been stopped (bounded; it may be a survivor)."""
    if child is not None:
        child.collect(timeout)


def reap_if_exited(u: Unit) -> None:
    """Take the unit's exit status if its process has ended (never blocks)."""
    c = u.child
    if c is not None and c.returncode is None and peek_exit(c) is not None:
        u.returncode = c.poll()
