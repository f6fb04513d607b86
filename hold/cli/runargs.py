"""``hold run`` / ``npu-hold`` / ``gpu-hold`` options: the table, the parser, ``--help``.

Hand-written rather than click's: this is the hot path (``npu-hold -- true``
is a benchmark), and importing click alone costs several times Python's own
start-up. The option table below is the single source for the parser and for
``--help``. Short options combine as with ``getopt``: ``-vt 1m``, ``-t1m``,
``-vd npu``.
"""

from __future__ import annotations

import signal

from hold.errors import HoldError
from hold_supervisor import exitcodes
from hold_supervisor.parse import BadValue, parse_cpus, parse_duration

USAGE = "hold run [OPTIONS] -- COMMAND [ARG...]"
HELP_WIDTH = 80  # --help fits an 80-column terminal
NAME_WIDTH = 30  # the option column of --help

# (long, short, metavar or None for a flag, help)
Option = tuple[str, str | None, str | None, str]
OPTIONS: tuple[Option, ...] = (
    (
        "--time",
        "-t",
        "DURATION",
        "time limit: 90s, 4m, 2h, 1h30m (a plain number is minutes); at the limit "
        "the command is stopped and the exit status is 124",
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
    (
        "--device",
        "-d",
        "CLASS[:INDEX,...]",
        "hold a lease on devices of this class (npu, gpu, or one configured) while "
        "the command runs",
    ),
    ("--label", "-l", "LABEL", "what the lease is for, shown to others (with --device)"),
    ("--count", "-n", "COUNT", "how many devices of the class (with --device; default 1)"),
    (
        "--wait-timeout",
        None,
        "DURATION",
        "give up waiting for the device after this long: exit 75 (plain number: seconds)",
    ),
    ("--no-wait", None, None, "exit 75 at once if the device is taken"),
    ("--private", None, None, "show the label to you and root only (with --device)"),
    (
        "--scratch",
        None,
        None,
        "a fresh private directory for the command, in $HOLD_SCRATCH, removed when "
        "it ends (under $XDG_CACHE_HOME/hold/scratch; refused with less than 1 GiB "
        "free, or the configuration's scratch: {min_free})",
    ),
    ("--keep-scratch", None, None, "keep the --scratch directory (its path is printed)"),
    (
        "--adopt",
        None,
        "PID",
        "no command: lease the device to PID, a running process of yours, and its "
        "descendants; wait until they end, and stop them when the lease ends (exit 0 "
        "when they ended by themselves)",
    ),
    ("--verbose", "-v", None, "print the stop report on stderr"),
    ("--version", None, None, "show the version and exit"),
    ("--help", "-h", None, "show this message and exit"),
)
FLAGS = {
    "--help": "help",
    "--version": "version",
    "--verbose": "verbose",
    "--no-wait": "no_wait",
    "--private": "private",
    "--scratch": "scratch",
    "--keep-scratch": "keep_scratch",
}


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
        self.scratch = False
        self.keep_scratch = False
        self.adopt: int | None = None  # --adopt PID: a running process, not a command
        self.verbose = False
        self.version = False
        self.help = False


def usage_for(prog: str) -> str:
    """The usage line of ``prog`` (``hold run``, ``npu-hold``, ``gpu-hold``)."""
    return USAGE if prog == "hold run" else f"{prog} [OPTIONS] -- COMMAND [ARG...]"


def help_text(usage: str = USAGE, options: tuple[Option, ...] = OPTIONS) -> str:
    """``--help``: every line within :data:`HELP_WIDTH` columns."""
    import textwrap  # only for --help

    indent = " " * (2 + NAME_WIDTH + 1)
    lines = [f"Usage: {usage}"]
    if usage.endswith("-- COMMAND [ARG...]"):
        lines.append(f"       {usage.removesuffix('-- COMMAND [ARG...]')}--adopt PID")
    lines.append("")
    for long, short, meta, text in options:
        name = f"{short}, {long}" if short else f"    {long}"
        if meta:
            name += f" {meta}"
        first = f"  {name:<{NAME_WIDTH}} "
        if len(first) > len(indent):  # a long name: the text starts on the next line
            lines.append(first.rstrip())
            first = indent
        lines.extend(
            textwrap.wrap(text, HELP_WIDTH, initial_indent=first, subsequent_indent=indent)
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


Opts = list[tuple[str, str | None]]
Names = dict[str, tuple[str, str | None]]  # -t and --time -> (--time, its metavar)


def split_options(argv: list[str], table: tuple[Option, ...]) -> tuple[Opts, list[str]]:
    """Split ``argv`` into ``[(long, value)]`` and the command after them.

    Options end at ``--`` or at the first argument that is not an option, as
    for ``timeout(1)``: ``hold run sleep -t 5`` runs ``sleep -t 5``. Short
    options combine as with ``getopt``: ``-vt 1m`` and ``-vt1m`` are ``-v -t 1m``.
    """
    by_name: Names = {}
    for long, short, meta, _ in table:
        by_name[long] = (long, meta)
        if short:
            by_name[short] = (long, meta)
    out: Opts = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return out, argv[i + 1 :]
        if not arg.startswith("-") or arg == "-":
            return out, argv[i:]
        step = _long if arg.startswith("--") else _shorts
        i = step(argv, i, by_name, out) + 1
    return out, []


def _option(name: str, by_name: Names, arg: str) -> tuple[str, str | None]:
    if name not in by_name:
        from hold_supervisor.parse import did_you_mean

        inside = f" (in {arg})" if name != arg else ""
        raise UsageError(f"no such option: {name}{inside}{did_you_mean(name, list(by_name))}")
    return by_name[name]


def _long(argv: list[str], i: int, by_name: Names, out: Opts) -> int:
    """``--name``, ``--name=value`` or ``--name value`` at ``argv[i]``; the index of its
    last word."""
    name, eq, value = argv[i].partition("=")
    long, meta = _option(name, by_name, name)
    if meta is None:
        if eq:
            raise UsageError(f"option {name} takes no value")
        out.append((long, None))
        return i
    if not eq:
        i += 1
        if i >= len(argv):
            raise UsageError(f"option {name} needs a value ({meta})")
        value = argv[i]
    out.append((long, value))
    return i


def _shorts(argv: list[str], i: int, by_name: Names, out: Opts) -> int:
    """``-v``, ``-t 5``, ``-t5``, ``-vt 5``, ``-vt5`` at ``argv[i]``; the index of its last word."""
    arg = argv[i]
    for j in range(1, len(arg)):
        name = "-" + arg[j]
        long, meta = _option(name, by_name, arg)
        if meta is None:
            out.append((long, None))
            continue
        value = arg[j + 1 :]
        if not value:
            i += 1
            if i >= len(argv):
                raise UsageError(f"option {name} needs a value ({meta})")
            value = argv[i]
        out.append((long, value))
        break
    return i


def parse_run_args(argv: list[str], *, device: str | None = None, usage: str = USAGE) -> RunArgs:
    """Strictly parse ``hold run`` arguments; raises UsageError or BadValue."""
    opts, command = split_options(argv, OPTIONS)
    args = RunArgs(command=command)
    args.device = device
    for long, value in opts:
        if long in FLAGS:
            setattr(args, FLAGS[long], True)
        elif value is None:
            raise AssertionError(long)
        else:
            _set(args, long, value)
    if args.help or args.version:
        return args
    if not args.command and args.adopt is None:
        raise UsageError(f"no command given ({usage})")
    _check(args)
    return args


def _set(args: RunArgs, long: str, value: str) -> None:
    """One option with a value, read strictly into ``args``."""
    from hold_supervisor.environ import check_name, parse_assignment

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
        from hold.protocol import check_label

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
