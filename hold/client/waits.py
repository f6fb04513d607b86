"""How long a command waits for an answer from the ticket daemon or a stack's supervisor.

A daemon or a supervisor that does not answer in time is stuck (stopped, or
stalled on a disk or a lock): the command says so and stops waiting, or goes
on through what does answer (docs/DESIGN.md, "Deadlines"). The defaults, in
seconds:

* :data:`DAEMON` (3): each answer of the ticket daemon, and the silence after
  which a long wait (in line, a release, a lease's end) asks whether it still
  reads;
* :data:`CHECK` (2): ``hold check``, which then fails closed;
* :data:`STACK` (5): a stack supervisor's first answer to ``hold down``,
  ``restart`` and ``call``; :data:`PS` (3): to ``hold ps``;
* :data:`LIFELINE` (4 x :data:`STACK`): how long ``hold down`` of a stuck
  stack waits for the ticket daemon to stop its units before it stops what is
  left itself.

``HOLD_ANSWER_WAIT`` (a duration: ``1s``, ``500ms``, ``10s``) replaces the
first four, and :data:`LIFELINE` follows it: for a slow machine, or a test
that makes the other side stuck on purpose. Read once, when this module is
first imported; a bad value is refused (exit 2), never ignored.
"""

from __future__ import annotations

import os

from hold.errors import HoldError
from hold_supervisor.exitcodes import USAGE
from hold_supervisor.parse import BadValue, parse_duration


class BadWait(HoldError):
    """``HOLD_ANSWER_WAIT`` is not a duration (exit 2)."""

    exit_code = USAGE


def _override() -> float | None:
    raw = os.environ.get("HOLD_ANSWER_WAIT")
    if raw is None:
        return None

    try:
        return parse_duration(raw, what="HOLD_ANSWER_WAIT (environment)", plain_unit="seconds")
    except BadValue as e:
        raise BadWait(str(e)) from None


_SET = _override()
DAEMON = _SET or 3.0
CHECK = _SET or 2.0
STACK = _SET or 5.0
PS = _SET or 3.0
LIFELINE = 4 * STACK
