"""``hold run`` / ``npu-hold`` / ``gpu-hold``: parse strictly (:mod:`hold.cli.runargs`
by :mod:`hold.cli.options`, not click: this is the hot path), then run to the end.

The flow: connect to the daemon (starting one if none answers); with a
device, ask for a lease and wait in line; register the command's tree (its
marker and cgroup leaf, before the spawn) so the daemon can stop it if we
die; run it in the foreground; stop everything it started. Without a device,
an unreachable daemon only costs the guardian (a warning); with one, it is
fatal (125), since nothing could be granted.

A daemon that is there but does not answer (stopped, stalled on a disk or a
lock) is waited for :data:`hold.client.connection.ANSWER_TIMEOUT` (3 s) per request,
once: the probe that finds it silent is not followed by another ask. The
rule for the exit status: a daemon that does not answer is 125 (the tool
failed: ``the ticket daemon (pid N, DIR) did not answer within 3 s``), with
or without ``--wait-timeout`` and ``--no-wait``; only the caller's own wait
deadline running out while it waits in line (the daemon answered, the device
is taken) is 75. ``hold run`` without a device goes on without a guardian,
and says so on stderr: it takes nothing from anyone, the daemon would only
have stopped its tree had this process died, and refusing would let one
stalled daemon stop every ``hold run`` on the machine; the command is still
stopped, with the survivor check, while this process lives.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, NamedTuple

from hold.cli.interrupt import Interrupted, interrupting
from hold.cli.options import UsageError
from hold.cli.runargs import RunArgs, help_text, parse_run_args, usage_for
from hold.client.connection import Client, DaemonSilent
from hold.client.lease import DEFAULT_TTL
from hold.client.session import DaemonLost, LeaseSession
from hold.config import (
    CGROUP_MODES,
    Config,
    config_path,
    fingerprint,
    parse_file,
    scratch_min_free,
)
from hold.devices.classes import (
    DeviceClass,
    classes_from_config,
    classes_from_defs,
    parse_device_spec,
)
from hold.protocol import Ev
from hold.statedir import StateDir, open_state_dir
from hold_supervisor import exitcodes
from hold_supervisor.environ import DEFAULT_ALLOW, minimal_env
from hold_supervisor.parse import BadValue, format_duration
from hold_supervisor.proc.cgroup import CgroupUnavailable
from hold_supervisor.safefile import UnsafePath
from hold_supervisor.spawn.child import SpawnError, resolve
from hold_supervisor.spawn.containment import Containment, choose, leaf_path
from hold_supervisor.spawn.foreground import Foreground, RunResult, is_foreground_tty
from hold_supervisor.spawn.intoleaf import preload

if TYPE_CHECKING:
    from hold_supervisor.cause import Cause
    from hold_supervisor.proc.tree import Tree


def main_run(argv: list[str], prog: str = "hold run", device: str | None = None) -> int:
    """``hold run``; returns the exit status (see the README's table)."""
    usage = usage_for(prog)
    if not argv:
        print(
            f"{prog}: no command given\nUsage: {usage}\nTry '{prog} --help' for the options.",
            file=sys.stderr,
        )
        return exitcodes.USAGE
    try:
        args = parse_run_args(argv, device=device, usage=usage)
    except (UsageError, BadValue) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return exitcodes.USAGE
    if args.help:
        print(help_text(usage))
        return 0
    if args.version:
        from hold.version import version_line  # lazy: only for --version

        print(version_line(prog))
        return 0
    try:
        setup = _setup(args)
    except BadValue as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return exitcodes.USAGE
    if args.adopt is not None:
        from hold.cli.adopt import main_adopt  # lazy: only with --adopt, off npu-hold's path

        return main_adopt(args, prog, setup)
    try:
        # Until the command runs (its own handlers take over then).
        with interrupting((signal.SIGINT, signal.SIGTERM, signal.SIGHUP)):
            return Run(args, prog, setup).execute()
    except Interrupted as e:
        print(f"{prog}: {signal.Signals(e.signum).name}; nothing is left running", file=sys.stderr)
        return exitcodes.signalled(e.signum)


Spec = tuple[str, tuple[int, ...] | None]  # a device class, and which of its devices
# What the daemon is given beyond the grace to end a lease (its stop of the
# tree, the scan for leftovers); a daemon that says nothing for 3 s of it is
# asked whether it still reads (hold.client.connection.Client.end).
END_MARGIN = 30.0


class Setup(NamedTuple):
    """What the configuration says for one run, and where its daemon is."""

    cgroups: str
    sd: StateDir
    spec: Spec | None
    digest: str | None  # our configuration's fingerprint, for a run with a device
    client: Client | None  # a session already open with our daemon, if one served
    # Our daemon is there but did not answer (hold.client.connection.DaemonSilent): not asked again.
    silent: Exception | None = None


def _setup(args: RunArgs) -> Setup:
    """The configuration's word on this run; :class:`BadValue` if it is wrong.

    A daemon that reads the very file we would read (same fingerprint) has
    checked it and sends what we need with the session (its classes, their
    sizes, ``cgroups:``): then no YAML is parsed here, ~15 ms of start-up.
    Otherwise the file is read and checked whole, as before, and nothing is
    started before it passed.
    """
    path = config_path()
    digest = fingerprint(path)
    client, silent = _probe() if path is not None or args.device is not None else (None, None)
    info = client.info if client is not None else {}
    arbiter = info.get("arbiter") or {}
    defs, sizes = info.get("class_defs"), info.get("classes")
    if (
        client is not None
        and arbiter.get("config_digest") == digest
        and arbiter.get("cgroups") in CGROUP_MODES
        and isinstance(defs, dict)
        and isinstance(sizes, dict)
    ):
        spec = _spec(args, classes_from_defs(defs), sizes)
        return Setup(str(arbiter["cgroups"]), client.sd, spec, digest, client, None)
    cfg = parse_file(path) if path is not None else Config()
    try:
        spec = _spec(args, classes_from_config(cfg.devices, cfg.path), None)
        sd = client.sd if client is not None else open_state_dir()
    except BaseException:
        if client is not None:
            client.close()
        raise
    if client is not None and spec is not None:
        # Another configuration: Client.with_session asks again, and
        # replaces that daemon if it may.
        client.close()
        client = None
    return Setup(cfg.cgroups, sd, spec, digest if spec is not None else None, client, silent)


def _probe() -> tuple[Client | None, Exception | None]:
    """A session with a daemon already serving our state directory, or None;
    and why not, where one is there but did not answer (``DaemonSilent``)."""
    try:
        sd = open_state_dir(create=False)
    except (BadValue, OSError):
        return None, None  # said again, with the reason, where the directory is made
    try:
        return Client.probe(sd), None
    except DaemonSilent as e:
        return None, e


def _spec(
    args: RunArgs, classes: Mapping[str, DeviceClass], sizes: Mapping[str, int] | None
) -> Spec | None:
    """The ``--device`` asked for, checked against the classes; None without one."""
    if args.device is None:
        return None
    spec = parse_device_spec(args.device, classes, sizes=sizes)
    if spec[1] is not None and args.count is not None and args.count != len(spec[1]):
        raise BadValue(
            "-n/--count", str(args.count), f"the number of indices in --device {args.device}"
        )
    size = sizes[spec[0]] if sizes is not None else classes[spec[0]].size()
    if args.count is not None and args.count > size:
        raise BadValue(
            "-n/--count", str(args.count), f"at most {size}: {spec[0]} has {size} device(s) here"
        )
    return spec


class Run:
    """One ``hold run``: the daemon conversation (:class:`LeaseSession`) around a
    :class:`Foreground`."""

    def __init__(self, args: RunArgs, prog: str, setup: Setup) -> None:
        self.args = args
        self.prog = prog
        self.setup = setup
        self.cgroups = setup.cgroups
        self.spec = setup.spec
        self.session: LeaseSession | None = None

    def say(self, text: str) -> None:
        print(f"{self.prog}: {text}", file=sys.stderr, flush=True)

    def execute(self) -> int:
        """Connect, wait in line, run the command in the foreground; its exit status."""
        args = self.args
        try:
            containment = choose(self.cgroups)
        except CgroupUnavailable as e:
            self.say(f"cgroups: required, but {e}")
            return exitcodes.USAGE
        tree_id = os.urandom(6).hex()
        # Inside a Slurm job the command stays in it: SLURM_* (job id, step, rank,
        # its GPUs) describe the job, and a distributed program reads them.
        env = minimal_env(
            os.environ,
            tree_id=tree_id,
            allow=(*DEFAULT_ALLOW, "SLURM_*"),
            pass_names=args.pass_env,
            extra=args.env,
        )
        try:  # refuse a missing command before taking anyone's device
            resolve(args.command[0], env.get("PATH"))
        except SpawnError as e:
            self.say(str(e))
            return e.exit_code
        with self._scratch(env) as code:
            if code is not None:
                return code
            return self._execute(env, tree_id, containment)

    @contextlib.contextmanager
    def _scratch(self, env: dict[str, str]) -> Iterator[int | None]:
        """``--scratch``: a fresh private directory in ``HOLD_SCRATCH`` for the run's
        whole scope (see :func:`hold_supervisor.spawn.scratch.scoped`); an exit status if none."""
        if not self.args.scratch:
            yield None
            return
        from hold_supervisor.spawn.scratch import ScratchError, scoped  # lazy: only --scratch

        try:
            scope = scoped(self.args.keep_scratch, self.say, min_free=scratch_min_free())
            scratch = scope.__enter__()
        except (ScratchError, UnsafePath, OSError) as e:
            self.say(f"scratch: {e}")
            yield exitcodes.USAGE
            return
        env["HOLD_SCRATCH"] = scratch.path
        with contextlib.ExitStack() as stack:
            stack.push(scope)
            yield None

    def _execute(self, env: dict[str, str], tree_id: str, containment: Containment) -> int:
        args = self.args
        # The daemon first: if we have to start it, it must not be our child
        # while we are a subreaper (prepare() below may make us one).
        session = LeaseSession.open(
            self.setup.sd,
            self.say,
            digest=self.setup.digest,
            needs_lease=self.spec is not None,
            unguarded=("this command", "it is"),
            silent=self.setup.silent,
            client=self.setup.client,
        )
        if isinstance(session, int):
            return session
        self.session = session
        fg = Foreground(
            args.command,
            env=env,
            tree_id=tree_id,
            cpus=args.cpus,
            timeout=args.time,
            grace=args.grace,
            stop_signal=args.signal,
            containment=containment,
            interactive=is_foreground_tty(0),
        )
        # The grace goes with the tree: the daemon stopping it (if we die)
        # must allow what the user asked for, lease or not.
        tree: dict[str, object] = {"tree_id": tree_id, "leaf": None, "grace": args.grace}
        try:
            if session.guarded and self.spec is not None:
                # Wait in line first, with the tree known by its marker only:
                # the leaf is made once the lease is granted (a leaf made before
                # a long wait can be removed by someone else in the meantime).
                # ctypes for the clone into the leaf, loaded while the daemon checks.
                code = self._acquire(
                    session, tree, env, preload if containment.joins_leaf else None
                )
                if code is not None:
                    session.close()
                    return code
                fg.env = env
                assert session.granted is not None
                fg.timeout = session.granted.expires - time.time()
        except (OSError, TimeoutError) as e:
            session.close()
            self.say(f"lost the ticket daemon: {e}")
            return exitcodes.TOOL
        return self._run(fg, tree)

    def _run(self, fg: Foreground, tree: dict[str, object]) -> int:
        """The leaf, the tree registered, the command run and stopped; its exit status."""
        session = self.session
        assert session is not None
        # The leaf goes, whatever happens (a SIGTERM as it is made), if the command never runs.
        with fg.until_run():
            try:
                leaf = fg.prepare(self.cgroups)
            except CgroupUnavailable as e:  # required: writable, yet no leaf could be made
                session.close()
                self.say(f"cgroups: required, but {e}")
                return exitcodes.USAGE
            # Without a leaf, a keeper above us ends the tree if we are SIGKILLed
            # (hold_supervisor.spawn.keeper); with one, none is needed.
            if not fg.containment.keep(grace=self.args.grace, spare=self._daemon):
                self.say(
                    "warning: no keeper (threads are running): "
                    f"{fg.containment.limit(self.cgroups)}"
                )
            elif self.args.verbose and (note := fg.containment.limit(self.cgroups)):
                self.say(note)  # once per run: the limit of the walk (issue 10)
            try:
                # Registered again with news only: its leaf (a lease's tree is
                # registered by its marker while it waits in line).
                tree["leaf"] = leaf_path(leaf)
                news = tree["leaf"] is not None or self.spec is None
                if session.guarded and news and not self._register(session, tree):
                    return exitcodes.TOOL
                extra = {session.fileno(): self._on_daemon} if session.guarded else None
                result = fg.run(extra=extra, on_started=self._on_started(str(tree["tree_id"])))
            except SpawnError as e:
                self.say(str(e))
                return e.exit_code
            finally:
                # Returns once the daemon has ended the lease: the token is gone
                # and the device grantable when we return.
                session.end(timeout=self.args.grace + END_MARGIN)
                session.close()
        return self._outcome(result)

    def _daemon(self) -> set[int]:
        """The ticket daemon, which the keeper leaves alone (one we start by
        re-attaching is re-parented to it)."""
        pid = self.setup.sd.daemon_pid()
        return {pid} if pid is not None else set()

    def _register(self, session: LeaseSession, tree: dict[str, object]) -> bool:
        """The tree made known to the daemon (its guardian); False if the daemon is lost."""
        try:
            ans = session.register(tree)
        except DaemonLost as e:
            self.say(f"lost the ticket daemon: {e}")
            return False
        if ans.get("ev") != Ev.OK:
            self.say(f"warning: the daemon refused to guard this command: {ans.get('error')}")
        return True

    def _on_started(self, tree_id: str) -> Callable[[Tree], None]:
        """Tell the daemon the command's pid once it runs."""
        session = self.session
        assert session is not None

        def on_started(t: Tree) -> None:
            if t.root is not None:
                session.tell_root(tree_id, t.root.pid)

        return on_started

    def _outcome(self, result: RunResult) -> int:
        """What is said at the end, and the exit status (the README's table)."""
        report = result.report
        if self.args.verbose or report.survivors or report.holders_after:
            self.say(report.summary())
        kind = result.cause.kind
        if kind == "expired":
            # The limit as given (-t, or a lease's default), not what was left of it at
            # the spawn: that can be a fraction of a millisecond, or below zero.
            limit = self.args.time if self.spec is None else (self.args.time or DEFAULT_TTL)
            what = "lease" if self.spec is not None else "time limit"
            self.say(f"{what} expired (its time limit of {_duration(limit)} reached); stopped")
        elif kind in ("released", "lost"):
            self.say(result.cause.detail)
        if kind == "lost" and not report.survivors:
            return exitcodes.TOOL
        if kind == "released" and not report.survivors:
            return exitcodes.RELEASED
        return result.exit_code

    # ------------------------------------------------------------------ lease

    def _acquire(
        self,
        session: LeaseSession,
        tree: Mapping[str, object],
        env: dict[str, str],
        meanwhile: Callable[[], None] | None,
    ) -> int | None:
        """Wait in line for the lease; None once granted (env filled in), else an exit status."""
        from hold.client.waitline import WaitLine  # lazy: only with a device to wait for

        assert self.spec is not None
        args = self.args
        cls, indices = self.spec
        return session.acquire(
            cls=cls,
            indices=indices,
            count=args.count or 1,
            label=args.label or os.path.basename(args.command[0]),
            ttl=args.time or DEFAULT_TTL,
            grace=args.grace,
            wait=not args.no_wait,
            wait_timeout=args.wait_timeout,
            tree=tree,
            env=env,
            private=args.private,
            live=WaitLine.at_terminal(sys.stderr, self.prog),
            meanwhile=meanwhile,
        )

    def _on_daemon(self, fd: int) -> Cause | None:
        """A message from the daemon while the command runs: expiry, release, or its loss."""
        assert self.session is not None
        return self.session.event()


def _duration(seconds: float | None) -> str:
    """A time limit as a person gave it: ``500ms``, ``2s``, ``1.5s``, then ``5m07s``..."""
    if seconds is not None and seconds < 1:
        return f"{seconds * 1000:g}ms"
    if seconds is not None and seconds < 60:
        return f"{seconds:g}s"
    return format_duration(seconds)
