"""Strict parsers for values that come from people: durations and CPU lists.

Every parser raises :class:`BadValue` with a message that names the value,
where it came from, and what would have been accepted. Nothing is defaulted.
"""

from __future__ import annotations

import itertools
import os
import re
import time
from collections.abc import Iterable, Mapping

from hold_supervisor.errors import SupervisorError
from hold_supervisor.exitcodes import USAGE

# A value quoted in a message is cut to this many characters (its repr), with
# its full length said: a message names the value, it does not echo a megabyte.
MAX_SHOWN = 120


class BadValue(SupervisorError, ValueError):
    """A value from a user, a file or a client that is not acceptable."""

    exit_code = USAGE

    def __init__(self, what: str, value: object, accepted: str, where: str = "") -> None:
        self.what = what
        self.value = value
        self.accepted = accepted
        self.where = where
        loc = f"{where}: " if where else ""
        super().__init__(f"{loc}{what} {shorten(value)} is not valid: {accepted}")


def shorten(value: object, limit: int = MAX_SHOWN) -> str:
    """``repr(value)``, cut to ``limit`` characters (saying how long it was) if longer."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f" ({len(value)} characters)" if isinstance(value, (str, bytes)) else ""
    return text[: limit - 3] + "..." + size


def did_you_mean(
    word: str, accepted: Iterable[str], synonyms: Mapping[str, str] | None = None
) -> str:
    """``"; did you mean 'cmd'?"`` for a close or usual other name of an accepted one, else ``""``.

    ``synonyms`` maps what users of other tools type (``depends_on``,
    ``command``) to our name; otherwise the closest accepted names by spelling.
    """
    accepted = list(accepted)
    if synonyms:
        for cand in (word, word.lower(), word.lower().replace("-", "_")):
            ours = synonyms.get(cand)
            if ours is not None and ours in accepted:
                return f"; did you mean {ours!r}?"
    import difflib  # only on this error path

    close = difflib.get_close_matches(word, accepted, n=1)
    if not close:
        lower = difflib.get_close_matches(word.lower(), [a.lower() for a in accepted], n=1)
        close = [a for a in accepted if a.lower() in lower][:1]
    return f"; did you mean {close[0]!r}?" if close else ""


# re.ASCII: a str pattern's \d also matches other scripts' digits ("\u0665"), and
# int()/float() would accept them; a strict parser takes 0-9 only.
_NUMBER = r"\d+(?:\.\d+)?"
_PLAIN = re.compile(_NUMBER, re.ASCII)
_PART = re.compile(rf"({_NUMBER})(ms|s|m|h|d)", re.ASCII)
_PARTS = re.compile(rf"(?:{_NUMBER}(?:ms|s|m|h|d))+", re.ASCII)
_UNIT_SECONDS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}  # largest first
_UNIT_RANK = {u: i for i, u in enumerate(_UNIT_SECONDS)}


def duration_accepted(plain_unit: str, allow_zero: bool = False) -> str:
    """What :func:`parse_duration` accepts, in words (the end of its error messages)."""
    return (
        "a number with a unit ms, s, m, h or d (90s, 4m, 1.5h), or several from the "
        "largest unit down (1h30m, 2m30s, 1d12h; a fraction in the last one only); "
        f"a plain number is {plain_unit}" + ("" if allow_zero else "; more than zero")
    )


def parse_duration(
    text: str,
    *,
    what: str = "duration",
    plain_unit: str,
    allow_zero: bool = False,
    where: str = "",
) -> float:
    """Seconds in ``text`` (``90s``, ``4m``, ``2h``, ``1.5h``, ``250ms``, ``1d``,
    ``1h30m``, ``2m30s``, ``1d12h``, ``1m30.5s``).

    A plain number is in ``plain_unit``: minutes for ``-t`` (as the tickets have
    always been given), seconds for grace periods (as ``timeout -k``). Parts
    go from the largest unit down, each unit once; only the last may have a
    fraction (``1.5h30m`` is refused: say ``2h``).
    """
    accepted = duration_accepted(plain_unit, allow_zero)
    value = text.strip() if isinstance(text, str) else None
    if value is not None and _PLAIN.fullmatch(value):
        seconds = float(value) * _UNIT_SECONDS[{"minutes": "m", "seconds": "s"}[plain_unit]]
    elif value is not None and _PARTS.fullmatch(value):
        seconds = _sum_parts(value, what, text, accepted, where)
    else:
        raise BadValue(what, text, accepted, where)
    if seconds == 0 and not allow_zero:
        raise BadValue(what, text, accepted, where)
    if seconds > 366 * 86400:
        raise BadValue(what, text, "at most a year", where)
    return seconds


def _sum_parts(value: str, what: str, text: str, accepted: str, where: str) -> float:
    """The seconds of ``1h30m`` (already known to be parts): units largest first, once each."""
    parts = [(m.group(1), m.group(2)) for m in _PART.finditer(value)]
    ranks = [_UNIT_RANK[unit] for _, unit in parts]
    if any(b <= a for a, b in itertools.pairwise(ranks)):
        raise BadValue(what, text, f"each unit once, the largest first; {accepted}", where)
    if any("." in number for number, _ in parts[:-1]):
        raise BadValue(what, text, f"only the last part may have a fraction; {accepted}", where)
    return sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)


def format_duration(seconds: float | None) -> str:
    """A duration for people, as :func:`parse_duration` reads it back: ``4.2s``, ``42s``,
    ``5m07s``, ``1h12m``, ``2h05m``, ``3d04h``; ``-`` for None."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 10:
        return f"{seconds:.1f}s"
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def format_bytes(n: int | None) -> str:
    """Bytes for people: ``512B``, ``4.0KiB``, ``1.5GiB``; ``-`` for None."""
    if n is None:
        return "-"
    if n < 1024:
        return f"{n}B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f}{unit}"


def format_when(ts: float, now: float | None = None) -> str:
    """A wall-clock time for people: ``13:37:09`` today, ``Wed 2 Dec 13:37`` on another
    day (with the year if not this one)."""
    t = time.localtime(ts)
    today = time.localtime(time.time() if now is None else now)
    if t[:3] == today[:3]:
        return time.strftime("%H:%M:%S", t)
    year = "" if t.tm_year == today.tm_year else f" {t.tm_year}"
    return time.strftime(f"%a {t.tm_mday} %b{year} %H:%M", t)


def time_left(ts: float, now: float | None = None) -> str:
    """``1h12m left`` until ``ts`` (``ending`` once it is past)."""
    left = ts - (time.time() if now is None else now)
    return f"{format_duration(left)} left" if left > 0 else "ending"


def format_until(ts: float, now: float | None = None) -> str:
    """``until 13:37:09 (1h12m left)``: when something ends and how long that is from now."""
    return f"until {format_when(ts, now)} ({time_left(ts, now)})"


def allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity, which includes cpuset limits)."""
    return frozenset(os.sched_getaffinity(0))


def format_cpus(cpus: frozenset[int] | set[int]) -> str:
    """``{0,1,2,3,8}`` -> ``"0-3,8"`` (the kernel's ``Cpus_allowed_list`` form)."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


_CPU_ITEM = re.compile(r"(\d+)(?:-(\d+))?", re.ASCII)  # ASCII digits only, as above


def parse_cpus(
    text: str, *, what: str = "CPU list", where: str = "", allowed: frozenset[int] | None = None
) -> frozenset[int]:
    """A CPU list like ``0-3,8`` -> ``{0,1,2,3,8}``.

    Refused: empty, malformed (``0-``, ``3-1``, ``a``), or naming a CPU this
    process may not use (``allowed``, default: this process's affinity). An
    empty mask is never read as "no pinning".
    """
    if allowed is None:
        allowed = allowed_cpus()
    accepted = (
        "a list of CPUs and ranges like 0-3,8, each within the CPUs this process "
        f"may use ({format_cpus(allowed)})"
    )
    if not isinstance(text, str) or not text.strip():
        raise BadValue(what, text, accepted, where)
    cpus: set[int] = set()
    for item in text.strip().split(","):
        m = _CPU_ITEM.fullmatch(item.strip())
        if m is None:
            raise BadValue(what, text, accepted, where)
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo or hi >= 65536:
            raise BadValue(what, text, accepted, where)
        cpus.update(range(lo, hi + 1))
    outside = cpus - allowed
    if outside:
        raise BadValue(
            what,
            text,
            f"CPU {format_cpus(outside)} is not usable here; {accepted}",
            where,
        )
    return frozenset(cpus)
