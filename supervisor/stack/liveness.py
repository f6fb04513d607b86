"""Liveness: a ready unit's periodic check, and what a failing one leads to.

A :class:`Liveness` is a thread per ready unit with ``liveness:``. Every
``period`` it asks the probe (the readiness probe kinds, the same engine, so
an answer is believed only from the unit's own tree) within ``timeout``, and
posts each answer to the main thread (an
:class:`~hold_supervisor.stack.eventtypes.Alive` event). The main thread
counts failures in a row; at ``failures`` it stops the unit
(:func:`stop_unhealthy`), and the unit's exit then goes through its restart
policy as a failure. The thread ends when told to (:meth:`close`), when the
unit is no longer the process it was started for, or when the stack stops.
"""

from __future__ import annotations

import os
import select
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from hold_supervisor.proc.identity import NoSuchProcess
from hold_supervisor.proc.tree import Tree
from hold_supervisor.spawn.child import Child
from hold_supervisor.stack.eventtypes import Alive, Event
from hold_supervisor.stack.readiness import Probe

if TYPE_CHECKING:
    from hold_supervisor.stack.units import Unit  # which imports this module

Post = Callable[[Event], None]


class Liveness:
    """The periodic check of one unit's current process (see the module docstring)."""

    def __init__(
        self,
        unit: Unit,
        probe: Probe,
        tree: Tree,
        *,
        period: float,
        timeout: float,
        post: Post,
    ) -> None:
        self.unit = unit
        self.probe = probe
        self.tree = tree
        self.period = period
        self.timeout = timeout
        self.post = post
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"live-{unit.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            answer = self.probe.check(self.tree, self.timeout)
            if self._stop.is_set():
                return
            self.post(Alive(self.unit, self, answer))

    def close(self) -> None:
        """Stop checking (bounded: a probe call is bounded by ``timeout``)."""
        self._stop.set()
        self.probe.abort()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.timeout + 2.0)


def stop_unhealthy(child: Child, sig: int, grace: float) -> threading.Thread:
    """Stop a unit that failed its liveness: its stop signal, then SIGKILL after
    ``grace``. Only the unit's own process: its exit is handled as any exit (the
    main thread reaps it; what it left is stopped before a restart)."""

    def run() -> None:
        try:
            child.send_signal(sig)
        except (ProcessLookupError, NoSuchProcess):
            return
        poller = select.poll()
        poller.register(child.pidfd, select.POLLIN)
        if not poller.poll(grace * 1000):
            try:
                child.send_signal(signal.SIGKILL)
            except (ProcessLookupError, NoSuchProcess):
                pass

    t = threading.Thread(target=run, name=f"unhealthy-{os.getpid()}", daemon=True)
    t.start()
    return t
