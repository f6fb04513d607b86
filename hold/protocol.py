"""The wire between clients and the daemon: one JSON object per line, both ways.

Small and text-based on purpose: a person can talk to the daemon with
``socat - UNIX-CONNECT:daemon.sock`` while debugging. Who is asking is never
taken from a message: the daemon reads it from the socket (``SO_PEERCRED``,
``SO_PEERPIDFD``).

Versioned: every request carries ``"v"``, the :data:`WIRE` its client
speaks, and a daemon refuses a request of another version (with the
versions named, exit 125) rather than read it as its own; a client learns
the daemon's version from that refusal or from the session's ``arbiter``,
and replaces an idle daemon of its own that speaks another (as it does one
that reads another configuration). ``retire`` is the one request every
version must read as it is: it is how a client of another version makes an
idle daemon leave.

Decoded strictly (:mod:`hold_supervisor.jsonlines`): a message is at most
:data:`MAX_MESSAGE` bytes and :data:`MAX_DEPTH` deep, UTF-8 with no lone
surrogate, no duplicate key and no ``NaN``; anything else is a
:class:`ProtocolError`, which ends that connection and nothing else.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Any, TypeVar

from hold.errors import HoldError
from hold_supervisor import jsonlines

MAX_MESSAGE = jsonlines.MAX_LINE
MAX_DEPTH = jsonlines.MAX_DEPTH

Message = dict[str, Any]

WIRE = 1
"""The version of this wire. Raise it when a message changes in a way the
other side would misread (a field renamed, a meaning changed); a new
optional field does not need it."""
UNVERSIONED = 1
"""What a request without ``"v"`` is read as: the wire before versions were
written (version 1), and a person typing at ``socat``."""


def wire_of(msg: Message) -> object:
    """The wire version a request says it speaks (anything it carries: the
    daemon names what it got when it refuses it)."""
    return msg.get("v", UNVERSIONED)


class Op(StrEnum):
    """What a client asks (a request's ``"op"``); each has one handler in :mod:`hold.daemon.ops`.

    A member is its string: it compares equal to it and is written as it.
    """

    OPEN = "open"  # a session: -> SESSION
    ATTACH = "attach"  # a detached owner's session again: -> ATTACHED (then EXPIRED if it is)
    ACQUIRE = "acquire"  # a lease: -> QUEUED*, WARNING, GRANTED | BUSY
    TREE = "tree"  # a tree to guard: -> OK
    ROOT = "root"  # the spawned root of a registered tree: no answer
    STATUS = "status"  # -> STATUS
    RELEASE = "release"  # another's (or one's own) lease ended: -> RELEASED once it is
    END = "end"  # this session is done: -> ENDED once its trees are stopped
    LEASES = "leases"  # every live lease: -> LEASES
    CHECK = "check"  # is the asker inside a lease: -> CHECK
    RETIRE = "retire"  # an idle autostarted daemon leaves: -> RETIRING
    RELOAD = "reload"  # the configuration read again: -> RELOADED
    REPORT = "report"  # usage since a time: -> REPORT


class Ev(StrEnum):
    """What the daemon sends (a message's ``"ev"``): answers, and news of a lease.

    A member is its string: it compares equal to it and is written as it.
    """

    SESSION = "session"
    ATTACHED = "attached"
    QUEUED = "queued"  # where a waiter stands, when that changes
    WARNING = "warning"  # granted although someone holds the devices (busy_devices: warn)
    GRANTED = "granted"
    BUSY = "busy"  # not grantable now, and the request did not wait
    EXPIRED = "expired"  # the lease's time limit was reached: stop within the grace
    RELEASED = "released"  # to the holder (with "by"), and to the releaser once it is over
    ENDED = "ended"
    OK = "ok"
    STATUS = "status"
    LEASES = "leases"
    CHECK = "check"
    RETIRING = "retiring"
    RELOADED = "reloaded"
    REPORT = "report"
    ERROR = "error"  # a request refused ("code", "error")


class ProtocolError(HoldError):
    """A message that is not one (framing, encoding, JSON, a field): ends its connection."""


def encode(msg: Message) -> bytes:
    return jsonlines.dumps_line(msg)


class LineBuffer:
    """Accumulates bytes from a stream socket and yields complete messages."""

    __slots__ = ("_lines",)

    def __init__(self) -> None:
        self._lines = jsonlines.LineBuffer(MAX_MESSAGE, MAX_DEPTH)

    def feed(self, data: bytes) -> list[Message]:
        """The messages ``data`` completes; :class:`ProtocolError` at the first bad one."""
        try:
            return self._lines.feed(data)
        except jsonlines.BadJSON as e:
            raise ProtocolError(str(e)) from None


# ---------------------------------------------------------------------------
# What a message may carry: the label rule, and typed readers of fields (a
# wrong type or range is a ValueError, which ends that connection).

MAX_LABEL = 200


def check_label(label: str) -> str | None:
    """Why ``label`` is refused, or None. A newline would forge a token line."""
    if not label:
        return "a label must not be empty"
    if len(label) > MAX_LABEL:
        return f"a label is at most {MAX_LABEL} characters (got {len(label)})"
    for ch in label:
        if ord(ch) < 32 or ord(ch) == 127 or ch in "\x85\u2028\u2029":
            return f"a label must not contain control characters (found {ch!r})"
    return None


def text_field(msg: Message, name: str) -> str:
    value = msg.get(name)
    if not isinstance(value, str):
        raise ValueError(f"{name!r} must be a string")
    return value


def flag_field(msg: Message, name: str, default: bool) -> bool:
    value = msg.get(name, default)
    if not isinstance(value, bool):
        raise ValueError(f"{name!r} must be true or false")
    return value


NumT = TypeVar("NumT", int, float)


def number_field(msg: Message, name: str, kind: type[NumT], default: NumT | None = None) -> NumT:
    value = msg.get(name, default)
    ok = isinstance(value, int) if kind is int else isinstance(value, (int, float))
    if not ok or isinstance(value, bool) or value is None:
        raise ValueError(f"{name!r} must be a number")
    out = kind(value)
    if kind is float and not math.isfinite(out):
        raise ValueError(f"{name!r} must be finite")
    if kind is int and not -(2**31) <= out < 2**31:
        raise ValueError(f"{name!r} out of range")
    return out


def ints_field(msg: Message, name: str) -> tuple[int, ...] | None:
    value = msg.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > 1024:
        raise ValueError(f"{name!r} must be a list of device indices")
    out = []
    for v in value:
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 65536:
            raise ValueError(f"{name!r} must be a list of device indices")
        out.append(v)
    return tuple(sorted(set(out)))
