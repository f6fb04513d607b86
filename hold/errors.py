"""The root of every error ``hold`` raises on purpose (see :mod:`hold_supervisor.errors`,
its counterpart: ``hold.cli.entry`` turns either into an exit status in one place)."""

from __future__ import annotations

from hold_supervisor.errors import SupervisorError
from hold_supervisor.exitcodes import TOOL


class HoldError(Exception):
    """Refused or failed on purpose; ``exit_code`` is what a command exits with."""

    exit_code: int = TOOL


def describe(e: BaseException) -> str:
    """``e`` in words for a person: an OS error as the system says it and the file it
    names (``No such file or directory: /run/x``), anything else by its message --
    never its repr (``FileNotFoundError(2, '...')`` told nobody what failed)."""
    if isinstance(e, OSError) and e.strerror:
        names = [n for n in (e.filename, e.filename2) if n is not None]
        return e.strerror + (f": {' -> '.join(map(str, names))}" if names else "")
    text = str(e)
    if isinstance(e, (HoldError, SupervisorError)) and text:
        return text  # worded on purpose already
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
