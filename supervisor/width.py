"""How wide output may be, and what it may hold: the one rule for everything printed
to a terminal.

At a terminal, a line is fitted to the width (``COLUMNS`` where set, else the
terminal's own size), one column short of it so that the terminal never
wraps on its own; piped or redirected, nothing is ever cut. The live
``hold up`` table, ``hold status``, ``hold audit`` and the live waiting line
of ``npu-hold`` all follow it.

Text that someone else controls (another user's label, a lock file's record,
a process's command line) never reaches a terminal raw: :func:`shown`
writes every control character, and every Unicode character that reorders
or hides text, as an escape (``\x1b``, ``\u202e``); :func:`fit` and
:func:`table` apply it to all they lay out.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TextIO

FALLBACK = 80  # a terminal that will not say how wide it is
# C0 and C1 controls, DEL, and the characters that reorder or hide text
# (bidi marks, overrides and isolates, zero-width ones, line separators).
_HIDDEN = [*range(0x20), *range(0x7F, 0xA0), 0x061C, 0xFEFF, *range(0xFFF9, 0xFFFC)]
_HIDDEN += [*range(0x200B, 0x2010), *range(0x2028, 0x202F), *range(0x2060, 0x206A)]
_ESCAPE = {c: (f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}") for c in _HIDDEN}
MIN_WIDTH = 10  # never cut a line shorter than this
ELLIPSIS = "..."


def columns(stream: TextIO | None) -> int | None:
    """The width of the terminal ``stream`` writes to; None when it is not a terminal."""
    if stream is None:
        return None
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None
    if not os.isatty(fd):
        return None
    return terminal_columns(fd)


def terminal_columns(fd: int | None = None) -> int:
    """``COLUMNS`` if it is a positive number, else the size of the terminal at ``fd``."""
    env = os.environ.get("COLUMNS", "")
    if env.isascii() and env.isdigit() and int(env) > 0:
        return int(env)
    if fd is not None:
        try:
            return os.get_terminal_size(fd).columns or FALLBACK
        except OSError:
            pass
    return FALLBACK


def room(width: int) -> int:
    """How many characters a line may have at a terminal ``width`` columns wide."""
    return max(MIN_WIDTH, width - 1)


def shown(text: str) -> str:
    """``text`` safe to print: each hidden character (above) as its escape."""
    return text.translate(_ESCAPE)


def fit(text: str, width: int | None) -> str:
    """``text`` :func:`shown` and cut to fit a terminal ``width`` wide; whole when
    ``width`` is None."""
    if width is None:
        return shown(text)
    return shown(text)[: room(width)]


def cut(text: str, size: int) -> str:
    """``text`` in at most ``size`` characters, ending in ``...`` where it was cut."""
    if len(text) <= size:
        return text
    if size <= len(ELLIPSIS):
        return text[:size]
    return text[: size - len(ELLIPSIS)] + ELLIPSIS


def table(
    head: Sequence[str],
    rows: Sequence[Sequence[str]],
    width: int | None,
    *,
    flex: Sequence[int] = (),
    gap: str = "  ",
    drop: Sequence[int] = (),
) -> list[str]:
    """Aligned lines (the header first) fitted to ``width``.

    The columns in ``drop`` are left out whole, in that order, while the
    others could not fit even with the ``flex`` columns at their header's
    width (a column of figures cut is worse than none). Then the columns in
    ``flex`` (the long free text: a label, a command, a reason) give way,
    the widest first; if even that is not enough the lines are cut. With
    ``width`` None (not a terminal) nothing is cut or dropped.
    """
    if width is not None and drop:
        head, rows, flex = _dropped(head, rows, width, flex, gap, drop)
    all_rows = [list(head), *([shown(c) for c in r] for r in rows)]
    widths = [max(len(r[i]) for r in all_rows) for i in range(len(head))]
    if width is not None:
        _shrink(widths, flex, room(width) - len(gap) * (len(head) - 1), [len(h) for h in head])
    out = []
    for r in all_rows:
        cells = [cut(c, w).ljust(w) for c, w in zip(r, widths, strict=True)]
        out.append(fit(gap.join(cells).rstrip(), width))
    return out


def _dropped(
    head: Sequence[str],
    rows: Sequence[Sequence[str]],
    width: int,
    flex: Sequence[int],
    gap: str,
    drop: Sequence[int],
) -> tuple[list[str], list[list[str]], list[int]]:
    """(head, rows, flex) without the ``drop`` columns the width has no room for."""
    keep = list(range(len(head)))

    def least() -> int:
        sizes = [
            len(head[i]) if i in flex else max(len(shown(r[i])) for r in [head, *rows])
            for i in keep
        ]
        return sum(sizes) + len(gap) * (len(keep) - 1)

    for i in drop:
        if least() <= room(width):
            break
        keep.remove(i)
    return (
        [head[i] for i in keep],
        [[r[i] for i in keep] for r in rows],
        [keep.index(i) for i in flex if i in keep],
    )


def _shrink(widths: list[int], flex: Sequence[int], total: int, least: list[int]) -> None:
    """Narrow the ``flex`` columns (widest first, none below its header) until all fit ``total``."""
    over = sum(widths) - total
    while over > 0:
        cands = [i for i in flex if widths[i] > max(least[i], len(ELLIPSIS) + 1)]
        if not cands:
            return
        i = max(cands, key=lambda c: widths[c])
        widths[i] -= 1
        over -= 1
