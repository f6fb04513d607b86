"""A stack's run inside a ticket (``hold up``), in the foreground or as the
background supervisor of ``hold up --detach``.

* with ``hold:`` in the file, the ticket is taken first (waiting in line as
  ``npu-hold`` does, through :class:`hold.client.session.LeaseSession`), and every
  unit gets its variables (``HOLD_LEASE``, ``CUDA_VISIBLE_DEVICES``...) and
  runs inside it, so units pass ``hold check``;
* every unit's tree is registered with the daemon before anything is spawned
  (marker and cgroup leaf) and its root after each spawn, so a ``hold up``
  that is SIGKILLed leaves nothing: the daemon, the guardian, stops them;
* detached, the run is the background supervisor's (:mod:`hold.cli.upchild`),
  handed the validated stack and :class:`UpSettings` as JSON; what it says
  until the stack is up reaches the command through :class:`StatusPipe`.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, NamedTuple

from hold.cli.stackdir import run_dir_of, say
from hold.protocol import Ev
from hold_supervisor.exitcodes import EXPIRED, RELEASED, TOOL, USAGE, signalled

if TYPE_CHECKING:
    from hold.client.session import LeaseSession
    from hold.config import Config
    from hold.statedir import StateDir
    from hold_supervisor.cause import Cause
    from hold_supervisor.proc.cgroup import Leaf
    from hold_supervisor.proc.tree import Tree
    from hold_supervisor.spawn.containment import Containment
    from hold_supervisor.stack.stack import Stack
    from hold_supervisor.stackfile.spec import StackSpec


class UpSettings(NamedTuple):
    """What a stack's run takes from the configuration, resolved once by the
    command: a background supervisor gets these (:class:`hold.documents.UpHandOver`)
    and reads no YAML.

    ``digest``: the configuration's fingerprint (a stack with a ticket must be
    granted by a daemon that reads the same file); ``device``: the ticket's class
    and indices (``hold:``), checked against the configuration's classes."""

    cgroups: str
    digest: str | None
    device: tuple[str, tuple[int, ...] | None] | None

    @classmethod
    def of(cls, spec: StackSpec, cfg: Config) -> UpSettings:
        # lazy: the command's configuration, never in the stack supervisor nor hold down NAME
        from hold.config import fingerprint
        from hold.devices.classes import classes_from_config, parse_device_spec

        if spec.hold is None:
            return cls(cfg.cgroups, None, None)
        classes = classes_from_config(cfg.devices, cfg.path)
        device = parse_device_spec(spec.hold.device, classes, what="device")
        return cls(cfg.cgroups, fingerprint(cfg.path), device)


def run_up(
    spec: StackSpec,
    sd: StateDir,
    settings: UpSettings,
    seconds: float | None,
    status_fd: int | None,
) -> int:
    """The stack's run, in the foreground or as the background supervisor."""
    # Until the stack's own loop takes the stop signals over, one ends this
    # run cleanly: it may be waiting for a ticket or making its trees, and
    # `hold down` of a stack that is starting sends exactly that.
    # (Imported here: off hold down NAME, which imports this module.)
    from hold.cli.interrupt import Interrupted, interrupting

    try:
        with interrupting((signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)):
            return StackRun(spec, sd, settings, seconds, status_fd).execute()
    except Interrupted as e:
        say(
            f"stack {spec.name} stopped while starting ({signal.Signals(e.signum).name}); "
            "nothing is left running"
        )
        return signalled(e.signum)


class StatusPipe:
    """A detached ``hold up`` tells its starter what it says, then that it is ready,
    as JSON lines on an inherited descriptor; afterwards it talks to its log."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.lock = threading.Lock()
        # Ours alone: a daemon we autostart must not inherit it and keep the
        # starter waiting for an end of file that never comes.
        os.set_inheritable(fd, False)

    def write(self, text: str) -> None:
        # lazy: this module is loaded before hold up --detach forks (dataclasses and
        # the documents are ~30 modules); a status line is only written after it
        from hold.documents import UpStatus

        with self.lock:
            if self.fd >= 0:
                try:
                    os.write(self.fd, UpStatus(line=text).encode())
                    return
                except OSError:
                    self._close()
        print(text, file=sys.stderr, flush=True)

    def ready(self) -> None:
        from hold.documents import UpStatus  # lazy: as in write, after the fork

        with self.lock:
            if self.fd >= 0:
                try:
                    os.write(self.fd, UpStatus(ready=True).encode())
                except OSError:
                    pass
                self._close()

    def close(self) -> None:
        with self.lock:
            if self.fd >= 0:
                self._close()

    def _close(self) -> None:
        os.close(self.fd)
        self.fd = -1


class StackRun:
    """One ``hold up`` in the foreground: daemon, ticket, then the
    :class:`~hold_supervisor.stack.stack.Stack`."""

    def __init__(
        self,
        spec: StackSpec,
        sd: StateDir,
        settings: UpSettings,
        run_for: float | None,
        status_fd: int | None,
    ) -> None:
        self.spec = spec
        self.sd = sd
        self.settings = settings
        self.run_for = run_for
        self.status = StatusPipe(status_fd) if status_fd is not None else None
        self.session: LeaseSession | None = None

    def say(self, text: str) -> None:
        if self.status is not None:
            self.status.write(f"hold up: {text}")
        else:
            say(text)

    def execute(self) -> int:
        # lazy: the run's machinery, only where the stack runs: off hold down NAME
        # (which imports this module) and off the hold up --detach command
        from hold.client.session import LeaseSession
        from hold_supervisor.proc.cgroup import CgroupUnavailable
        from hold_supervisor.spawn.containment import choose
        from hold_supervisor.stack.display import Display
        from hold_supervisor.stack.stack import Stack, StackError

        spec = self.spec
        try:
            containment = choose(self.settings.cgroups)
        except CgroupUnavailable as e:
            self.say(f"cgroups: required, but {e}")
            return USAGE
        # The daemon before the stack starts: if we have to start one, it must
        # not become our child while we are a subreaper (the stack may make us
        # one), nor the keeper's.
        session = LeaseSession.open(
            self.sd,
            self.say,
            digest=self.settings.digest,
            needs_lease=spec.hold is not None,
            unguarded=("this stack", "its units are"),
        )
        if isinstance(session, int):
            if self.status is not None:
                self.status.close()
            return session
        self.session = session
        try:
            # Before the stack records who supervises it (its lock, its
            # start time): from here on, that is the launcher.
            self._keep(containment)
            display = Display(write=self.status.write, live=False) if self.status else Display()
            stack = Stack(
                spec,
                run_dir=run_dir_of(self.sd, spec.name),
                containment=containment,
                environ=os.environ,
                display=display,
                on_tree_prepared=self._on_tree_prepared,
                on_started=self._on_started,
                run_for=self.run_for,
                on_ready=self.status.ready if self.status else None,
                on_stopped=self._end_lease,  # before hold down is answered
                # Detached, the file as the command named it, from where it was named.
                source=os.path.abspath(spec.path) if self.status else "",
            )
            try:
                stack.prepare()  # refusals (name taken, port taken...) before waiting for a device
            except StackError as e:
                for line in e.errors:
                    self.say(line)
                return e.code
            with stack.until_run():  # its lock and logs let go on every way out, unless it ran
                return self._run(stack, session)
        finally:
            session.end()  # if the stack did not (it never ran)
            session.close()
            if self.status is not None:
                self.status.close()  # the starter reads its end of file: not ready

    def _run(self, stack: Stack, session: LeaseSession) -> int:
        """The ticket, then the stack itself."""
        # lazy: as in execute()
        from hold_supervisor.stack.stack import StackError

        env: dict[str, str] = {}
        if self.spec.hold is not None:
            code = self._acquire(session, env)
            if code is not None:
                return code
        if session.guarded:
            stack.extra[session.fileno()] = self._on_daemon
        try:
            result = stack.run(extra_env=env)
        except StackError as e:
            for line in e.errors:
                self.say(line)
            return e.code
        return result.code

    def _keep(self, containment: Containment) -> None:
        """Without cgroups: a keeper above us ends the units' trees if we are
        SIGKILLed (:meth:`~hold_supervisor.spawn.containment.Containment.keep`). After
        the daemon is reached (one we start must not be re-parented to the keeper),
        before the first unit's spawn and the first thread."""
        grace = max((u.stop.grace for u in self.spec.units.values()), default=10.0)
        if not containment.keep(grace=grace, spare=self._daemon):
            self.say(
                "warning: threads are running, no keeper: an escapee that clears "
                "HOLD_TREE outlives a SIGKILL of this process"
            )

    def _daemon(self) -> set[int]:
        """The ticket daemon, which the keeper leaves alone."""
        pid = self.sd.daemon_pid()
        return {pid} if pid is not None else set()

    def _acquire(self, session: LeaseSession, env: dict[str, str]) -> int | None:
        # lazy: as in execute()
        from hold.client.lease import DEFAULT_TTL

        hold = self.spec.hold
        assert hold is not None and self.settings.device is not None
        cls, indices = self.settings.device
        grace = max((u.stop.grace for u in self.spec.units.values()), default=10.0)
        code = session.acquire(
            cls=cls,
            indices=indices,
            count=len(indices) if indices else 1,
            label=hold.label or self.spec.name,
            ttl=hold.ttl or DEFAULT_TTL,
            grace=grace,
            wait=True,
            wait_timeout=None,
            tree=None,
            env=env,
        )
        if code is not None:
            return code
        got = session.granted
        assert got is not None
        self.say(
            f"inside lease {got.lease} ({env.get('HOLD_DEVICES')}) until "
            f"{time.strftime('%H:%M:%S', time.localtime(got.expires))}"
        )
        return None

    # Hooks called by the stack -----------------------------------------------

    def _end_lease(self) -> None:
        """The lease is over before ``hold down`` is answered (once: see LeaseSession.end)."""
        if self.session is not None:
            self.session.end()

    def _on_tree_prepared(self, unit: str, tree_id: str, leaf: Leaf | None) -> None:
        # lazy: as in execute()
        from hold.client.session import DaemonLost
        from hold_supervisor.spawn.containment import leaf_path
        from hold_supervisor.stack.stack import StackError

        session = self.session
        if session is None or not session.guarded:
            return
        try:
            # The unit's own grace: the daemon gives it when it stops the tree for us.
            grace = self.spec.units[unit].stop.grace
            ans = session.register({"tree_id": tree_id, "leaf": leaf_path(leaf), "grace": grace})
        except DaemonLost as e:
            raise StackError(
                [f"lost the ticket daemon while registering {unit}: {e}"], TOOL
            ) from None
        if ans.get("ev") != Ev.OK:
            msg = f"the daemon refused to guard unit {unit}: {ans.get('error')}"
            if self.spec.hold is not None:
                raise StackError([msg], TOOL)
            self.say(f"warning: {msg}")

    def _on_started(self, unit: str, tree: Tree) -> None:
        # Called from several start threads at once: tell_root sends under a lock.
        if self.session is not None and tree.root is not None:
            self.session.tell_root(tree.tree_id, tree.root.pid)

    def _on_daemon(self, fd: int) -> Cause | None:
        # lazy: as in execute()
        from hold_supervisor.cause import Cause

        assert self.session is not None
        cause = self.session.event()
        if cause is None:
            return None
        code = {"expired": EXPIRED, "released": RELEASED}.get(cause.kind, TOOL)
        return Cause(cause.kind, cause.detail, code)
