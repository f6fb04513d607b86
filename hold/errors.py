"""The root of every error ``hold`` raises on purpose (see :mod:`supervisor.errors`,
its counterpart: ``hold.entry`` turns either into an exit status in one place)."""

from __future__ import annotations

from supervisor.exitcodes import TOOL


class HoldError(Exception):
    """Refused or failed on purpose; ``exit_code`` is what a command exits with."""

    exit_code: int = TOOL
