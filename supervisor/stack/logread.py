"""Reading a stack's logs for people: one unit's, or every unit's interleaved by time,
from a time on (``--since``), and followed while the stack runs.

A line's time is its stamp (:mod:`hold_supervisor.unitlog`); a task unit's JSON
record carries the same stamp in ``ts``. A line without one (a log written
before lines were stamped) takes the time of the line before it, so it stays
where it was. Every file is read through :mod:`hold_supervisor.safefile` (no
link followed at a log's name).
"""

from __future__ import annotations

import datetime as dt
import heapq
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator

from hold_supervisor.parse import BadValue, parse_duration
from hold_supervisor.safefile import open_for_read
from hold_supervisor.unitlog import KEEP, STAMP_LEN, Follower, stamp

_STAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", re.ASCII)
SINCE_ACCEPTED = (
    "a duration back from now (10m, 1h30m, 2d) or a time: 2026-12-01T17:05[:03][Z|+01:00] "
    "(local time without a zone) or 17:05[:03] (today, local time)"
)


def parse_since(text: str, now: float | None = None) -> str:
    """``--since``: a duration back from now, or a time; the stamp it means."""
    now = time.time() if now is None else now
    value = text.strip()
    try:
        return stamp(now - parse_duration(value, what="--since", plain_unit="seconds"))
    except BadValue:
        pass
    try:
        if re.fullmatch(r"\d\d?:\d\d(:\d\d)?", value, re.ASCII):
            day = dt.datetime.fromtimestamp(now).date().isoformat()
            value = f"{day}T{value}"
        when = dt.datetime.fromisoformat(value)
    except ValueError:
        raise BadValue("--since", text, SINCE_ACCEPTED) from None
    return stamp(when.timestamp())  # naive: local time, as a person types it


def stamp_of(line: str) -> str | None:
    """The stamp of a log line (a unit's line, or a JSON record's ``ts``); None if none."""
    head = line[:STAMP_LEN]
    if _STAMP.fullmatch(head):
        return head
    if line.startswith("{"):
        try:
            rec = json.loads(line)
        except ValueError:
            return None
        ts = rec.get("ts") if isinstance(rec, dict) else None
        if isinstance(ts, str) and _STAMP.fullmatch(ts):
            return ts
    return None


def _read(path: str) -> tuple[list[str], int, int]:
    """Every line of ``path``, its inode and the offset read to."""
    with open(open_for_read(path, owned=False), "rb") as f:
        st = os.fstat(f.fileno())
        data = f.read()
    return data.decode("utf-8", "replace").splitlines(), st.st_ino, len(data)


def read_log(path: str, n: int | None, since: str | None) -> tuple[list[str], int, int]:
    """The lines of a unit's log to show: from ``since`` on (then the rotated files
    too, oldest first), the last ``n`` of them; and the inode and offset of the
    current file, to follow it from there."""
    lines, ino, offset = _read(path)
    if since is not None:
        older: list[str] = []
        for i in range(KEEP, 0, -1):
            try:
                older += _read(f"{path}.{i}")[0]
            except FileNotFoundError:
                continue
        lines = [line for t, line in stamped(older + lines) if t >= since]
    if n is not None:
        lines = lines[-n:] if n > 0 else []
    return lines, ino, offset


def stamped(lines: Iterable[str], last: str = "") -> Iterator[tuple[str, str]]:
    """``(stamp, line)`` for each line; a line without a stamp takes the one before."""
    for line in lines:
        last = stamp_of(line) or last
        yield last, line


def merged(logs: dict[str, list[str]]) -> list[tuple[str, str, str]]:
    """Every unit's lines as ``(stamp, unit, line)``, interleaved by time (each
    log is in time order already; equal times keep the units' order)."""
    each = [
        [(t, i, k, unit, line) for k, (t, line) in enumerate(stamped(lines))]
        for i, (unit, lines) in enumerate(logs.items())
    ]
    return [(t, unit, line) for t, _i, _k, unit, line in heapq.merge(*each)]


def with_unit(unit: str, line: str, width: int) -> str:
    """A line of the interleaved view: ``STAMP UNIT STREAM | TEXT``; a task unit's
    record as ``STAMP UNIT call | {...}`` (or ``run``)."""
    name = unit.ljust(width)
    head = line[:STAMP_LEN]
    if _STAMP.fullmatch(head) and line[STAMP_LEN : STAMP_LEN + 1] == " ":
        return f"{head} {name} {line[STAMP_LEN + 1 :]}"
    t = stamp_of(line)
    if t is not None:  # a task unit's record: a call, or a run of the stack
        kind = "call" if "call" in json.loads(line) else "run"
        return f"{t} {name} {kind} | {line}"
    return f"{'-' * STAMP_LEN} {name} ? | {line}"


LOGS_VERSION = 1  # the "version" of every object of ``hold logs --json``
_STREAM_NAMES = {"out": "out", "err": "err", "---": "stack"}


def as_record(stack: str, unit: str, line: str) -> dict[str, object]:
    """A log line as ``hold logs --json`` gives it: ``version``, ``stack``, ``unit``, ``ts`` (the
    stamp as written, UTC; null for a line without one), ``stream`` (``out``, ``err``,
    ``stack`` for a line of the stack's own (``---``); ``call`` or ``run`` for a
    task unit's record, then also in ``record``, parsed; null if unknown) and
    ``text`` (the line after ``STREAM | ``, or a task record's line as written)."""
    rec: dict[str, object] = {"version": LOGS_VERSION, "stack": stack, "unit": unit}
    head = line[:STAMP_LEN]
    if _STAMP.fullmatch(head) and line[STAMP_LEN : STAMP_LEN + 1] == " ":
        stream, sep, text = line[STAMP_LEN + 1 :].partition(" | ")
        if sep and stream in _STREAM_NAMES:
            return {**rec, "ts": head, "stream": _STREAM_NAMES[stream], "text": text}
        return {**rec, "ts": head, "stream": None, "text": line[STAMP_LEN + 1 :]}
    t = stamp_of(line)
    if t is not None:  # a task unit's record (stamp_of parsed it: an object with ts)
        body = json.loads(line)
        kind = "call" if "call" in body else "run"
        return {**rec, "ts": t, "stream": kind, "text": line, "record": body}
    return {**rec, "ts": None, "stream": None, "text": line}


def follow_all(
    followers: dict[str, Follower],
    emit: Callable[[str, str], None],
    keep_going: Callable[[], bool],
    interval: float = 0.2,
) -> None:
    """New lines of every log, each round's in time order, while ``keep_going()``;
    what was written before it turned False is still given."""
    while True:
        going = keep_going()
        batch: dict[str, list[str]] = {}
        for unit, f in followers.items():
            batch[unit] = f.poll() + ([] if going else f.rest())
        for _t, unit, line in merged(batch):
            emit(unit, line)
        if not going:
            return
        time.sleep(interval)
