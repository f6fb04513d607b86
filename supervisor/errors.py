"""The root of every error ``supervisor`` raises on purpose.

One tree, as psutil has one (``psutil.Error``): a caller that wants "anything
this package refused or could not do" catches :class:`SupervisorError`, and a
command line turns it into its exit status in one place (``exit_code``).
Bugs are not in this tree (they stay ``AssertionError`` and friends).
"""

from __future__ import annotations

from hold_supervisor.exitcodes import TOOL


class SupervisorError(Exception):
    """Refused or failed on purpose; ``exit_code`` is what a command exits with."""

    exit_code: int = TOOL
