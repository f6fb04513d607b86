"""The daemon's worker threads: scans before a grant and stops at a lease's end.

A new thread per job cost about a millisecond of every handoff on a busy
machine: ``Thread.start`` returns only once the new thread has run, and with
20 clients on 2 cores that is a wait for a CPU (measured with cProfile in the
daemon, issue 13). A worker that finished a job waits for the next instead, so
a job handed to it waits for nothing. Workers beyond ``keep`` idle ones end
when they finish; none wakes up while idle.

Workers are daemon threads: a stop stuck past every grace must not keep the
daemon from exiting (:meth:`Workers.join` bounds the wait at shutdown).
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable


class Workers:
    """A pool of daemon threads that grows with the jobs in flight and keeps ``keep`` idle."""

    def __init__(self, keep: int = 4) -> None:
        self._keep = keep
        self._jobs: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._idle = 0  # workers waiting in _jobs.get() and not yet promised a job
        self._busy = 0  # jobs handed out and not finished

    def submit(self, job: Callable[[], object]) -> None:
        """Run ``job`` in a worker (exceptions are the job's to handle: one that
        escapes ends nothing but that job)."""
        with self._lock:
            self._busy += 1
            if self._idle:
                self._idle -= 1  # promised: that worker takes this job
                self._jobs.put(job)
                return
        threading.Thread(target=self._work, args=(job,), name="hold-worker", daemon=True).start()

    def _work(self, first: Callable[[], object]) -> None:
        job: Callable[[], object] | None = first
        while job is not None:
            try:
                job()
            except Exception:  # the job's own handling failed: said as a thread's would be
                threading.excepthook(threading.ExceptHookArgs((*sys.exc_info(), None)))
            with self._lock:
                self._busy -= 1
                self._changed.notify_all()
                if self._idle >= self._keep:
                    return
                self._idle += 1
            job = self._jobs.get()

    def dismiss(self) -> None:
        """End the idle workers (those busy end when done, if ``keep`` is then met)."""
        with self._lock:
            idle, self._idle = self._idle, 0
            self._keep = 0
        for _ in range(idle):
            self._jobs.put(None)

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for every job in flight; True if none is left."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True
