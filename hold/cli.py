"""The ``hold`` command group (everything but the hot path, see :mod:`hold.entry`)."""

from __future__ import annotations

import click

from hold.runcmd import OPTIONS, help_text


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Device tickets and process supervision: nothing outlives what started it."""


@cli.command(
    "run",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    add_help_option=False,
    help="Run COMMAND; when it ends, everything it started ends. " + f"({len(OPTIONS)} options: "
    "hold run --help)",
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run_cmd(args: tuple[str, ...]) -> None:
    from hold.runcmd import main_run

    raise SystemExit(main_run(list(args)))


__all__ = ["cli", "help_text"]
