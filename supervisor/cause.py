"""Why something is being stopped: one type for ``hold run``'s command and a stack."""

from __future__ import annotations

from typing import NamedTuple


class Cause(NamedTuple):
    """Why a command or a stack is being stopped.

    ``kind``: ``exited``, ``expired``, ``signal``, ``down``, ``time``,
    ``start``, ``unit``, ``internal``, or the caller's (``released``,
    ``lost``...); ``detail``: one line for people; ``code``: the exit status it
    implies for a stack (a command's own status is its own); ``signal``: the
    signal that asked for the stop, where one did.
    """

    kind: str
    detail: str = ""
    code: int = 0
    signal: int | None = None
