"""The options of the commands read without click: one table per command, one parser.

``hold run``/``npu-hold``/``gpu-hold``, ``hold audit``, ``hold up`` and ``hold
down`` are read here before click is imported: their start-up is a benchmark
(``npu-hold -- true``, a stack's start and stop) and importing click alone costs
several times Python's own. Each command's options are declared once, as a
table of :class:`Option` rows below; the plain parser (:func:`split_options`,
:func:`plain_line`) reads a line by it, ``hold run --help`` is rendered from it
(:mod:`hold.cli.runargs`), TAB answers from it (:mod:`hold.cli.answers`), and
:mod:`hold.cli.group` makes the click options of ``audit``, ``up`` and
``down`` from it (``--help``, errors and every other command stay click's:
usage, help and completion for twenty commands are what click is for).

Short options combine as with ``getopt``: ``-vt 1m``, ``-t1m``, ``-vd npu``.
No click and no dataclasses here: this module is on the hot path.
"""

from __future__ import annotations

from hold.errors import HoldError
from hold_supervisor import exitcodes

TYPE_CHECKING = False  # not typing's: a TAB needs no typing; mypy reads the name as its
if TYPE_CHECKING:
    from typing import Any


class UsageError(HoldError):
    """Options that do not make a command line (exit 2)."""

    exit_code = exitcodes.USAGE


class Option:
    """One option: ``--long``, ``-s``, its value's metavar (None: a flag), its help;
    ``dest``: the name its value is read into (``--no-wait``: ``no_wait``);
    ``default``: its value when absent; ``integer``: the value a whole number;
    ``values``: what TAB offers for the value (``classes``, ``signals``, ``env``).

    A plain class: ``dataclasses`` would be an import of the hot path."""

    __slots__ = (
        "default",
        "dest",
        "help",
        "hidden",
        "integer",
        "long",
        "metavar",
        "short",
        "values",
    )

    def __init__(
        self,
        long: str,
        short: str | None,
        metavar: str | None,
        help: str,
        *,
        dest: str | None = None,
        default: str | None = None,
        integer: bool = False,
        hidden: bool = False,
        values: str | None = None,
    ) -> None:
        self.long = long
        self.short = short
        self.metavar = metavar
        self.help = help
        self.dest = dest or long[2:].replace("-", "_")
        self.default = default
        self.integer = integer
        self.hidden = hidden
        self.values = values

    @property
    def flag(self) -> bool:
        """True for an option without a value."""
        return self.metavar is None


Table = tuple[Option, ...]

RUN_OPTIONS: Table = (
    Option(
        "--time",
        "-t",
        "DURATION",
        "time limit: 90s, 4m, 2h, 1h30m (a plain number is minutes); at the limit "
        "the command is stopped and the exit status is 124",
    ),
    Option("--cpus", None, "LIST", "run on these CPUs only, e.g. 0-3,8"),
    Option(
        "--grace",
        None,
        "DURATION",
        "how long the command may take to stop after the polite signal before it "
        "is killed (a plain number is seconds; default 10s)",
    ),
    Option("--signal", "-s", "SIGNAL", "the polite stop signal (default TERM)", values="signals"),
    Option("--env", "-e", "NAME=VALUE", "set a variable for the command (repeatable)"),
    Option(
        "--pass-env",
        None,
        "NAME",
        "pass this variable through from here (repeatable)",
        values="env",
    ),
    Option(
        "--device",
        "-d",
        "CLASS[:INDEX,...]",
        "hold a lease on devices of this class (npu, gpu, or one configured) while "
        "the command runs",
        values="classes",
    ),
    Option("--label", "-l", "LABEL", "what the lease is for, shown to others (with --device)"),
    Option("--count", "-n", "COUNT", "how many devices of the class (with --device; default 1)"),
    Option(
        "--wait-timeout",
        None,
        "DURATION",
        "give up waiting for the device after this long: exit 75 (plain number: seconds)",
    ),
    Option("--no-wait", None, None, "exit 75 at once if the device is taken"),
    Option("--private", None, None, "show the label to you and root only (with --device)"),
    Option(
        "--scratch",
        None,
        None,
        "a fresh private directory for the command, in $HOLD_SCRATCH, removed when "
        "it ends (under $XDG_CACHE_HOME/hold/scratch; refused with less than 1 GiB "
        "free, or the configuration's scratch: {min_free})",
    ),
    Option("--keep-scratch", None, None, "keep the --scratch directory (its path is printed)"),
    Option(
        "--adopt",
        None,
        "PID",
        "no command: lease the device to PID, a running process of yours, and its "
        "descendants; wait until they end, and stop them when the lease ends (exit 0 "
        "when they ended by themselves)",
    ),
    Option("--verbose", "-v", None, "print the stop report on stderr"),
    Option("--version", None, None, "show the version and exit"),
    Option("--help", "-h", None, "show this message and exit"),
)

# `hold audit`, `hold up FILE`, `hold down NAME`: click renders their --help and
# errors from these (hold.cli.group); a plainly valid line is read without it.
AUDIT_OPTIONS: Table = (
    Option(
        "--device",
        None,
        "CLASS[:INDEX,...]",
        "Only this device class (only these of its devices).",
        dest="cls",
        values="classes",
    ),
    Option("--user", None, "USER", "Only this user's processes (or uid)."),
    Option("--json", None, None, "Machine-readable output (schema v1).", dest="as_json"),
    Option("--kill", None, None, "Stop the trees of stray holders."),
    Option("--yes", None, None, "With --kill: do not ask."),
    Option("--grace", None, "TEXT", "With --kill: grace period.", default="10s"),
    Option("--log", None, "FILE", "Append a JSON line per stray to FILE."),
)
UP_OPTIONS: Table = (
    Option("--detach", "-d", None, "Run in the background; return once it is up."),
    Option("--for", None, "DURATION", "Stop the stack this long after it is up.", dest="run_for"),
    Option(
        "--status-fd",
        None,
        "FD",
        "The status pipe (the background supervisor).",
        integer=True,
        hidden=True,
    ),
)
DOWN_OPTIONS: Table = ()

Opts = list[tuple[Option, str | None]]
Names = dict[str, Option]  # -t and --time -> the --time row


def names(table: Table) -> Names:
    """Every spelling of ``table``'s options (``--time``, ``-t``) and its row."""
    out: Names = {}
    for opt in table:
        out[opt.long] = opt
        if opt.short:
            out[opt.short] = opt
    return out


def split_options(
    argv: list[str], table: Table, *, interspersed: bool = False
) -> tuple[Opts, list[str]]:
    """Split ``argv`` into ``[(row, value)]`` and the arguments; raises UsageError.

    Options end at ``--`` or, unless ``interspersed``, at the first argument that
    is not an option, as for ``timeout(1)``: ``hold run sleep -t 5`` runs ``sleep
    -t 5``. Short options combine as with ``getopt``: ``-vt 1m`` and ``-vt1m``
    are ``-v -t 1m``.
    """
    by_name = names(table)
    out: Opts = []
    args: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return out, args + argv[i + 1 :]
        if not arg.startswith("-") or arg == "-":
            if not interspersed:
                return out, argv[i:]
            args.append(arg)
            i += 1
            continue
        step = _long if arg.startswith("--") else _shorts
        i = step(argv, i, by_name, out) + 1
    return out, args


def _option(name: str, by_name: Names, arg: str) -> Option:
    if name not in by_name:
        from hold_supervisor.parse import did_you_mean  # lazy: only for a wrong option

        inside = f" (in {arg})" if name != arg else ""
        raise UsageError(f"no such option: {name}{inside}{did_you_mean(name, list(by_name))}")
    return by_name[name]


def _long(argv: list[str], i: int, by_name: Names, out: Opts) -> int:
    """``--name``, ``--name=value`` or ``--name value`` at ``argv[i]``; the index of its
    last word."""
    name, eq, value = argv[i].partition("=")
    opt = _option(name, by_name, name)
    if opt.flag:
        if eq:
            raise UsageError(f"option {name} takes no value")
        out.append((opt, None))
        return i
    if not eq:
        i += 1
        if i >= len(argv):
            raise UsageError(f"option {name} needs a value ({opt.metavar})")
        value = argv[i]
    out.append((opt, value))
    return i


def _shorts(argv: list[str], i: int, by_name: Names, out: Opts) -> int:
    """``-v``, ``-t 5``, ``-t5``, ``-vt 5``, ``-vt5`` at ``argv[i]``; the index of its last word."""
    arg = argv[i]
    for j in range(1, len(arg)):
        name = "-" + arg[j]
        opt = _option(name, by_name, arg)
        if opt.flag:
            out.append((opt, None))
            continue
        value = arg[j + 1 :]
        if not value:
            i += 1
            if i >= len(argv):
                raise UsageError(f"option {name} needs a value ({opt.metavar})")
            value = argv[i]
        out.append((opt, value))
        break
    return i


def plain_line(argv: list[str], table: Table, nargs: int) -> tuple[dict[str, Any], list[str]]:
    """A command line of a click command read without click, as click would read it:
    each option's value by its ``dest`` (its default where absent, the last of a
    repeated one, True for a flag) and the ``nargs`` arguments (options and
    arguments in any order). Raises UsageError for anything else (``--help``, an
    unknown option, a missing value, another count of arguments, a bad integer):
    the caller hands that line to click, for click's own words."""
    opts, args = split_options(argv, table, interspersed=True)
    if len(args) != nargs:
        raise UsageError(f"{len(args)} arguments, not {nargs}")
    values: dict[str, Any] = {opt.dest: False if opt.flag else opt.default for opt in table}
    for opt, value in opts:
        if value is None:
            values[opt.dest] = True
        elif opt.integer:
            try:
                values[opt.dest] = int(value)
            except ValueError:
                raise UsageError(f"{opt.long}: not a whole number") from None
        else:
            values[opt.dest] = value
    return values, args


def pending(words: list[str], table: Table) -> tuple[Option | None, bool]:
    """After ``words`` (options typed so far, some maybe unknown: a TAB's reading):
    the option still waiting for its value, and whether the options have ended."""
    by_name = names(table)
    waiting: Option | None = None
    for word in words:
        if waiting is not None:
            waiting = None
            continue
        if word == "--" or not word.startswith("-") or word == "-":
            return None, True
        if word.startswith("--"):
            opt = by_name.get(word)
            waiting = opt if opt is not None and not opt.flag and "=" not in word else None
            continue
        for j in range(1, len(word)):  # -vt: the first letter that takes a value ends it
            opt = by_name.get("-" + word[j])
            if opt is not None and not opt.flag:
                waiting = opt if j == len(word) - 1 else None
                break
    return waiting, False
