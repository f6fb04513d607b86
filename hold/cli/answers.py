"""What TAB completes to, without click: the values (device classes, stacks,
units), the options of ``hold run``/``npu-hold``/``gpu-hold``, and the shell's
side of the exchange, for the words the shell asks most often.

Why by hand: a completion is a whole start of the program at every TAB, and
click alone is ~15 ms of imports (the group with it ~40 ms; 75-88 ms a TAB on
this machine, issue 25). The shell's side is click's own protocol
(:mod:`click.shell_completion`: ``COMP_WORDS``/``COMP_CWORD`` in, one item per
line out, per shell), reproduced here for bash, zsh and fish, for:

* ``npu-hold``/``gpu-hold``/``hold run``: every word (their options are
  :data:`hold.cli.options.RUN_OPTIONS`, which click never parses anyway; the
  values offered are each row's ``values``);
* ``hold``: the command name (first word) and a command's stack NAME (second
  word, for the commands in :data:`STACK_COMMANDS`).

Anything else (an option of another command, a unit, another shell) returns
None, and :mod:`hold.cli.completion` answers through click.
``tests/test_ux_completion.py`` holds each answer here to click's for the same
words, and :data:`COMMANDS` to the click group.
"""

from __future__ import annotations

import os
import shlex

# hold's commands as click lists them (sorted; hidden ones left out) and their
# one-line help: tests/test_ux_completion.py checks this against the group.
COMMANDS: tuple[tuple[str, str], ...] = (
    ("audit", "Every process holding a device node, and..."),
    ("call", "Run task UNIT of the running stack NAME..."),
    ("check", "Exit 0 if this process runs inside a live..."),
    ("completion", "Print the shell completion script of hold,..."),
    ("daemon", "Serve device leases for this state..."),
    ("down", "Stop stack NAME: reverse order, each..."),
    ("logs", "The output of stack NAME: every unit's,..."),
    ("metrics", "This machine's devices and tickets in..."),
    ("ps", "Running stacks, or the units of stack NAME."),
    ("release", "End a lease (yours, or any as root): its..."),
    ("report", "Who used which device, for how long: per..."),
    ("restart", "Stop UNIT of stack NAME (its whole tree)..."),
    ("run", "Run COMMAND; when it ends, everything it..."),
    ("status", "Each device, its holder, and its queue;..."),
    ("top", "A live view: devices (holder, time left,..."),
    ("up", "Start the units of a stack FILE in..."),
    ("validate", "Check a stack FILE without starting..."),
    ("web", "A read-only status page, live: devices,..."),
)
# The commands whose first argument is a stack NAME (completed from the stacks here).
STACK_COMMANDS = frozenset({"call", "down", "logs", "ps", "restart"})


def complete_var(prog: str) -> str:
    """The variable the shell sets for ``prog``: ``_NPU_HOLD_COMPLETE`` for ``npu-hold``."""
    return f"_{prog.replace('-', '_').upper()}_COMPLETE"


class Item:
    """One completion: click's ``CompletionItem`` (``type`` ``plain`` or ``file``).

    A plain class: ``typing.NamedTuple`` alone is ~3 ms of a TAB."""

    __slots__ = ("help", "type", "value")

    def __init__(self, value: str, type: str = "plain", help: str | None = None) -> None:
        self.value = value
        self.type = type
        self.help = help


# ---------------------------------------------------------------------- values


def device_classes() -> list[str]:
    """The configured device classes (nothing if the configuration does not read)."""
    # lazy: only for a TAB that asks for a class (a command's name needs none)
    from hold.config import load
    from hold.devices.classes import classes_from_config
    from hold_supervisor.parse import BadValue

    try:
        cfg = load()
        return sorted(classes_from_config(cfg.devices, cfg.path))
    except (BadValue, OSError):
        return []


def _stacks_dir() -> str | None:
    # lazy: only for a TAB that asks for a stack or a unit
    from hold.statedir import StateDir, default_path
    from hold_supervisor.parse import BadValue

    try:
        return StateDir(os.path.abspath(default_path())).stacks()
    except (BadValue, OSError):
        return None


def stack_names() -> list[str]:
    """The stacks that have run here: the directories under ``stacks``."""
    base = _stacks_dir()
    try:
        return sorted(e.name for e in os.scandir(base) if e.is_dir()) if base else []
    except OSError:
        return []


def unit_names(stack: str, kind: str | None = None) -> list[str]:
    """The units of ``stack``: from its file (named in its ``stack.json``), else
    from its logs; with ``kind`` (``task``) only those of that kind (file only)."""
    base = _stacks_dir()
    if not base or "/" in stack or stack in ("", ".", ".."):
        return []
    run_dir = os.path.join(base, stack)
    try:
        # lazy: the stack file's reader (YAML) only for a TAB that asks for a unit
        from hold_supervisor.documents import StackRecord
        from hold_supervisor.stackfile.load import load

        path = StackRecord.read(os.path.join(run_dir, "stack.json")).file
        units = load(path).units
        return sorted(n for n, u in units.items() if kind is None or u.kind == kind)
    except Exception:  # a stack file gone, edited or broken: fall back to the logs
        pass
    try:
        logs = os.listdir(os.path.join(run_dir, "logs"))
    except OSError:
        return []
    return sorted(f[:-4] for f in logs if f.endswith(".log") and len(f) > 4)


def items(values: list[str], incomplete: str, prefix: str = "") -> list[Item]:
    """``values`` (with ``prefix``) that start with ``incomplete``."""
    return [Item(prefix + v) for v in values if (prefix + v).startswith(incomplete)]


# ---------------------------------------------------------------------- run, npu-hold


SIGNALS = ["HUP", "INT", "QUIT", "TERM", "USR1", "USR2"]


def _value_of(values: str | None, incomplete: str, prefix: str = "") -> list[Item]:
    """The ``values`` of an option (its row's: ``classes``, ``signals``, ``env``) that
    start with ``incomplete``."""
    if values == "classes":
        return items(device_classes(), incomplete, prefix)
    if values == "signals":
        return items(SIGNALS, incomplete, prefix)
    if values == "env":
        return items(sorted(os.environ), incomplete, prefix)
    return []  # a duration, a CPU list, a label: nothing to offer


def complete_run(words: list[str], incomplete: str) -> list[Item]:
    """What may follow ``words`` (after ``hold run`` / ``npu-hold``) at ``incomplete``."""
    if words and words[-1] == "=":  # bash splits --device=np into --device, =, np
        words = words[:-1]
    from hold.cli.options import RUN_OPTIONS, pending  # lazy: hold's own TABs need no table

    waiting, ended = pending(words, RUN_OPTIONS)
    if ended:
        return [Item(incomplete, type="file")]  # the command and its arguments
    if waiting is not None:
        return _value_of(waiting.values, incomplete)
    if incomplete.startswith("--") and "=" in incomplete:
        name, _, value = incomplete.partition("=")
        values = next((o.values for o in RUN_OPTIONS if o.long == name), None)
        return _value_of(values, name + "=" + value, name + "=")
    if incomplete.startswith("-"):
        return [Item(o.long, help=o.help) for o in RUN_OPTIONS if o.long.startswith(incomplete)]
    return [Item(incomplete, type="file")]


# ---------------------------------------------------------------------- the shell's side


def split_words(line: str) -> list[str]:
    """``line`` split as a shell would, a missing closing quote or a trailing
    backslash forgiven (click's ``split_arg_string``)."""
    lex = shlex.shlex(line, posix=True)
    lex.whitespace_split = True
    lex.commenters = ""
    out: list[str] = []
    try:
        out.extend(lex)
    except ValueError:
        out.append(lex.token)  # the partial word, as typed so far
    return out


def asked(shell: str) -> tuple[list[str], str] | None:
    """The words before the one being completed, and that one (as typed so far),
    from the shell's variables; None if they are not there."""
    try:
        cwords = split_words(os.environ["COMP_WORDS"])
        if shell == "fish":
            incomplete = os.environ["COMP_CWORD"]
            if incomplete:
                incomplete = split_words(incomplete)[0]
            args = cwords[1:]
            if incomplete and args and args[-1] == incomplete:
                args.pop()  # fish has the partial word in both variables
            return args, incomplete
        cword = int(os.environ["COMP_CWORD"])
    except (KeyError, ValueError, IndexError):
        return None
    return cwords[1:cword], cwords[cword] if cword < len(cwords) else ""


def formatted(shell: str, item: Item) -> str:
    """``item`` as ``shell``'s completion script reads it (click's format)."""
    if shell == "zsh":
        help_ = item.help or "_"
        # _describe splits value from help at the first unescaped colon; compadd
        # (no help) takes the value as it is.
        value = item.value.replace(":", r"\:") if help_ != "_" else item.value
        return f"{item.type}\n{value}\n{help_}"
    if shell == "fish" and item.help:
        help_ = item.help.replace("\n", "\\n").replace("\t", " ")
        return f"{item.type},{item.value}\t{help_}"
    return f"{item.type},{item.value}"


def answer(prog: str, instruction: str) -> bool:
    """Answer the shell (to stdout) if the words are ones answered here; False
    leaves it to click. ``instruction`` is the completion variable's value
    (``bash_complete``, ``zsh_complete``, ``fish_complete``)."""
    shell, _, what = instruction.partition("_")
    if what != "complete" or shell not in ("bash", "zsh", "fish"):
        return False
    words = asked(shell)
    if words is None:
        return False
    args, incomplete = words
    found = _found(prog, args, incomplete)
    if found is None:
        return False
    print("\n".join(formatted(shell, i) for i in found))
    return True


def _found(prog: str, args: list[str], incomplete: str) -> list[Item] | None:
    if prog != "hold":
        return complete_run(args, incomplete)
    if args and args[0] == "run":
        return complete_run(args[1:], incomplete)
    if incomplete.startswith("-"):
        return None  # an option: click's (each command has its own)
    if not args:
        return [Item(name, help=text) for name, text in COMMANDS if name.startswith(incomplete)]
    if len(args) == 1 and args[0] in STACK_COMMANDS:
        return items(stack_names(), incomplete)
    return None
