"""The parked stub: one process ready for a task unit's next call (cgroup mode).

Moving a new process into its leaf (a write to ``cgroup.procs``) waits for an
RCU grace period in the kernel, 10-20 ms unless another move happened just
before -- longer than the rest of a call. So a runner keeps one stub ready:
``/bin/sh`` spawned with the task's isolation into the next call's leaf,
waiting on its stdin for a go line. A call writes its id and its arguments
(:func:`hold_supervisor.task.runner.run_parked`), and the stub execs the task's command
at once. Nothing of the task runs before a call; the stub is replaced after
each call, off the caller's path, and stopped with the runner.
"""

from __future__ import annotations

import os
import threading

from hold_supervisor.proc.cgroup import CgroupUnavailable, Leaf
from hold_supervisor.proc.stop import stop_tree
from hold_supervisor.proc.tree import Tree
from hold_supervisor.spawn.child import Child, SpawnError, spawn
from hold_supervisor.spawn.containment import Containment
from hold_supervisor.task.calls import Launch
from hold_supervisor.task.pipes import Pipes

# The stub: into its leaf, then wait for the go line (the call's id; sh's
# `read` takes no byte past the newline, so the arguments stay for the task),
# then become the task. An empty go line (or end of file) is "not needed".
STUB = (
    'echo $$ > "$0" || exit 125; IFS= read -r HOLD_CALL && [ -n "$HOLD_CALL" ] || exit 0; '
    'export HOLD_CALL; {unset_pwd}exec "$@"'
)


class Parked:
    """A stub waiting for a call: its child, leaf, and our ends of its pipes."""

    __slots__ = ("child", "err_r", "in_w", "leaf", "out_r", "pipes")

    def __init__(
        self, child: Child, leaf: Leaf, pipes: Pipes, in_w: int, out_r: int, err_r: int
    ) -> None:
        self.child = child
        self.leaf = leaf
        self.pipes = pipes
        self.in_w = in_w
        self.out_r = out_r
        self.err_r = err_r


class Parking:
    """At most one stub parked for the next call, in a new home of ``calls`` (a
    leaf inside the unit's); none where a spawn joins no leaf (no move to save
    time on), nor when not ``on``. Its methods may be called from any thread."""

    def __init__(self, launch: Launch, calls: Containment, *, on: bool = True) -> None:
        self.launch = launch
        self.calls = calls
        self.on = on and calls.joins_leaf
        self._lock = threading.Lock()
        self._parked: Parked | None = None
        self._parking = False  # a refill is under way (one at a time)
        self._closed = False

    def refill(self) -> None:
        """Park a stub for the next call, if there is none and we are not closed."""
        if not self.on:
            return
        with self._lock:
            if self._closed or self._parked is not None or self._parking:
                return
            self._parking = True
        parked = None
        try:
            parked = self._park()
        finally:
            with self._lock:
                self._parking = False
                if parked is not None and not self._closed and self._parked is None:
                    self._parked, parked = parked, None
            if parked is not None:  # closed meanwhile
                self.discard(parked)

    def take(self) -> Parked | None:
        """The parked stub for a call, or None (the call starts cold)."""
        with self._lock:
            parked, self._parked = self._parked, None
        if parked is not None and parked.child.poll() is not None:
            self.discard(parked)  # it died while parked (someone killed it)
            return None
        return parked

    def shut(self) -> None:
        """Park no more stubs (the runner takes no more calls)."""
        with self._lock:
            self._closed = True

    def close(self) -> None:
        """Park no more, and stop the one parked (no call is left to use it)."""
        with self._lock:
            self._closed = True
            parked, self._parked = self._parked, None
        if parked is not None:
            self.discard(parked)

    def discard(self, parked: Parked) -> None:
        """Stop a parked stub that no call will use (nothing of the task ran in it)."""
        try:
            os.write(parked.in_w, b"\n")  # "not needed": it exits by itself
        except OSError:
            pass
        tree = Tree(
            os.path.basename(parked.leaf.path),
            parked.child.ident,
            parked.child.pid,
            parked.child.pid,
            leaf=parked.leaf,
        )
        stop_tree(tree, grace=1.0)
        parked.child.collect()
        parked.pipes.close_all()
        self.calls.release(parked.leaf, only_if_empty=True)

    def _park(self) -> Parked | None:
        try:
            leaf = self.calls.home(f"hold-{os.urandom(6).hex()}")
        except CgroupUnavailable:
            return None  # the cold path will say why
        assert leaf is not None  # refill parks only where calls join a leaf
        pipes = Pipes()
        try:
            in_r, in_w = pipes.make()
            out_r, out_w = pipes.make()
            err_r, err_w = pipes.make()
            stub = STUB.format(unset_pwd="" if "PWD" in self.launch.env else "unset PWD; ")
            try:
                child = spawn(
                    ["/bin/sh", "-c", stub, leaf.procs_file, *self.launch.argv],
                    env=self.launch.env,
                    cpus=self.launch.cpus,
                    stdin=in_r,
                    stdout=out_w,
                    stderr=err_w,
                    cwd=self.launch.cwd,
                )
            finally:
                for fd in (in_r, out_w, err_w):
                    pipes.close(fd)
        except (SpawnError, OSError):
            pipes.close_all()
            self.calls.release(leaf, only_if_empty=True)
            return None
        return Parked(child, leaf, pipes, in_w, out_r, err_r)
