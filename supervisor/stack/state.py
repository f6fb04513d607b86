"""What the parts of a running stack share: :class:`StackState` (the spec, the units,
the caller's hooks, the event queue the workers post to, the cause to stop), and the
stack's error and result types.

Every room of the stack (:mod:`~hold_supervisor.stack.plan`, :mod:`~hold_supervisor.stack.run`,
:mod:`~hold_supervisor.stack.events`, :mod:`~hold_supervisor.stack.start`,
:mod:`~hold_supervisor.stack.control`, :mod:`~hold_supervisor.stack.stop`) is functions that take
this state; :class:`hold_supervisor.stack.stack.Stack` is this state with its lifecycle methods.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

from hold_supervisor.cause import Cause
from hold_supervisor.errors import SupervisorError
from hold_supervisor.exitcodes import USAGE
from hold_supervisor.proc.cgroup import Leaf
from hold_supervisor.proc.identity import read_stat
from hold_supervisor.proc.stop import StopReport, Survivor
from hold_supervisor.proc.tree import Tree
from hold_supervisor.spawn.containment import Containment
from hold_supervisor.stack.controlsock import ControlServer, Reply
from hold_supervisor.stack.display import Display
from hold_supervisor.stack.eventtypes import Event
from hold_supervisor.stack.figures import UnitFigures
from hold_supervisor.stack.units import TaskUnit, Unit
from hold_supervisor.stackfile.spec import StackSpec


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


class StackState:
    """One run of a stack file: what every part of it reads and writes.

    ``run_dir``: the stack's directory (logs, control socket, lock).
    ``containment``: where the units' trees live, cgroup leaves or the walk
    (:func:`~hold_supervisor.spawn.containment.choose`; this process becomes a
    child subreaper either way). ``environ``: what ``pass_env``
    names are taken from. ``extra_env``: set for every unit, over its own
    ``env`` (the ticket's variables). ``extra``: descriptors to watch, each
    with a function that may return a :class:`Cause` to stop. ``run_for``:
    stop this long after the stack is up. ``on_ready``: called once, when
    every unit is first ready. ``on_stopped``: called once the stop is proven
    (survivor check done), before the stack lets go of its name and answers
    ``hold down`` (the caller's lease ends there). ``scratch_root``: where units' scratch
    directories are made (None: :func:`hold_supervisor.spawn.scratch.default_root`).

    Written by the main thread only, except where a unit's job owns its unit
    (see :mod:`hold_supervisor.stack.stack`); workers talk back through :meth:`post`.
    """

    def __init__(
        self,
        spec: StackSpec,
        *,
        run_dir: str,
        containment: Containment,
        environ: Mapping[str, str],
        extra_env: Mapping[str, str] | None = None,
        display: Display | None = None,
        on_tree_prepared: Callable[[str, str, Leaf | None], None] | None = None,
        on_started: Callable[[str, Tree], None] | None = None,
        extra: Mapping[int, Extra] | None = None,
        run_for: float | None = None,
        on_ready: Callable[[], None] | None = None,
        on_stopped: Callable[[], None] | None = None,
        source: str = "",
        scratch_root: str | None = None,
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self.run_dir = run_dir
        self.containment = containment
        self.environ = environ
        self.extra_env = dict(extra_env or {})
        self.display = display or Display()
        self.on_tree_prepared = on_tree_prepared
        self.on_started = on_started
        self.extra = dict(extra or {})
        self.run_for = run_for
        self.on_ready = on_ready
        self.on_stopped = on_stopped
        self.source = source or spec.path
        self.scratch_root = scratch_root
        # Services and one-shots are started by the stack; task units run per call.
        self.order = spec.services()
        self.units = {n: Unit(n, spec.units[n]) for n in self.order}
        self.tasks = {n: TaskUnit(n, u) for n, u in spec.units.items() if u.kind == "task"}
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.abort = threading.Event()
        self.cause: Cause | None = None
        self.phase = "starting"
        self.up_at: float | None = None
        self.started_at = time.monotonic()
        self.since_ticks = read_stat(os.getpid()).starttime
        self.down_waiters: list[Reply] = []
        self.lock_fd = -1
        self.ev_r = self.ev_w = -1  # the workers' event pipe, while it runs
        self.control: ControlServer | None = None
        self.prepared = False
        self.ran = False  # run() took over what prepare() took
        self.ports: dict[str, int] = {}
        self.figures = UnitFigures()  # what ps shows of each unit's CPU and memory

    def say(self, text: str) -> None:
        self.display.line(text)

    def post(self, event: Event) -> None:
        """From a worker: an event for the main thread (it wakes on the event pipe);
        its kinds are :mod:`hold_supervisor.stack.eventtypes`."""
        self.events.put(event)
        try:
            os.write(self.ev_w, b"e")
        except (BlockingIOError, OSError):
            pass

    def where(self, unit: str, *keys: str) -> str:
        """Where in the stack file a unit's key is, for messages."""
        return self.spec.where("units", unit, *keys)

    def every(self) -> list[Unit | TaskUnit]:
        """Services and task units alike: each has a tree, a leaf and a log."""
        return [*self.units.values(), *self.tasks.values()]

    def draw(self) -> None:
        """Redraw the live table (at a terminal only)."""
        if not self.display.live:
            return
        now = time.monotonic()
        self.display.table([u.row(now) for u in self.units.values()])
