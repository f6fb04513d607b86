"""One declaration of each fast command's options (``hold.cli.options``), read two ways.

``hold audit``, ``hold up`` and ``hold down`` are read by the plain parser when
their line is plainly valid and by click otherwise (``--help``, errors); click's
options are made from the same table. Each row, each spelling, parsed both
ways, must give the same values; what the plain parser refuses, click answers.
"""

from __future__ import annotations

import click
import pytest

from hold.cli.group import cli
from hold.cli.options import (
    AUDIT_OPTIONS,
    DOWN_OPTIONS,
    RUN_OPTIONS,
    UP_OPTIONS,
    Option,
    Table,
    UsageError,
    plain_line,
    split_options,
)

COMMANDS: dict[str, tuple[Table, list[str]]] = {
    "audit": (AUDIT_OPTIONS, []),
    "up": (UP_OPTIONS, ["stack.yaml"]),
    "down": (DOWN_OPTIONS, ["web"]),
}


def by_click(command: str, args: list[str]) -> tuple[dict[str, object], list[str]]:
    """The values click reads from ``args``, its arguments apart (by the command's order)."""
    cmd = cli.commands[command]
    params = dict(cmd.make_context(command, list(args)).params)
    positional = [p.name for p in cmd.params if isinstance(p, click.Argument)]
    return {k: v for k, v in params.items() if k not in positional}, [
        str(params[name]) for name in positional if name is not None
    ]


def spellings(opt: Option, value: str) -> list[list[str]]:
    """Every way to write ``opt`` (with ``value`` where it takes one)."""
    names = [opt.long, opt.short] if opt.short else [opt.long]
    if opt.flag:
        return [[n] for n in names]
    out = [[n, value] for n in names] + [[f"{opt.long}={value}"]]
    if opt.short:
        out.append([opt.short + value])
    return out


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_click_declares_the_tables_options(command: str) -> None:
    table, _ = COMMANDS[command]
    declared = {
        name
        for p in cli.commands[command].params
        if isinstance(p, click.Option) and p.name != "help"
        for name in p.opts
    }
    assert declared == {n for o in table for n in (o.long, o.short) if n}
    hidden = {p.opts[0] for p in cli.commands[command].params if getattr(p, "hidden", False)}
    assert hidden == {o.long for o in table if o.hidden}


@pytest.mark.parametrize(
    ("command", "opt", "words"),
    [
        (command, opt.long, words)
        for command, (table, _) in sorted(COMMANDS.items())
        for opt in table
        for words in spellings(opt, "7")
    ],
)
def test_every_row_reads_alike_both_ways(command: str, opt: str, words: list[str]) -> None:
    table, args = COMMANDS[command]
    for line in (words + args, args + words):  # click takes options after the arguments too
        assert plain_line(line, table, len(args)) == by_click(command, line), line


@pytest.mark.parametrize(
    "line",
    [
        [],
        ["--json"],
        ["--device", "fake", "--json"],
        ["--device=fake"],
        ["--grace=0", "--json"],
        ["--kill", "--yes", "--grace", "2s"],
        ["--device", "a", "--device", "b", "--json", "--json"],  # the last counts
        ["--grace", "-1"],  # a value that looks like an option is still the value
        ["--device", "--json"],
        ["--"],
    ],
)
def test_audit_lines_read_alike(line: list[str]) -> None:
    assert plain_line(line, AUDIT_OPTIONS, 0) == by_click("audit", line)


@pytest.mark.parametrize(
    "line",
    [
        ["-d", "s.yaml"],
        ["s.yaml", "--detach", "--for", "5m"],
        ["--for=1h", "-d", "--status-fd", "3", "s.yaml"],
        ["--", "-s.yaml"],
        ["-"],
    ],
)
def test_up_lines_read_alike(line: list[str]) -> None:
    assert plain_line(line, UP_OPTIONS, 1) == by_click("up", line)


@pytest.mark.parametrize(
    ("command", "line"),
    [
        ("audit", ["--help"]),
        ("audit", ["-h"]),
        ("audit", ["--bogus"]),
        ("audit", ["--device"]),
        ("audit", ["--json=1"]),
        ("audit", ["x"]),
        ("up", []),
        ("up", ["a", "b"]),
        ("up", ["--status-fd", "x", "a"]),
        ("up", ["--detach=1", "a"]),
        ("down", []),
        ("down", ["--help"]),
        ("down", ["a", "b"]),
        ("down", ["-x"]),
    ],
)
def test_what_the_plain_parser_refuses_is_clicks(command: str, line: list[str]) -> None:
    """Refused here, the line goes to click, which says why (exit 2) or prints help."""
    table, args = COMMANDS[command]
    with pytest.raises(UsageError):
        plain_line(line, table, len(args))
    with pytest.raises((click.exceptions.Exit, click.UsageError)):
        cli.commands[command].make_context(command, list(line))


def test_run_options_end_at_the_first_word_and_combine() -> None:
    opts, command = split_options(["-vt", "1m", "sleep", "-t", "5"], RUN_OPTIONS)
    assert [(o.long, v) for o, v in opts] == [("--verbose", None), ("--time", "1m")]
    assert command == ["sleep", "-t", "5"]
    opts, command = split_options(["-vt1m", "--device=npu", "--", "-x"], RUN_OPTIONS)
    assert [(o.long, v) for o, v in opts] == [
        ("--verbose", None),
        ("--time", "1m"),
        ("--device", "npu"),
    ]
    assert command == ["-x"]
    with pytest.raises(UsageError, match=r"no such option: -x \(in -vx\)"):
        split_options(["-vx"], RUN_OPTIONS)
