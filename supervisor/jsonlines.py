"""Strict JSON lines: the one decoder for JSON that comes from a socket or a user.

One JSON object per line. Whatever the bytes, decoding either gives a value
or raises :class:`BadJSON` (a ``ValueError``): never ``RecursionError``,
``UnicodeError`` or ``OverflowError`` later, where the value is used. A line
is refused unless it is

* at most ``max_size`` bytes: the framing refuses a longer line as soon as it
  has more than that without a newline, so a sender cannot make us buffer
  without bound;
* UTF-8, strictly: no invalid or overlong sequence, no encoded surrogate, no
  byte order mark (``json.loads`` on bytes would guess UTF-16 or skip a BOM);
* nested at most ``max_depth`` deep, counted by a scan of the brackets outside
  strings *before* the (recursive) parser sees the text;
* JSON as RFC 8259 has it: no ``NaN`` or ``Infinity`` (nor a number so large
  that it becomes one), no key twice in one object (which one counts would be
  a guess), no lone surrogate in any string (``"\\ud800"`` decodes to a str
  that cannot be written as UTF-8), and no integer of more than
  :data:`MAX_INT_DIGITS` digits.

Written with :func:`dumps_line`: compact UTF-8 that these rules accept (a lone
surrogate in a str is replaced, so a sender never fails on its own data).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from hold_supervisor.errors import SupervisorError
from hold_supervisor.exitcodes import USAGE

MAX_LINE = 64 * 1024  # bytes of one line, without its newline
MAX_DEPTH = 32  # nested arrays and objects; a message object alone is 1
MAX_INT_DIGITS = 40  # beyond any count, id or time (2**128 has 39 digits)

Message = dict[str, Any]


class BadJSON(SupervisorError, ValueError):
    """The text is not strict JSON, or not within the limits; says why."""

    exit_code = USAGE


# A JSON string (the unrolled form: linear, no catastrophic backtracking).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_depth(text: str, max_depth: int = MAX_DEPTH) -> None:
    """:class:`BadJSON` if ``text`` nests arrays and objects deeper than ``max_depth``.

    Counts brackets outside strings, without recursion, so that no input can
    take the parser near Python's recursion limit. The count agrees with the
    parser on every prefix that the parser accepts, so text the parser would
    nest deeper is always refused here first.
    """
    depth = 0
    for m in _BRACKET.finditer(_STRING.sub("", text)):
        if m.group() in "[{":
            depth += 1
            if depth > max_depth:
                raise BadJSON(f"nested more than {max_depth} deep")
        else:
            depth -= 1


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise BadJSON(f"key {_short(key)} is given twice in one object")
            seen.add(key)
    return obj


def _constant(name: str) -> Any:
    raise BadJSON(f"{name} is not a JSON number")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadJSON(f"number {_short(text)} is out of range")
    return value


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise BadJSON(f"an integer has at most {MAX_INT_DIGITS} digits (got {len(text)})")
    return int(text)


def _check_strings(value: Any) -> None:
    """:class:`BadJSON` if any string in ``value`` (key or value) holds a lone surrogate."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                raise BadJSON(f"string {_short(v)} holds a lone surrogate (not Unicode text)")
        elif isinstance(v, dict):
            todo.extend(v)
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)


def strict_loads(data: bytes | bytearray | str, *, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value in ``data`` (bytes are UTF-8); :class:`BadJSON` on anything else."""
    if isinstance(data, str):
        text = data
    else:
        try:
            text = bytes(data).decode("utf-8")  # strict: refuses encoded surrogates too
        except UnicodeDecodeError as e:
            raise BadJSON(f"not UTF-8 (byte {e.start}: {e.reason})") from None
    check_depth(text, max_depth)
    try:
        value = json.loads(
            text,
            object_pairs_hook=_object,
            parse_constant=_constant,
            parse_float=_float,
            parse_int=_int,
        )
    except BadJSON:
        raise
    except ValueError as e:  # json.JSONDecodeError, and int()'s own digit limit
        raise BadJSON(f"not JSON: {e}") from None
    except RecursionError:  # not reachable after check_depth; never let it out
        raise BadJSON(f"nested more than {max_depth} deep") from None
    _check_strings(value)
    return value


def loads_object(data: bytes | bytearray | str, *, max_depth: int = MAX_DEPTH) -> Message:
    """:func:`strict_loads`, and the value must be a JSON object."""
    value = strict_loads(data, max_depth=max_depth)
    if not isinstance(value, dict):
        raise BadJSON("a message must be a JSON object")
    return value


def dumps_line(msg: Any) -> bytes:
    """``msg`` as one compact line of UTF-8 JSON, with its newline."""
    # ensure_ascii=False, then "replace": a lone surrogate in a str (a name
    # read with surrogateescape) becomes "?" rather than an escape that the
    # reader would refuse. A newline inside a string is always escaped.
    text = json.dumps(msg, separators=(",", ":"), ensure_ascii=False)
    return text.encode("utf-8", "replace") + b"\n"


class LineBuffer:
    """Bytes from a stream in, strict messages (JSON objects) out, one per line.

    Blank lines are skipped. A line longer than ``max_size`` bytes is refused
    as soon as that many bytes have come without its newline. After a
    :class:`BadJSON`, the stream is out of step: the caller should end it.
    """

    __slots__ = ("_buf", "_scanned", "max_depth", "max_size")

    def __init__(self, max_size: int = MAX_LINE, max_depth: int = MAX_DEPTH) -> None:
        self._buf = bytearray()
        self._scanned = 0  # bytes of _buf known to hold no newline
        self.max_size = max_size
        self.max_depth = max_depth

    def push(self, data: bytes) -> None:
        """Add bytes; take the messages with :meth:`next`."""
        self._buf += data

    def next(self) -> Message | None:
        """The next complete message; None until one is complete; :class:`BadJSON`."""
        while True:
            nl = self._buf.find(b"\n", self._scanned)
            if nl < 0:
                self._scanned = len(self._buf)
                if len(self._buf) > self.max_size:
                    raise BadJSON(f"a line is at most {self.max_size} bytes")
                return None
            if nl > self.max_size:
                raise BadJSON(f"a line is at most {self.max_size} bytes")
            line = bytes(self._buf[:nl])
            del self._buf[: nl + 1]
            self._scanned = 0
            if line.strip(b" \t\r"):
                return loads_object(line, max_depth=self.max_depth)

    def feed(self, data: bytes) -> list[Message]:
        """Add bytes; the messages they complete."""
        self.push(data)
        out: list[Message] = []
        while (msg := self.next()) is not None:
            out.append(msg)
        return out


def _short(text: str, limit: int = 60) -> str:
    r = repr(text)
    return r if len(r) <= limit else r[: limit - 3] + "..."
