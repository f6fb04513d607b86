"""The live waiting line: at a terminal, waiting for a ticket is one line redrawn in place.

``npu-hold: waiting 1m05s for npu, 2nd in line; npu:0: ann's 'train', 1h12m
left`` -- redrawn about once a second and on each
message of the daemon (``\\r``, the text cut to the terminal's width by the one
rule of :mod:`hold_supervisor.width`, then clear to the end of the line), and
cleared when the wait ends. Not at a terminal, the waiting messages are lines
(:func:`hold.client.lease.describe_wait`), one per change.

On the hot path of ``npu-hold``: nothing heavy is imported here.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, TextIO

from hold_supervisor.parse import format_duration, time_left
from hold_supervisor.width import ELLIPSIS, columns, cut, fit, room

CLEAR = "\r\x1b[K"  # back to the start of the line, and clear it
REFRESH = 1.0  # seconds between redraws while nothing happens


class WaitLine:
    """One line on ``stream`` (a terminal), redrawn in place; ``prefix`` starts it."""

    def __init__(self, stream: TextIO, prefix: str) -> None:
        self.stream = stream
        self.prefix = prefix
        self.drawn = False

    @classmethod
    def at_terminal(cls, stream: TextIO, prefix: str) -> WaitLine | None:
        """A live line where ``stream`` is a terminal; None elsewhere (lines instead)."""
        return cls(stream, prefix) if columns(stream) is not None else None

    def width(self) -> int | None:
        """How many characters of text fit after the prefix (None: no limit)."""
        width = columns(self.stream)
        return None if width is None else room(width) - len(self.prefix) - 2

    def draw(self, text: str) -> None:
        line = fit(f"{self.prefix}: {text}", columns(self.stream))
        self._write(f"\r{line}\x1b[K")
        self.drawn = True

    def clear(self) -> None:
        """Take the line away (before a message of its own, or at the end of the wait)."""
        if self.drawn:
            self._write(CLEAR)
            self.drawn = False

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except OSError:  # the terminal went away: the wait goes on without it
            pass


def summary(
    cls: str, note: Mapping[str, object] | None, waited: float, room: int | None = None
) -> str:
    """The live line's text: how long, the place in line, who holds it, the time left.

    ``npu:0: ann's 'train', 1h12m left``: the labels (the free text) are cut
    first where the line would not fit ``room`` characters.
    """
    head = f"waiting {format_duration(waited)} for {cls}"
    if note is None:
        return head
    pos = note.get("position")
    if isinstance(pos, int) and pos > 0:
        head += f", {ordinal(pos)} in line"
    held = _holders(cls, note)
    if not held:
        return f"{head}; being checked for the next holder"
    labels = [label for _, label, _ in held if label is not None]
    if room is not None and labels:
        # The line without the labels' text: head, "; " between holders, quotes.
        bare = len(head) + 2 * len(held) + sum(len(a) + len(b) for a, _, b in held)
        bare += 2 * len(labels)
        each = (room - bare) // len(labels)
        if each < len(ELLIPSIS) + 2:  # no room for a label: "ann's lease" instead
            held = [(a + ("lease" if label is not None else ""), None, b) for a, label, b in held]
        else:
            held = [(a, None if label is None else cut(label, each), b) for a, label, b in held]
    who = "; ".join(a + (f"{label!r}" if label is not None else "") + b for a, label, b in held)
    return f"{head}; {who}"


def ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``4th``, ``11th``, ``21st``."""
    last = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{last}"


def _holders(cls: str, note: Mapping[str, object]) -> list[tuple[str, str | None, str]]:
    """Each holder as (before its label, its label or None, after it)."""
    now = time.time()
    out: list[tuple[str, str | None, str]] = []
    for h in _dicts(note.get("holders")):
        devs = ",".join(str(d) for d in h.get("devices") or [])
        left = f", {time_left(float(h['expires']), now)}" if "expires" in h else ""
        label = h.get("label")
        if isinstance(label, str):
            out.append((f"{cls}:{devs}: {h.get('user')}'s ", label, left))
        else:
            out.append((f"{cls}:{devs}: {h.get('user')}'s lease{left}", None, ""))
    for b in _dicts(note.get("blocked")):
        pids = ",".join(str(h.get("pid")) for h in _dicts(b.get("holders")))
        out.append((f"{cls}:{b.get('index')}: pid {pids} OUTSIDE any lease", None, ""))
    for e in _dicts(note.get("elsewhere")):
        if "error" in e:
            out.append((f"{cls}:{e.get('index')} cannot be locked", None, ""))
            continue
        until = e.get("until")
        left = f", {time_left(until, now)}" if isinstance(until, float) else ""
        label = e.get("label")
        before = f"{cls}:{e.get('index')}: {e.get('user', '?')}'s "
        after = f" via another daemon{left}"
        if isinstance(label, str):
            out.append((before, label, after))
        else:
            out.append((before + "lease" + after, None, ""))
    return out


def _dicts(value: object) -> list[dict[str, Any]]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []
