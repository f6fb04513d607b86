"""``hold run`` / ``npu-hold`` / ``gpu-hold``: parse strictly, then run to the end.

The argument parser is hand-written rather than click's: this is the hot
path (``hold run -- true`` and ``npu-hold -- true`` are benchmarks), and
importing click alone costs several times Python's own start-up. The option
table below is the single source for the parser and for ``--help``.

The flow: connect to the daemon (starting one if none answers); with a
device, ask for a lease and wait in line; register the command's tree (its
marker and cgroup leaf, before the spawn) so the daemon can stop it if we
die; run it in the foreground; stop everything it started. Without a device,
an unreachable daemon only costs the guardian (a warning); with one, it is
fatal (125), since nothing could be granted.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from hold.errors import HoldError
from hold.lease import DEFAULT_TTL, acquire_lease, daemon_event
from supervisor import exitcodes
from supervisor.parse import BadValue, parse_cpus, parse_duration

if TYPE_CHECKING:  # imported where used: see the module docstring
    from hold.client import Client
    from hold.statedir import StateDir
    from supervisor.cause import Cause

USAGE = "hold run [OPTIONS] -- COMMAND [ARG...]"

# (long, short, metavar or None for a flag, help)
Option = tuple[str, str | None, str | None, str]
OPTIONS: tuple[Option, ...] = (
    ("--time", "-t", "DURATION",
     "time limit: 90s, 4m, 2h (a plain number is minutes); at the limit the "
     "command is stopped and the exit status is 124"),
    ("--cpus", None, "LIST", "run on these CPUs only, e.g. 0-3,8"),
    ("--grace", None, "DURATION",
     "how long the command may take to stop after the polite signal before it "
     "is killed (a plain number is seconds; default 10s)"),
    ("--signal", "-s", "SIGNAL", "the polite stop signal (default TERM)"),
    ("--env", "-e", "NAME=VALUE", "set a variable for the command (repeatable)"),
    ("--pass-env", None, "NAME", "pass this variable through from here (repeatable)"),
    ("--device", "-d", "CLASS[:INDEX,...]",
     "hold a lease on devices of this class (npu, gpu, or one configured) while "
     "the command runs"),
    ("--label", "-l", "LABEL", "what the lease is for, shown to others (with --device)"),
    ("--count", "-n", "COUNT", "how many devices of the class (with --device; default 1)"),
    ("--wait-timeout", None, "DURATION",
     "give up waiting for the device after this long: exit 75 (plain number: seconds)"),
    ("--no-wait", None, None, "exit 75 at once if the device is taken"),
    ("--private", None, None, "show the label to you and root only (with --device)"),
    ("--verbose", "-v", None, "print the stop report on stderr"),
    ("--help", "-h", None, "show this message and exit"),
)  # fmt: skip


class UsageError(HoldError):
    """Options that do not make a command line (exit 2)."""

    exit_code = exitcodes.USAGE


class RunArgs:
    """``hold run``'s options, parsed."""

    def __init__(self, command: list[str]) -> None:
        self.command = command
        self.time: float | None = None
        self.cpus: frozenset[int] | None = None
        self.grace = 10.0
        self.signal = int(signal.SIGTERM)
        self.env: dict[str, str] = {}
        self.pass_env: list[str] = []
        self.device: str | None = None
        self.label: str | None = None
        self.count: int | None = None
        self.wait_timeout: float | None = None
        self.no_wait = False
        self.private = False
        self.verbose = False
        self.help = False


def help_text(usage: str = USAGE, options: tuple[Option, ...] = OPTIONS) -> str:
    lines = [f"Usage: {usage}", ""]
    for long, short, meta, text in options:
        name = f"{short}, {long}" if short else f"    {long}"
        if meta:
            name += f" {meta}"
        lines.append(f"  {name:<30} {text}")
    return "\n".join(lines)


def parse_signal(text: str) -> int:
    name = text.upper().removeprefix("SIG")
    if name.isdigit():
        num = int(name)
        if num in signal.valid_signals() and num not in (0, signal.SIGKILL, signal.SIGSTOP):
            return num
    else:
        sig = getattr(signal, "SIG" + name, None)
        if isinstance(sig, signal.Signals) and sig not in (signal.SIGKILL, signal.SIGSTOP):
            return int(sig)
    raise BadValue(
        "--signal", text,
        "a signal name or number such as TERM, INT, HUP "
        "(not KILL or STOP: the polite signal must be catchable)",
    )  # fmt: skip


def split_options(
    argv: list[str], table: tuple[Option, ...]
) -> tuple[list[tuple[str, str | None]], list[str]]:
    """Split ``argv`` into ``[(long, value)]`` and the command after them.

    Options end at ``--`` or at the first argument that is not an option, as
    for ``timeout(1)``: ``hold run sleep -t 5`` runs ``sleep -t 5``.
    """
    by_name: dict[str, tuple[str, str | None]] = {}
    for long, short, meta, _ in table:
        by_name[long] = (long, meta)
        if short:
            by_name[short] = (long, meta)
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return out, argv[i + 1 :]
        if not arg.startswith("-") or arg == "-":
            return out, argv[i:]
        name, eq, value = arg.partition("=") if arg.startswith("--") else (arg[:2], "", arg[2:])
        if name not in by_name:
            from supervisor.parse import did_you_mean

            raise UsageError(f"no such option: {name}{did_you_mean(name, list(by_name))}")
        long, meta = by_name[name]
        if meta is None:
            if eq or value:
                raise UsageError(f"option {name} takes no value")
            out.append((long, None))
        else:
            if not eq and not value:
                i += 1
                if i >= len(argv):
                    raise UsageError(f"option {name} needs a value ({meta})")
                value = argv[i]
            out.append((long, value))
        i += 1
    return out, []


def parse_run_args(argv: list[str], *, device: str | None = None) -> RunArgs:
    """Strictly parse ``hold run`` arguments; raises UsageError or BadValue."""
    from supervisor.environ import check_name, parse_assignment

    opts, command = split_options(argv, OPTIONS)
    args = RunArgs(command=command)
    args.device = device
    for long, value in opts:
        if long == "--help":
            args.help = True
        elif long == "--verbose":
            args.verbose = True
        elif long == "--no-wait":
            args.no_wait = True
        elif long == "--private":
            args.private = True
        elif value is None:
            raise AssertionError(long)
        elif long == "--time":
            args.time = parse_duration(value, what="-t/--time", plain_unit="minutes")
        elif long == "--cpus":
            args.cpus = parse_cpus(value, what="--cpus")
        elif long == "--grace":
            args.grace = parse_duration(value, what="--grace", plain_unit="seconds",
                                        allow_zero=True)  # fmt: skip
        elif long == "--signal":
            args.signal = parse_signal(value)
        elif long == "--env":
            k, v = parse_assignment(value, where="--env")
            args.env[k] = v
        elif long == "--pass-env":
            args.pass_env.append(check_name(value, where="--pass-env"))
        elif long == "--device":
            args.device = value
        elif long == "--label":
            args.label = value
        elif long == "--count":
            if not value.isascii() or not value.isdigit() or int(value) < 1:
                raise BadValue("-n/--count", value, "a whole number of devices, 1 or more")
            args.count = int(value)
        elif long == "--wait-timeout":
            args.wait_timeout = parse_duration(value, what="--wait-timeout",
                                               plain_unit="seconds", allow_zero=True)  # fmt: skip
    if args.help:
        return args
    if not args.command:
        raise UsageError("no command given (hold run [OPTIONS] -- COMMAND [ARG...])")
    if args.device is None:
        for flag, given in (("--label", args.label), ("--count", args.count),
                            ("--wait-timeout", args.wait_timeout),
                            ("--no-wait", args.no_wait or None),
                            ("--private", args.private or None)):  # fmt: skip
            if given is not None:
                raise UsageError(f"{flag} needs --device (or npu-hold / gpu-hold)")
    if args.label is not None:
        from hold.protocol import check_label

        why = check_label(args.label)
        if why:
            raise BadValue("-l/--label", args.label, why)
    if args.no_wait and args.wait_timeout is not None:
        raise UsageError("--no-wait and --wait-timeout exclude each other")
    return args


def main_run(argv: list[str], prog: str = "hold run", device: str | None = None) -> int:
    """``hold run``; returns the exit status (see the README's table)."""
    try:
        args = parse_run_args(argv, device=device)
    except (UsageError, BadValue) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return exitcodes.USAGE
    if args.help:
        usage = USAGE if prog == "hold run" else f"{prog} [OPTIONS] -- COMMAND [ARG...]"
        print(help_text(usage))
        return 0
    try:
        from hold.config import load

        cfg = load()
        spec: tuple[str, tuple[int, ...] | None] | None = None
        if args.device is not None:
            from hold.devices import classes_from_config, parse_device_spec

            classes = classes_from_config(cfg.devices, cfg.path)
            spec = parse_device_spec(args.device, classes)
            if spec[1] is not None and args.count is not None and args.count != len(spec[1]):
                raise BadValue("-n/--count", str(args.count),
                               f"the number of indices in --device {args.device}")  # fmt: skip
            size = classes[spec[0]].size()
            if args.count is not None and args.count > size:
                raise BadValue("-n/--count", str(args.count),
                               f"at most {size}: {spec[0]} has {size} device(s) here")  # fmt: skip
        from hold.statedir import open_state_dir

        sd = open_state_dir()
    except BadValue as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return exitcodes.USAGE
    from hold.config import fingerprint
    from hold.interrupt import Interrupted, interrupting

    digest = fingerprint(cfg.path) if spec is not None else None
    try:
        # Until the command runs (its own handlers take over then).
        with interrupting((signal.SIGINT, signal.SIGTERM, signal.SIGHUP)):
            return Run(args, prog, cfg.cgroups, sd, spec, digest).execute()
    except Interrupted as e:
        print(f"{prog}: {signal.Signals(e.signum).name}; nothing is left running",
              file=sys.stderr)  # fmt: skip
        return exitcodes.signalled(e.signum)


class Run:
    """One ``hold run``: the daemon conversation around a :class:`Foreground`."""

    def __init__(self, args: RunArgs, prog: str, cgroups: str, sd: StateDir,
                 spec: tuple[str, tuple[int, ...] | None] | None,
                 config_digest: str | None = None) -> None:  # fmt: skip
        self.args = args
        self.config_digest = config_digest
        self.prog = prog
        self.cgroups = cgroups
        self.sd = sd
        self.spec = spec
        self.client: Client | None = None
        self.lease: str | None = None
        self.expires = 0.0

    def say(self, text: str) -> None:
        print(f"{self.prog}: {text}", file=sys.stderr, flush=True)

    def execute(self) -> int:
        from hold.client import Client, ConfigMismatch, DaemonUnreachable
        from hold.protocol import ProtocolError
        from supervisor.cgroup import CgroupUnavailable, hierarchy_for
        from supervisor.environ import minimal_env
        from supervisor.foreground import Foreground, is_foreground_tty
        from supervisor.spawn import SpawnError, resolve
        from supervisor.tree import Tree

        args = self.args
        try:
            hierarchy = hierarchy_for(self.cgroups)
        except CgroupUnavailable as e:
            self.say(f"cgroups: required, but {e}")
            return exitcodes.USAGE
        tree_id = os.urandom(6).hex()
        env = minimal_env(os.environ, tree_id=tree_id, pass_names=args.pass_env, extra=args.env)
        try:  # refuse a missing command before taking anyone's device
            resolve(args.command[0], env.get("PATH"))
        except SpawnError as e:
            self.say(str(e))
            return e.exit_code

        # The daemon first: if we have to start it, it must not be our child
        # while we are a subreaper (prepare() below may make us one).
        client: Client | None = None
        try:
            client = Client.with_session(self.sd, config=self.config_digest)
        except ConfigMismatch as e:
            self.say(str(e))
            return exitcodes.USAGE
        except (DaemonUnreachable, OSError, TimeoutError) as e:
            if self.spec is not None:
                self.say(f"cannot reach the ticket daemon: {e}")
                return exitcodes.TOOL
            self.say(f"warning: no guardian for this command ({e}); it is stopped only "
                     "while this process lives")  # fmt: skip
            client = None
        self.client = client

        fg = Foreground(
            args.command, env=env, tree_id=tree_id, cpus=args.cpus, timeout=args.time,
            grace=args.grace, stop_signal=args.signal, hierarchy=hierarchy,
            interactive=is_foreground_tty(0),
        )  # fmt: skip
        # The grace goes with the tree: the daemon stopping it (if we die)
        # must allow what the user asked for, lease or not.
        tree: dict[str, object] = {"tree_id": tree_id, "leaf": None, "grace": args.grace}
        try:
            if client is not None and self.spec is not None:
                # Wait in line first, with the tree known by its marker only:
                # the leaf is made once the lease is granted (a leaf made before
                # a long wait can be removed by someone else in the meantime).
                code = self._acquire(client, tree, env)
                if code is not None:
                    return code
                fg.env = env
                fg.timeout = self.expires - time.time()
        except (OSError, TimeoutError) as e:
            self.say(f"lost the ticket daemon: {e}")
            return exitcodes.TOOL
        try:
            leaf = fg.prepare()
        except CgroupUnavailable as e:  # writable, yet no leaf could be made
            if self.cgroups == "required":
                self.say(f"cgroups: required, but {e}")
                return exitcodes.USAGE
            fg.hierarchy = None
            leaf = fg.prepare()
        if args.verbose and leaf is None:  # once per run: the limit of the walk (issue 10)
            self.say(fg.walk_note(self.cgroups))
        with fg.until_run():  # the leaf goes, whatever happens, if the command never runs
            try:
                if client is not None and (leaf is not None or self.spec is None):
                    tree["leaf"] = leaf.path if leaf else None
                    ans = client.request_renewing({"op": "tree", **tree})
                    if ans.get("ev") != "ok":
                        self.say(f"warning: the daemon refused to guard this command: {ans}")
            except (OSError, TimeoutError, DaemonUnreachable, ProtocolError) as e:
                self.say(f"lost the ticket daemon: {e}")
                return exitcodes.TOOL

            def on_started(t: Tree) -> None:
                if client is not None and t.root is not None:
                    try:
                        client.send({"op": "root", "tree_id": tree_id, "pid": t.root.pid})
                    except OSError:
                        pass

            extra = {client.fileno(): self._on_daemon} if client is not None else None
            try:
                result = fg.run(extra=extra, on_started=on_started)
            except SpawnError as e:
                self.say(str(e))
                return e.exit_code
            finally:
                if self.client is not None:
                    if self.lease is not None:
                        # Returns once the daemon has ended the lease: the token is
                        # gone and the device grantable when we return.
                        self.client.end()
                    self.client.close()
        report = result.report
        if args.verbose or report.survivors or report.holders_after:
            self.say(report.summary())
        kind = result.cause.kind
        if kind == "expired":
            what = "lease" if self.spec is not None else "time limit"
            self.say(f"{what} expired ({result.cause.detail}); stopped")
        elif kind in ("released", "lost"):
            self.say(result.cause.detail)
        if kind == "lost" and not report.survivors:
            return exitcodes.TOOL
        return result.exit_code

    # ------------------------------------------------------------------ lease

    def _acquire(
        self, client: Client, tree: Mapping[str, object], env: dict[str, str]
    ) -> int | None:
        """Wait in line for the lease; None once granted (env filled in), else an exit status."""
        assert self.spec is not None
        args = self.args
        cls, indices = self.spec
        got = acquire_lease(
            client, self.sd, self.say, cls=cls, indices=indices, count=args.count or 1,
            label=args.label or os.path.basename(args.command[0]),
            ttl=args.time or DEFAULT_TTL, grace=args.grace, wait=not args.no_wait,
            wait_timeout=args.wait_timeout, tree=tree, env=env, private=args.private,
        )  # fmt: skip
        if isinstance(got, int):
            return got
        self.lease, self.expires = got.lease, got.expires
        return None

    def _on_daemon(self, fd: int) -> Cause | None:
        """A message from the daemon while the command runs: expiry, release, or its loss."""
        from supervisor.cause import Cause

        assert self.client is not None
        ev = daemon_event(self.client, self.say)
        return Cause(ev[0], detail=ev[1]) if ev is not None else None
