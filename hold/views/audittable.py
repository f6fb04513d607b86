"""``hold audit``'s table: one row per process and device, fitted to the terminal.

At a terminal the table fits the width by the one rule of
:mod:`hold_supervisor.width` (the reason and the command give way first); piped,
nothing is cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hold_supervisor.parse import format_bytes, format_duration
from hold_supervisor.proc.origin import words
from hold_supervisor.width import fit, table

HEAD = ("DEVICE", "PID", "USER", "AGE", "RSS", "DEVMEM", "LEASE", "COMMAND")
FLEX = (6, 7)  # LEASE (or the stray's reason) and COMMAND


def render_table(doc: dict[str, Any], width: int | None = None, notes: Sequence[str] = ()) -> str:
    """The report as a table (``width``: the terminal's, None when piped); ``notes``
    (the ``--adopt`` suggestions) above its last line."""
    rows = []
    for r in doc["holders"]:
        if not r["covered"]:
            lease = f"STRAY: {r['why']}"
        else:
            lease = f"{r['lease']} {r['label']!r}" if r["lease"] else "allowed (configuration)"
        device = r["device"] if r["index"] is not None else f"{r['device']}: shared nodes only"
        rows.append(
            (
                device,
                str(r["pid"]),
                r["user"],
                format_duration(r["age_s"]),
                size(r["rss_bytes"]),
                size(r["device_memory_bytes"]),
                lease,
                _command(r),
            )
        )
    lines = table(HEAD, rows, width, flex=FLEX)
    tail = f"{len(rows)} holder(s), {doc['stray']} stray; {doc['processes']} processes scanned"
    if doc["not_inspected"]:
        tail += f"; not inspected: {doc['not_inspected']} (permission)"
    lines.extend(fit(n, width) for n in notes)
    lines.append(tail)
    return "\n".join(lines)


def _command(row: dict[str, Any]) -> str:
    """The command, after who runs it where that is known (a container, a job, a unit)."""
    whose = words(row.get("origin"))
    return f"[{whose}] {row['command']}" if whose else str(row["command"])


def size(n: int | None) -> str:
    """Bytes for people: ``512B``, ``4.0KiB``, ``1.5GiB``; ``-`` for unknown."""
    return format_bytes(n)
