"""An adopted job, once its lease is granted: contained, watched, stopped.

Exit statuses of ``--adopt`` (a non-child's own status cannot be known: only
its parent may wait for it):

* 0 -- the job ended by itself (its root exited; whatever was left of its
  tree was stopped, and nothing survived);
* 124 -- the lease's time limit: the job was stopped;
* 6 -- ``hold release`` ended the lease: the job was stopped;
* 128+N -- this client got signal N (Ctrl-C: 130): the job was stopped;
* 125 -- the daemon was lost and could not be re-attached;
* 3 -- something of the job survived its stop (before all of the above).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from hold.config import load
from hold.devices.classes import classes_from_config, classes_from_defs
from hold.devices.holders import scan, targets
from hold.protocol import Ev
from hold_supervisor import exitcodes
from hold_supervisor.cause import Cause
from hold_supervisor.parse import format_until
from hold_supervisor.proc.cgroup import CgroupUnavailable
from hold_supervisor.proc.identity import Handle, ProcessId, read_stat
from hold_supervisor.proc.stop import stop_tree
from hold_supervisor.proc.tree import Member, Tree
from hold_supervisor.sigwake import drain, signals_to_pipe
from hold_supervisor.spawn.containment import Containment, WalkContainment, choose, leaf_path

if TYPE_CHECKING:
    from hold.cli.runargs import RunArgs
    from hold.client.connection import Client
    from hold.client.lease import Granted
    from hold.client.session import LeaseSession
    from hold_supervisor.proc.cgroup import Leaf
    from hold_supervisor.proc.stop import StopReport

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


class Job:
    """The running process ``root`` (pinned by a pidfd) and its tree."""

    def __init__(
        self,
        root: ProcessId,
        handle: Handle,
        args: RunArgs,
        say: Callable[[str], None],
        containment: Containment,
    ) -> None:
        st = read_stat(root.pid)
        self.root = root
        self.handle = handle
        self.comm = st.comm or str(root.pid)
        self.args = args
        self.say = say
        self.containment = containment  # where its tree goes once the lease is granted
        self.tree_id = os.urandom(6).hex()
        # Its group and session only where it leads them: not its shell's.
        self.tree = Tree(
            self.tree_id,
            root,
            root.pid if st.pgrp == root.pid else None,
            root.pid if st.session == root.pid else None,
        )
        self.members: dict[int, Member] = {}
        self.held: dict[tuple[str, int], int] = {}  # (class, index) -> a pid holding it

    @classmethod
    def pin(cls, pid: int, args: RunArgs, say: Callable[[str], None], cgroups: str) -> Job:
        """The job of ``pid``; NoSuchProcess if it is gone; ValueError if ``cgroups:
        required`` and its cgroup is not this user's to make a leaf in."""
        try:
            containment = choose(cgroups, of_process=pid)  # leaves in its own cgroup
        except CgroupUnavailable as e:
            raise ValueError(f"cgroups: required, but {e}") from None
        root = ProcessId.of(pid)
        return cls(root, Handle.open(root), args, say, containment)

    def look(self, daemon: int) -> str | None:
        """Its members now; why not to adopt it, if the daemon is one of them."""
        self.members = self.tree.look()[1]
        if daemon in self.members:
            return f"the ticket daemon (pid {daemon}) is in its tree"
        return None

    def held_devices(self, client: Client) -> dict[tuple[str, int], int]:
        """The devices (of every class the daemon knows) its members hold: -> a holder's pid."""
        classes = classes_from_defs(client.info.get("class_defs") or {})
        if not classes:
            cfg = load()
            classes = classes_from_config(cfg.devices, cfg.path)
        pids = list(self.members)
        for name in classes:  # one class at a time: two classes may name one node
            found = scan(targets(classes, name), pids=pids).holders
            self.held.update({(h.cls, h.unit): h.pid for h in found if h.unit is not None})
        return self.held

    def registration(self, leaf: Leaf | None = None) -> dict[str, object]:
        """The tree as the daemon is told it: the adoption, and its leaf once made."""
        return {
            "tree_id": self.tree_id,
            "leaf": leaf_path(leaf),
            "grace": self.args.grace,
            "adopt": {"pid": self.root.pid, "start": self.root.starttime},
        }

    # ------------------------------------------------------------ guarded

    def guard(self, session: LeaseSession) -> int:
        """Contain it, wait for its end (or the lease's, or a signal), stop what is
        left, end the lease; the exit status (the module docstring)."""
        got = session.granted
        assert got is not None
        with _signals_taken() as wake:
            try:
                self._contain(session)
                self._adopted(got)
                cause = self._wait(session, wake, got.expires)
                sig = cause.signal if cause.kind == "signal" and cause.signal else None
                report = stop_tree(self.tree, sig=sig or self.args.signal, grace=self.args.grace)
            finally:
                self._release_leaf()
        session.end()  # returns once the daemon has ended the lease
        return self._outcome(cause, report)

    def _contain(self, session: LeaseSession) -> None:
        """Its tree moved into a leaf in its own cgroup, and the daemon told; else walked
        (from then on: :attr:`containment` is the walk)."""
        walk = "its tree is tracked by walking /proc"
        try:
            leaf, failed = self.containment.take_in(self.tree, f"hold-{self.tree_id}")
        except CgroupUnavailable as e:
            self.say(f"warning: {e}; {walk}")
            self.containment = WalkContainment()
            return
        if leaf is None:
            if failed:
                self.say(f"warning: pid {self.root.pid} cannot be moved into a cgroup; {walk}")
            self.containment = WalkContainment()
            return
        if failed:
            self.say(
                f"warning: pids {', '.join(map(str, failed))} cannot be moved into the "
                "lease's cgroup; they are found by walking /proc"
            )
        ans = session.register(self.registration(leaf))
        if ans.get("ev") != Ev.OK:
            self.say(f"warning: the daemon did not take the cgroup: {ans.get('error')}")

    def _adopted(self, got: Granted) -> None:
        cls = self.args.device.split(":")[0] if self.args.device else "?"
        devs = ",".join(f"{cls}:{i}" for i in got.devices)
        where = self.containment.where
        self.say(
            f"adopted pid {self.root.pid} ({self.comm}) and its tree ({where}): lease "
            f"{got.lease} on {devs}, {format_until(got.expires, time.time())}"
        )

    def _wait(self, session: LeaseSession, wake: int, expires: float) -> Cause:
        """Until the root exits, the lease ends, or a signal comes: why it is stopped."""
        daemon = session.fileno()
        poller = select.poll()
        for fd in (self.handle.fd, wake, daemon):
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + (expires - time.time())
        if session.pending():  # told while the tree was registered: no byte will wake the poll
            told = session.event()
            if told is not None:
                return told
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return Cause("expired", detail="the lease's time limit was reached")
            # A walked tree is looked at while it runs: new members are seen while alive.
            every = self.containment.look_every
            ready = poller.poll(min(left, every or left) * 1000)
            if every is not None and not ready:
                self.tree.look()  # who is in it now, found again after its root exits
                self.tree.forget_dead()
            # The daemon's word first: a release or an expiry stops the job, and
            # when both are ready in one poll the job's exit is its consequence.
            for fd, _ in sorted(ready, key=lambda r: r[0] != daemon):
                if fd == self.handle.fd:
                    return Cause("exited", detail=f"pid {self.root.pid} ended")
                if fd == wake:
                    for signum in drain(wake):
                        if signum in FORWARDED:
                            name = signal.Signals(signum).name
                            return Cause("signal", name, signal=signum)
                elif fd == daemon:
                    told = session.event()
                    if told is not None:
                        return told

    def _release_leaf(self) -> None:
        self.containment.release(self.tree.leaf, only_if_empty=True)

    def _outcome(self, cause: Cause, report: StopReport) -> int:
        """What is said at the end, and the exit status (the module docstring)."""
        if self.args.verbose or report.survivors or report.holders_after:
            self.say(report.summary())
        stopped = f"pid {self.root.pid} and its tree stopped"
        if cause.kind == "expired":
            self.say(f"lease expired ({cause.detail}); {stopped}")
        elif cause.kind in ("released", "lost", "signal"):
            self.say(f"{cause.detail}; {stopped}")
        elif self.args.verbose:
            self.say(f"{cause.detail}; the lease is over")
        if report.survivors:
            return exitcodes.SURVIVORS
        codes = {
            "exited": exitcodes.OK,
            "expired": exitcodes.EXPIRED,
            "released": exitcodes.RELEASED,
            "lost": exitcodes.TOOL,
        }
        if cause.kind in codes:
            return codes[cause.kind]
        return exitcodes.signalled(cause.signal or signal.SIGTERM)

    def close(self) -> None:
        self.handle.close()


def _signals_taken() -> contextlib.AbstractContextManager[int]:
    """The stop signals on a wakeup pipe (its read end given), read by the wait:
    from the grant on, a signal stops the job as ``hold run`` would."""
    return signals_to_pipe(FORWARDED)
