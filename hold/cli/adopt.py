"""``npu-hold --adopt PID``: a lease for a job that runs already.

Imported only when ``--adopt`` is given (:func:`hold.cli.run.main_run`), so
``npu-hold``'s own start-up is unchanged.

The flow: the process is checked (:func:`hold.daemon.adoptrules.refusal`: ours, not
init, the daemon or one of our ancestors) and pinned by a pidfd; its tree
(the process and its descendants, by :mod:`hold_supervisor.proc.tree`'s rules) is
looked at, and the devices it holds are read. A device that another lease
holds is a refusal (naming that lease); the devices of the class it holds are
the ones asked for, and it waits in line like any request. The request
carries the adoption, so the daemon's scan before the grant leaves the job
out, and from the grant on the daemon guards the tree (this client is its
lifeline). Then the tree is moved into a cgroup leaf in its own cgroup, where
this user may write it (its limits and accounting are kept), else it is
tracked by walking /proc; and this client waits for the root's exit on its
pidfd (it is no child of ours: ``waitpid`` cannot), the lease's end, or a
signal, then stops what is left of the tree (with the survivor check) and
ends the lease. See :mod:`hold.cli.adoptjob` for the exit statuses.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import TYPE_CHECKING

from hold.cli.adoptjob import Job
from hold.cli.interrupt import Interrupted, interrupting
from hold.client.lease import DEFAULT_TTL
from hold.client.session import LeaseSession
from hold.client.waitline import WaitLine
from hold.daemon.adoptrules import refusal
from hold.leases import LeaseRecord
from hold.protocol import Op
from hold_supervisor import exitcodes
from hold_supervisor.proc.identity import NoSuchProcess

if TYPE_CHECKING:
    from hold.cli.run import Setup
    from hold.cli.runargs import RunArgs
    from hold.client.connection import Client

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def main_adopt(args: RunArgs, prog: str, setup: Setup) -> int:
    """``--adopt PID``, to the end; the exit status (see :mod:`hold.cli.adoptjob`)."""
    adoption = Adoption(args, prog, setup)
    try:
        # Until the lease is granted a signal leaves the job as it was; from
        # then on (Job.guard's own handlers) it stops the job.
        with interrupting(STOP_SIGNALS):
            return adoption.execute()
    except Interrupted as e:
        return adoption.interrupted(e.signum)
    finally:
        adoption.close()


class Adoption:
    """One ``--adopt``: the checks and the wait in line; :class:`Job` does the rest."""

    def __init__(self, args: RunArgs, prog: str, setup: Setup) -> None:
        assert args.adopt is not None and setup.spec is not None
        self.args = args
        self.pid = args.adopt
        self.prog = prog
        self.setup = setup
        self.session: LeaseSession | None = None
        self.job: Job | None = None

    def say(self, text: str) -> None:
        print(f"{self.prog}: {text}", file=sys.stderr, flush=True)

    def refuse(self, why: str) -> int:
        self.say(f"cannot adopt pid {self.pid}: {why}")
        return exitcodes.USAGE

    def execute(self) -> int:
        """Check, connect, wait in line, then guard the job; the exit status."""
        why = refusal(self.pid, None, os.geteuid(), os.getpid(), 0)
        if why is not None:
            return self.refuse(why)
        try:
            self.job = Job.pin(self.pid, self.args, self.say, self.setup.cgroups)
        except NoSuchProcess:
            return self.refuse(f"no process {self.pid}")
        except ValueError as e:  # cgroups: required, and no leaf can be had
            return self.refuse(str(e))
        session = LeaseSession.open(
            self.setup.sd,
            self.say,
            digest=self.setup.digest,
            needs_lease=True,
            silent=self.setup.silent,
            client=self.setup.client,
        )
        if isinstance(session, int):
            return session
        self.session = session
        assert session.client is not None
        daemon = int((session.client.info.get("arbiter") or {}).get("pid") or 0)
        why = refusal(self.pid, self.job.root.starttime, os.geteuid(), os.getpid(), daemon)
        why = why or self.job.look(daemon)
        why = why or self._leased_elsewhere(session.client)
        if why is not None:
            return self.refuse(why)
        return self._acquire(session, self.job)

    def _leased_elsewhere(self, client: Client) -> str | None:
        """Why not, where the job holds a device that a live lease holds (naming it)."""
        assert self.job is not None
        held = self.job.held_devices(client)
        if not held:
            return None
        ans = client.request({"op": Op.LEASES})
        for raw in ans.get("leases") or []:
            try:
                rec = LeaseRecord.from_json(raw)
            except ValueError:
                continue
            for (cls, index), pid in sorted(held.items()):
                if cls == rec.cls and index in rec.devices:
                    label = f" {rec.label!r}" if rec.label else ""
                    return (
                        f"pid {pid} of its tree holds {cls}:{index}, which lease "
                        f"{rec.lease}{label} of {rec.user} (holder pid "
                        f"{rec.holder_pid}) holds; a job on another lease's device "
                        "is not adopted"
                    )
        return None

    def _wanted(self, job: Job) -> tuple[tuple[int, ...] | None, int] | str:
        """The devices to ask for: those of the class the job holds, if any; else as
        ``--device``/``-n`` say. A string: why the options do not fit the job."""
        assert self.setup.spec is not None
        cls, indices = self.setup.spec
        mine = sorted(i for (c, i) in job.held if c == cls)
        if not mine:
            self.say(
                f"note: pid {self.pid} holds no {cls} device now; the lease is for "
                "the device granted, which a running process's environment cannot name"
            )
            return indices, self.args.count or 1
        held = ",".join(map(str, mine))
        if indices is not None and not set(mine) <= set(indices):
            return f"its tree holds {cls}:{held}, not in --device {self.args.device}"
        if indices is None and self.args.count not in (None, len(mine)):
            return f"its tree holds {cls}:{held}: -n {self.args.count} does not fit"
        return (indices if indices is not None else tuple(mine)), len(indices or mine)

    def _acquire(self, session: LeaseSession, job: Job) -> int:
        """Wait in line; once granted, guard the job to its end."""
        assert self.setup.spec is not None
        wanted = self._wanted(job)
        if isinstance(wanted, str):
            return self.refuse(wanted)
        indices, count = wanted
        args = self.args
        code = session.acquire(
            cls=self.setup.spec[0],
            indices=indices,
            count=count,
            label=args.label or job.comm,
            ttl=args.time or DEFAULT_TTL,
            grace=args.grace,
            wait=not args.no_wait,
            wait_timeout=args.wait_timeout,
            tree=job.registration(),
            env={},
            private=args.private,
            live=WaitLine.at_terminal(sys.stderr, self.prog),
        )
        if code is not None:
            return code
        return job.guard(session)

    def interrupted(self, signum: int) -> int:
        """A stop signal before the job was guarded by this client's own loop."""
        name = signal.Signals(signum).name
        if self.session is not None and self.session.holds_lease:
            # Granted: the daemon guards the job already; the end stops it.
            self.session.end()
            self.say(f"{name}; pid {self.pid} and its tree stopped")
        else:
            self.say(f"{name}; pid {self.pid} not adopted, left running")
        return exitcodes.signalled(signum)

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
        if self.job is not None:
            self.job.close()
