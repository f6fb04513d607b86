"""The words of a running stack's control socket (``control.sock``): what a
client asks (``"op"``) and what the stack answers (``"ev"``).

One JSON object per line both ways (:mod:`hold_supervisor.jsonlines`), as on
the ticket daemon's socket; the final answer of a request carries
``"done": true``. A member is its string: it compares equal to it and is
written as it, so a person with ``socat`` reads and types the same words.
"""

from __future__ import annotations

from enum import StrEnum


class StackOp(StrEnum):
    """What a client asks; each has one handler in :mod:`hold_supervisor.stack.control`."""

    PS = "ps"  # the units and calls: -> PS
    CALL = "call"  # run a task unit: -> ACCEPTED, QUEUED*, RUNNING, RESULT | ERROR
    CANCEL = "cancel"  # on a call's connection: cancel that call
    DOWN = "down"  # stop the stack: -> STOPPING, STOPPED
    RESTART = "restart"  # stop and start one unit: -> RESTARTING, RESTARTED | ERROR


class StackEv(StrEnum):
    """What the stack answers."""

    PS = "ps"
    ACCEPTED = "accepted"  # a call has an id (and, with "beat", will be heard of)
    QUEUED = "queued"  # a call still waits for a slot (every few seconds)
    RUNNING = "running"  # a call started
    RESULT = "result"  # a call ended: its outcome, code, output
    STOPPING = "stopping"  # the stop began; "within": how long it may take
    STOPPED = "stopped"  # the stop ended: code and survivors
    RESTARTING = "restarting"
    RESTARTED = "restarted"
    ERROR = "error"  # refused or failed: "code" and "error" (or "errors")
