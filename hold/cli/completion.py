"""Shell completion (bash, zsh, fish) for ``hold``, ``npu-hold`` and ``gpu-hold``.

``hold completion SHELL`` prints one script for the three programs, made by
click (:mod:`click.shell_completion`). The shell calls the program itself with
``_HOLD_COMPLETE`` (``_NPU_HOLD_COMPLETE``, ``_GPU_HOLD_COMPLETE``) set and the
words typed so far in ``COMP_WORDS``/``COMP_CWORD``:

* ``hold``: its click group answers (subcommands, options, and the values
  below through ``shell_complete`` callbacks);
* ``hold run``, ``npu-hold``, ``gpu-hold``: their options are parsed by hand
  (:mod:`hold.cli.runargs`, kept off click for start-up time), so a small click
  command stands in for them *only while completing*
  (:func:`complete_program`, reached from :mod:`hold.cli.entry` when the variable
  is set) and answers from the option table itself.

Values: device classes (the configuration), stack names (the directories
under the state directory's ``stacks``), the units of a stack (its file, as
named in its ``stack.json``; else its logs), signal names and variable names.
Nothing here is imported on the normal path of any program.
"""

from __future__ import annotations

import json
import os
from typing import Any

import click
from click.shell_completion import CompletionItem, get_completion_class

from hold.cli.runargs import OPTIONS

SHELLS = ("bash", "zsh", "fish")
PROGRAMS = ("hold", "npu-hold", "gpu-hold")
WORDS = "hold.cli.completion.words"  # ctx.meta: the raw words of a run command line


def complete_var(prog: str) -> str:
    """The variable click reads for ``prog``: ``_NPU_HOLD_COMPLETE`` for ``npu-hold``."""
    return f"_{prog.replace('-', '_').upper()}_COMPLETE"


# ---------------------------------------------------------------------- values


def device_classes() -> list[str]:
    """The configured device classes (nothing if the configuration does not read)."""
    from hold.config import load
    from hold.devices.classes import classes_from_config
    from hold_supervisor.parse import BadValue

    try:
        cfg = load()
        return sorted(classes_from_config(cfg.devices, cfg.path))
    except (BadValue, OSError):
        return []


def _stacks_dir() -> str | None:
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
        with open(os.path.join(run_dir, "stack.json"), encoding="utf-8") as f:
            path = json.load(f)["file"]
        from hold_supervisor.stackfile.load import load

        units = load(str(path)).units
        return sorted(n for n, u in units.items() if kind is None or u.kind == kind)
    except Exception:  # a stack file gone, edited or broken: fall back to the logs
        pass
    try:
        logs = os.listdir(os.path.join(run_dir, "logs"))
    except OSError:
        return []
    return sorted(f[:-4] for f in logs if f.endswith(".log") and len(f) > 4)


def _items(values: list[str], incomplete: str, prefix: str = "") -> list[CompletionItem]:
    return [CompletionItem(prefix + v) for v in values if (prefix + v).startswith(incomplete)]


def class_values(_ctx: Any, _param: Any, incomplete: str) -> list[CompletionItem]:
    """``shell_complete`` of a ``--device CLASS`` option."""
    return _items(device_classes(), incomplete)


def stack_values(_ctx: Any, _param: Any, incomplete: str) -> list[CompletionItem]:
    """``shell_complete`` of a stack NAME argument."""
    return _items(stack_names(), incomplete)


def unit_values(ctx: click.Context, _param: Any, incomplete: str) -> list[CompletionItem]:
    """``shell_complete`` of a UNIT argument (after NAME); ``hold call``: task units."""
    name = ctx.params.get("name")
    if not isinstance(name, str):
        return []
    kind = "task" if ctx.command.name == "call" else None
    return _items(unit_names(name, kind), incomplete)


# ---------------------------------------------------------------------- run, npu-hold


def _value_of(opt: str, incomplete: str, prefix: str = "") -> list[CompletionItem]:
    """Values of the run option ``opt`` (its long name) that start with ``incomplete``."""
    if opt == "--device":
        return _items(device_classes(), incomplete, prefix)
    if opt == "--signal":
        return _items(["HUP", "INT", "QUIT", "TERM", "USR1", "USR2"], incomplete, prefix)
    if opt == "--pass-env":
        return _items(sorted(os.environ), incomplete, prefix)
    return []  # a duration, a CPU list, a label: nothing to offer


def _pending(words: list[str]) -> tuple[str | None, bool]:
    """After ``words`` (the run options typed so far): the long name of an option
    still waiting for its value, and whether the options have ended."""
    by_name = {n: (long, meta) for long, short, meta, _ in OPTIONS for n in (long, short) if n}
    waiting: str | None = None
    for word in words:
        if waiting is not None:
            waiting = None
            continue
        if word == "--" or not word.startswith("-") or word == "-":
            return None, True
        if word.startswith("--"):
            long, meta = by_name.get(word, ("", None))
            waiting = long if meta is not None and "=" not in word else None
            continue
        for j in range(1, len(word)):  # -vt: the first letter that takes a value ends it
            long, meta = by_name.get("-" + word[j], ("", None))
            if meta is not None:
                waiting = long if j == len(word) - 1 else None
                break
    return waiting, False


def complete_run(words: list[str], incomplete: str) -> list[CompletionItem]:
    """What may follow ``words`` (after ``hold run`` / ``npu-hold``) at ``incomplete``."""
    if words and words[-1] == "=":  # bash splits --device=np into --device, =, np
        words = words[:-1]
    waiting, ended = _pending(words)
    if ended:
        return [CompletionItem(incomplete, type="file")]  # the command and its arguments
    if waiting is not None:
        return _value_of(waiting, incomplete)
    if incomplete.startswith("--") and "=" in incomplete:
        name, _, value = incomplete.partition("=")
        return _value_of(name, name + "=" + value, name + "=")
    if incomplete.startswith("-"):
        return [
            CompletionItem(long, help=text)
            for long, _s, _m, text in OPTIONS
            if long.startswith(incomplete)
        ]
    return [CompletionItem(incomplete, type="file")]


class RunCommand(click.Command):
    """A command whose options are :mod:`hold.cli.runargs`'s: while completing, it keeps
    the words as typed (``--`` included, which click's parser drops) and answers
    from the option table."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if ctx.resilient_parsing:
            ctx.meta[WORDS] = list(args)
        return super().parse_args(ctx, args)

    def shell_complete(self, ctx: click.Context, incomplete: str) -> list[CompletionItem]:
        return complete_run(list(ctx.meta.get(WORDS, [])), incomplete)


def _run_words(ctx: click.Context, _param: Any, incomplete: str) -> list[CompletionItem]:
    return complete_run(list(ctx.meta.get(WORDS, [])), incomplete)


def run_arguments() -> click.Argument:
    """The one argument of a :class:`RunCommand`: every word, completed from the table."""
    return click.Argument(["args"], nargs=-1, type=click.UNPROCESSED, shell_complete=_run_words)


RUN_SETTINGS: dict[str, Any] = {"ignore_unknown_options": True, "allow_interspersed_args": False}


def complete_program(prog: str) -> int:
    """``npu-hold`` / ``gpu-hold`` with their completion variable set: answer the shell."""
    from click.shell_completion import shell_complete

    cmd = RunCommand(
        prog, params=[run_arguments()], context_settings=RUN_SETTINGS, add_help_option=False
    )
    var = complete_var(prog)
    return shell_complete(cmd, {}, prog, var, os.environ.get(var, ""))


# ---------------------------------------------------------------------- the scripts


def script(shell: str, hold: click.Command) -> str:
    """The script to source in ``shell`` for ``hold`` (the click group), ``npu-hold``
    and ``gpu-hold``."""
    cls = get_completion_class(shell)
    if cls is None:
        raise click.BadParameter(f"{shell!r}: one of {', '.join(SHELLS)}")
    parts = []
    for prog in PROGRAMS:
        cmd = hold if prog == "hold" else RunCommand(prog, params=[run_arguments()])
        parts.append(cls(cmd, {}, prog, complete_var(prog)).source().strip())
    return "\n\n".join(parts) + "\n"
