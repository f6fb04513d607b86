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
  :class:`~hold_supervisor.spawn.child.Child` (reaps it); otherwise the main thread does.
  So each child has exactly one reaper at a time, never ``waitpid(-1)``;
* a **reader** per unit copies the unit's output pipe to its log file (and to
  its log probe), reading with a deadline so it can always be told to stop,
  even when an escapee keeps the pipe open;
* the **control server** answers ``ps`` itself and hands ``down`` and
  ``restart`` to the main thread; a ``call`` is served in its connection's
  thread, by the task unit's :class:`~hold_supervisor.task.task.TaskRunner` (each call
  has a thread of its own, which owns its child).

Task units (``kind: task``) are not started: each call runs the unit once
(:mod:`hold_supervisor.task.task`). Like a service, a task unit has one tree id,
marker and cgroup leaf for the stack's life, registered with the guardian
before anything starts; each call's leaf lies inside the unit's, so the
guardian's stop of the unit reaches every call. Calls are taken while the
stack is up, and are stopped first when it stops.

Each unit has one tree id, marker and cgroup leaf for the stack's whole
life, so a restart needs no new registration with a guardian: the caller is
told about every tree before anything starts (``on_tree_prepared``) and about
each new root after each spawn (``on_started``).

Where each part lives (each a module of functions over the shared
:class:`~hold_supervisor.stack.state.StackState`, which :class:`Stack` is):

* :mod:`hold_supervisor.stack.units`: the unit model (:class:`Unit`, :class:`TaskUnit`);
* :mod:`hold_supervisor.stack.plan`: preparing (lock, ports, commands, envs, logs,
  trees, output readers, task runners) and letting go;
* :mod:`hold_supervisor.stack.run`: the run's scope and the main thread's loop
  (signals, timers);
* :mod:`hold_supervisor.stack.start`: a unit's job that starts it and waits until it is ready;
* :mod:`hold_supervisor.stack.events`: results, exits, restarts, the stack coming up;
* :mod:`hold_supervisor.stack.control`: the control requests (ps, call, down, restart);
* :mod:`hold_supervisor.stack.stop`: the stop, level by level, and the survivor check.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from hold_supervisor.stack import plan
from hold_supervisor.stack.run import STOP_SIGNALS, run_prepared
from hold_supervisor.stack.state import Extra, StackError, StackResult, StackState
from hold_supervisor.stack.units import TAIL, TaskUnit, Unit

__all__ = [
    "STOP_SIGNALS",
    "TAIL",
    "Extra",
    "Stack",
    "StackError",
    "StackResult",
    "TaskUnit",
    "Unit",
]


class Stack(StackState):
    """One run of a stack file; see the module docstring, and :class:`StackState`
    for what it is made with and holds."""

    def prepare(self) -> None:
        """Everything that may refuse, before anything starts: the stack's lock (one
        run per name), named ports free, auto ports picked, commands found.

        Raises :class:`StackError` (with every reason); on success the caller
        must go on to :meth:`run` or call :meth:`release`.
        """
        plan.prepare(self)

    def run(self, extra_env: Mapping[str, str] | None = None) -> StackResult:
        """Start, supervise until a cause to stop, stop everything; the result.

        ``extra_env`` (the ticket's variables) is set for every unit, over its
        own ``env``. Calls :meth:`prepare` first if the caller has not.
        """
        self.ran = True
        if not self.prepared:
            self.prepare()
        try:
            if extra_env:
                self.extra_env.update(extra_env)
            for u in self.every():
                u.env = plan.env_of(self, u)
            plan.make_trees(self)
            return run_prepared(self)
        finally:
            self.release()

    @contextlib.contextmanager
    def until_run(self) -> Iterator[None]:
        """What :meth:`prepare` took (the name's lock, the logs) as a scope: let go
        of on every way out of it unless :meth:`run` took them over (it lets go itself)."""
        try:
            yield
        finally:
            if not self.ran:
                self.release()

    def release(self) -> None:
        """Let go of the stack's name (its lock) without running it."""
        plan.release(self)
