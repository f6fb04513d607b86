"""``hold run`` / ``npu-hold`` / ``gpu-hold`` options: their values read strictly,
what they say together, ``--help``.

Without click: this is the hot path (``npu-hold -- true`` is a benchmark). The
options are :data:`hold.cli.options.RUN_OPTIONS`, split by
:func:`hold.cli.options.split_options` (``-vt 1m`` is ``-v -t 1m``).
"""

from __future__ import annotations

import signal

from hold.cli.options import RUN_OPTIONS, Table, UsageError, split_options
from hold.protocol import check_label
from hold_supervisor.environ import check_name, parse_assignment
from hold_supervisor.parse import BadValue, parse_cpus, parse_duration

USAGE = "hold run [OPTIONS] -- COMMAND [ARG...]"
HELP_WIDTH = 80  # --help fits an 80-column terminal
NAME_WIDTH = 30  # the option column of --help


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
        self.scratch = False
        self.keep_scratch = False
        self.adopt: int | None = None  # --adopt PID: a running process, not a command
        self.verbose = False
        self.version = False
        self.help = False


def usage_for(prog: str) -> str:
    """The usage line of ``prog`` (``hold run``, ``npu-hold``, ``gpu-hold``)."""
    return USAGE if prog == "hold run" else f"{prog} [OPTIONS] -- COMMAND [ARG...]"


def help_text(usage: str = USAGE, options: Table = RUN_OPTIONS) -> str:
    """``--help``: every line within :data:`HELP_WIDTH` columns."""
    import textwrap  # lazy: only for --help

    indent = " " * (2 + NAME_WIDTH + 1)
    lines = [f"Usage: {usage}"]
    if usage.endswith("-- COMMAND [ARG...]"):
        lines.append(f"       {usage.removesuffix('-- COMMAND [ARG...]')}--adopt PID")
    lines.append("")
    for opt in options:
        name = f"{opt.short}, {opt.long}" if opt.short else f"    {opt.long}"
        if opt.metavar:
            name += f" {opt.metavar}"
        first = f"  {name:<{NAME_WIDTH}} "
        if len(first) > len(indent):  # a long name: the text starts on the next line
            lines.append(first.rstrip())
            first = indent
        lines.extend(
            textwrap.wrap(opt.help, HELP_WIDTH, initial_indent=first, subsequent_indent=indent)
        )
    lines += [
        "",
        "Short options combine: -vt 1m is -v -t 1m. Options end at -- or at the",
        "first argument that is not one.",
    ]
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


def parse_run_args(argv: list[str], *, device: str | None = None, usage: str = USAGE) -> RunArgs:
    """Strictly parse ``hold run`` arguments; raises UsageError or BadValue."""
    opts, command = split_options(argv, RUN_OPTIONS)
    args = RunArgs(command=command)
    args.device = device
    for opt, value in opts:
        if value is None:  # a flag
            setattr(args, opt.dest, True)
        else:
            _set(args, opt.long, value)
    if args.help or args.version:
        return args
    if not args.command and args.adopt is None:
        raise UsageError(f"no command given ({usage})")
    _check(args)
    return args


def _set(args: RunArgs, long: str, value: str) -> None:
    """One option with a value, read strictly into ``args``."""
    if long == "--time":
        args.time = parse_duration(value, what="-t/--time", plain_unit="minutes")
    elif long == "--cpus":
        args.cpus = parse_cpus(value, what="--cpus")
    elif long == "--grace":
        args.grace = parse_duration(value, what="--grace", plain_unit="seconds", allow_zero=True)
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
    elif long == "--adopt":
        if not value.isascii() or not value.isdigit() or not 0 < int(value) < 1 << 22:
            raise BadValue("--adopt", value, "a process id (a whole number, 1 or more)")
        args.adopt = int(value)
    elif long == "--wait-timeout":
        args.wait_timeout = parse_duration(
            value, what="--wait-timeout", plain_unit="seconds", allow_zero=True
        )
    else:
        raise AssertionError(long)


def _check(args: RunArgs) -> None:
    """What the options say together."""
    if args.adopt is not None:
        _check_adopt(args)
    if args.device is None:
        for flag, given in (
            ("--label", args.label),
            ("--count", args.count),
            ("--wait-timeout", args.wait_timeout),
            ("--no-wait", args.no_wait or None),
            ("--private", args.private or None),
        ):
            if given is not None:
                raise UsageError(f"{flag} needs --device (or npu-hold / gpu-hold)")
    if args.label is not None:
        why = check_label(args.label)
        if why:
            raise BadValue("-l/--label", args.label, why)
    if args.no_wait and args.wait_timeout is not None:
        raise UsageError("--no-wait and --wait-timeout exclude each other")


def _check_adopt(args: RunArgs) -> None:
    """What ``--adopt`` excludes: a command, and what only a new process can be given."""
    if args.command:
        raise UsageError(
            "--adopt takes no command: it leases the device to a process that "
            f"runs already (got {args.command[0]!r})"
        )
    if args.device is None:
        raise UsageError("--adopt needs --device (or npu-hold / gpu-hold)")
    for flag, given in (
        ("--cpus", args.cpus),
        ("--env", args.env or None),
        ("--pass-env", args.pass_env or None),
    ):
        if given is not None:
            raise UsageError(f"{flag} does not apply with --adopt: the process runs already")
