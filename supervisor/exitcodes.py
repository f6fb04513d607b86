"""The exit codes, one table (the README's "Exit codes" section).

Here in ``supervisor/`` because the supervisor returns most of them and must
never import ``hold/``; ``hold/`` takes them from here.
"""

from __future__ import annotations

import signal

OK = 0  # success
NO = 1  # a check answered no (or: no such stack is running)
USAGE = 2  # usage or configuration error, refusal before anything started
SURVIVORS = 3  # survivors remained after a stop
UNIT_FAILED = 4  # a unit failed to start (or ended with no restart left)
# A unit failed its readiness check: the probe answered a definite no that
# waiting cannot change (its port answers from a process outside the unit, the
# probe command cannot be executed). Not ready *in time* is EXPIRED: every time
# limit that runs out exits 124.
NOT_READY = 5
# A lease ended by `hold release`: the command (or stack) was stopped. Not the
# command's own status: one that exits 0 on SIGTERM would look done (as 124
# for the time limit).
RELEASED = 6
# A check found nothing wrong in what it could see, but could not see everything
# (``hold audit``: processes it may not read, any of which may hold a device):
# not "clean", which a script must be able to tell (issue 45).
INCOMPLETE = 7
BUSY = 75  # the device or every slot is taken, and the caller would not wait (EX_TEMPFAIL)
EXPIRED = 124  # a time limit ran out (-t, a lease, a call, readiness, a oneshot), as timeout(1)
TOOL = 125  # the tool itself failed
NOT_EXECUTABLE = 126  # the command is not executable
NOT_FOUND = 127  # the command was not found


def signalled(signum: int) -> int:
    """The exit code of a command ended by signal ``signum``: 128+N, as a shell says."""
    return 128 + signum


CANCELLED = signalled(signal.SIGINT)  # 130: cancelled, as a command interrupted by Ctrl-C
