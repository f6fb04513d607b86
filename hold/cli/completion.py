"""Shell completion (bash, zsh, fish) for ``hold``, ``npu-hold`` and ``gpu-hold``:
click's side.

``hold completion SHELL`` prints one script for the three programs, made by
click (:mod:`click.shell_completion`). The shell calls the program itself with
``_HOLD_COMPLETE`` (``_NPU_HOLD_COMPLETE``, ``_GPU_HOLD_COMPLETE``) set and the
words typed so far in ``COMP_WORDS``/``COMP_CWORD``. The words asked most often
(a command's name, a stack's name, every word of ``npu-hold``) are answered
without click, by :mod:`hold.cli.answers`; the rest comes here:

* ``hold``: its click group answers (subcommands, options, and the values
  through ``shell_complete`` callbacks, from :mod:`hold.cli.answers`);
* ``hold run``, ``npu-hold``, ``gpu-hold``: their options are parsed by hand
  (:mod:`hold.cli.options`, kept off click for start-up time), so a small click
  command stands in for them *only while completing* (:func:`complete_program`)
  and answers from the option table itself.

Nothing here is imported on the normal path of any program."""

from __future__ import annotations

import os
from typing import Any

import click
from click.shell_completion import CompletionItem, get_completion_class, shell_complete

from hold.cli import answers
from hold.cli.answers import complete_var

SHELLS = ("bash", "zsh", "fish")
PROGRAMS = ("hold", "npu-hold", "gpu-hold")
WORDS = "hold.cli.completion.words"  # ctx.meta: the raw words of a run command line


# ---------------------------------------------------------------------- values


def _click_items(found: list[answers.Item]) -> list[CompletionItem]:
    return [CompletionItem(i.value, type=i.type, help=i.help) for i in found]


def class_values(_ctx: Any, _param: Any, incomplete: str) -> list[CompletionItem]:
    """``shell_complete`` of a ``--device CLASS`` option."""
    return _click_items(answers.items(answers.device_classes(), incomplete))


def stack_values(_ctx: Any, _param: Any, incomplete: str) -> list[CompletionItem]:
    """``shell_complete`` of a stack NAME argument."""
    return _click_items(answers.items(answers.stack_names(), incomplete))


def unit_values(ctx: click.Context, _param: Any, incomplete: str) -> list[CompletionItem]:
    """``shell_complete`` of a UNIT argument (after NAME); ``hold call``: task units."""
    name = ctx.params.get("name")
    if not isinstance(name, str):
        return []
    kind = "task" if ctx.command.name == "call" else None
    return _click_items(answers.items(answers.unit_names(name, kind), incomplete))


# ---------------------------------------------------------------------- run, npu-hold


def complete_run(words: list[str], incomplete: str) -> list[CompletionItem]:
    """What may follow ``words`` (after ``hold run`` / ``npu-hold``) at ``incomplete``."""
    return _click_items(answers.complete_run(words, incomplete))


class RunCommand(click.Command):
    """A command whose options are ``hold run``'s (:mod:`hold.cli.options`): while
    completing, it keeps the words as typed (``--`` included, which click's parser
    drops) and answers from the option table."""

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
