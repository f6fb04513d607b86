"""The root of every error ``hold`` raises on purpose (see :mod:`hold_supervisor.errors`,
its counterpart: ``hold.cli.entry`` turns either into an exit status in one place)."""

from __future__ import annotations

from hold_supervisor.exitcodes import TOOL


class HoldError(Exception):
    """Refused or failed on purpose; ``exit_code`` is what a command exits with."""

    exit_code: int = TOOL
