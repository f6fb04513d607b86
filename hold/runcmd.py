"""``hold run``: parse its arguments strictly and run the command to its end.

The argument parser is hand-written rather than click's: this is the hot
path (``hold run -- true`` and ``npu-hold -- true`` are benchmarks), and
importing click alone costs several times Python's own start-up. The option
table below is the single source for the parser and for ``--help``.
"""

from __future__ import annotations

import os
import signal
import sys

from supervisor.parse import BadValue, parse_cpus, parse_duration

USAGE = "hold run [OPTIONS] -- COMMAND [ARG...]"

# (long, short, metavar or None for a flag, help)
OPTIONS: tuple[tuple[str, str | None, str | None, str], ...] = (
    (
        "--time",
        "-t",
        "DURATION",
        "time limit: 90s, 4m, 2h (a plain number is minutes); at the limit the "
        "command is stopped and the exit status is 124",
    ),
    ("--cpus", None, "LIST", "run on these CPUs only, e.g. 0-3,8"),
    (
        "--grace",
        None,
        "DURATION",
        "how long the command may take to stop after the polite signal before it "
        "is killed (a plain number is seconds; default 10s)",
    ),
    ("--signal", "-s", "SIGNAL", "the polite stop signal (default TERM)"),
    ("--env", "-e", "NAME=VALUE", "set a variable for the command (repeatable)"),
    ("--pass-env", None, "NAME", "pass this variable through from here (repeatable)"),
    ("--verbose", "-v", None, "print the stop report on stderr"),
    ("--help", "-h", None, "show this message and exit"),
)


class UsageError(Exception):
    pass


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
        self.verbose = False
        self.help = False


def help_text(
    usage: str = USAGE, options: tuple[tuple[str, str | None, str | None, str], ...] = OPTIONS
) -> str:
    lines = [f"Usage: {usage}", ""]
    for long, short, meta, text in options:
        name = f"{short}, {long}" if short else f"    {long}"
        if meta:
            name += f" {meta}"
        lines.append(f"  {name:<26} {text}")
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
        "--signal",
        text,
        "a signal name or number such as TERM, INT, HUP "
        "(not KILL or STOP: the polite signal must be catchable)",
    )


def split_options(
    argv: list[str], table: tuple[tuple[str, str | None, str | None, str], ...]
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
            raise UsageError(f"no such option: {name}")
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


def parse_run_args(argv: list[str]) -> RunArgs:
    """Strictly parse ``hold run`` arguments; raises UsageError or BadValue."""
    from supervisor.environ import check_name, parse_assignment

    opts, command = split_options(argv, OPTIONS)
    args = RunArgs(command=command)
    for long, value in opts:
        if long == "--help":
            args.help = True
        elif long == "--verbose":
            args.verbose = True
        elif value is None:
            raise AssertionError(long)
        elif long == "--time":
            args.time = parse_duration(value, what="-t/--time", plain_unit="minutes")
        elif long == "--cpus":
            args.cpus = parse_cpus(value, what="--cpus")
        elif long == "--grace":
            args.grace = parse_duration(
                value, what="--grace", plain_unit="seconds", allow_zero=True
            )
        elif long == "--signal":
            args.signal = parse_signal(value)
        elif long == "--env":
            k, v = parse_assignment(value, where="--env")
            args.env[k] = v
        elif long == "--pass-env":
            args.pass_env.append(check_name(value, where="--pass-env"))
    if not args.help and not args.command:
        raise UsageError("no command given (hold run [OPTIONS] -- COMMAND [ARG...])")
    return args


def main_run(argv: list[str], prog: str = "hold run") -> int:
    """``hold run``; returns the exit status (see the README's table)."""
    try:
        args = parse_run_args(argv)
    except (UsageError, BadValue) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    if args.help:
        print(help_text())
        return 0
    try:
        from hold.config import load

        cfg = load()
    except BadValue as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    return execute(args, cfg.cgroups, prog)


def execute(args: RunArgs, cgroups: str, prog: str) -> int:
    from supervisor.cgroup import CgroupUnavailable, Hierarchy
    from supervisor.environ import minimal_env
    from supervisor.foreground import Foreground, is_foreground_tty
    from supervisor.spawn import SpawnError

    hierarchy = None
    if cgroups != "off":
        try:
            hierarchy = Hierarchy.find()
        except CgroupUnavailable as e:
            if cgroups == "required":
                print(f"{prog}: cgroups: required, but {e}", file=sys.stderr)
                return 2
    tree_id = os.urandom(6).hex()
    env = minimal_env(os.environ, tree_id=tree_id, pass_names=args.pass_env, extra=args.env)
    fg = Foreground(
        args.command,
        env=env,
        tree_id=tree_id,
        cpus=args.cpus,
        timeout=args.time,
        grace=args.grace,
        stop_signal=args.signal,
        hierarchy=hierarchy,
        interactive=is_foreground_tty(0),
    )
    try:
        result = fg.run()
    except SpawnError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return e.exit_code
    report = result.report
    if args.verbose or report.survivors:
        print(f"{prog}: {report.summary()}", file=sys.stderr)
    if result.cause.kind == "expired":
        print(f"{prog}: {result.cause.detail}; stopped", file=sys.stderr)
    return result.exit_code
