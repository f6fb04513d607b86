"""``hold top``'s frame: what one screen shows, as lines of text, each with a style.

Pure: a :class:`Snapshot` (the last answers of the daemon, the stacks and the
stray scan) in, :class:`Line` s out; no terminal, and no clock but ``now``. The
live view (:mod:`hold.views.top`) paints the lines with curses; piped, they
are printed as they are. Every table is laid out by the one rule of
:mod:`hold_supervisor.width` (labels, reasons and commands give way first),
so others' text (labels, commands, reasons) is escaped (``shown``) on the way.

Resource figures are shown where the documents carry them, ``-`` where they
do not: a lease holder's and a stack unit's ``usage`` (``cpu_percent``,
``rss_bytes``, ``pids``), an NVIDIA device's ``gpu`` (``util_percent``,
``memory_used_bytes``, ``memory_total_bytes``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hold.views.audittable import size
from hold.views.status import arbiter_line, known, queue_lines
from hold_supervisor.parse import format_duration
from hold_supervisor.width import fit, table

PLAIN, HEAD, RED, DIM = "plain", "head", "red", "dim"  # a line's style


class Line(NamedTuple):
    text: str
    style: str = PLAIN


@dataclass
class Snapshot:
    """What the sources last said (each part with when, and why it failed)."""

    status: dict[str, Any] | None = None  # the daemon's status answer, the last good one
    status_at: float | None = None  # when it came (wall clock)
    status_error: str | None = None  # why the last ask got none (None: it answered)
    stacks: list[dict[str, Any]] = field(default_factory=list)  # each running stack's ps answer
    stacks_silent: list[str] = field(default_factory=list)  # stacks that did not answer
    stacks_error: str | None = None
    audit: dict[str, Any] | None = None  # hold audit --json's document, the last one
    audit_at: float | None = None
    audit_error: str | None = None


DEVICE_HEAD = ("DEVICE", "STATE", "LEASE", "USER", "PID", "LEFT", "GPU%", "GPU MEM", "LABEL")
LEASE_HEAD = ("LEASE", "USER", "PID", "DEVICES", "LEFT", "CPU%", "RSS", "PIDS", "LABEL")
UNIT_HEAD = ("STACK", "UNIT", "STATE", "PID", "UPTIME", "CPU%", "RSS", "PIDS")
STRAY_HEAD = ("DEVICE", "PID", "USER", "AGE", "RSS", "WHY", "COMMAND")


def frame(
    snap: Snapshot,
    width: int | None,
    height: int | None,
    now: float,
    delay: float,
    stray_every: float,
) -> list[Line]:
    """The lines of one frame: at most ``height`` of them (the last saying how many
    did not fit), each within ``width`` columns. ``height`` None: a plain frame
    (piped), whole, without the live view's key hints."""
    lines = [
        Line(
            fit(
                f"hold top  {time.strftime('%H:%M:%S', time.localtime(now))}  every "
                f"{format_duration(delay)}, strays every {format_duration(stray_every)}"
                + ("  (q quits, space refreshes)" if height is not None else ""),
                width,
            ),
            HEAD,
        )
    ]
    lines += _arbiter(snap, width, now, height is not None)
    if snap.status is not None:
        lines += _devices(snap.status, width, now)
    lines += _strays(snap, width, now)
    if snap.status is not None:
        lines += _leases(snap.status, width, now)
    lines += _stacks(snap, width)
    return _fit_height(lines, width, height)


def _fit_height(lines: list[Line], width: int | None, height: int | None) -> list[Line]:
    if height is None or len(lines) <= height:
        return lines
    keep = max(height - 1, 0)
    more = len(lines) - keep
    return [
        *lines[:keep],
        Line(fit(f"... {more} more lines (a taller terminal shows them)", width), DIM),
    ]


def _arbiter(snap: Snapshot, width: int | None, now: float, live: bool) -> list[Line]:
    out = []
    if snap.status is not None:
        out.append(Line(fit(arbiter_line(snap.status), width)))
    if snap.status_error is not None:
        since = "" if snap.status_at is None else f"; shown as of {_ago(snap.status_at, now)}"
        again = "; asking again" if live else ""
        text = f"daemon: {snap.status_error} (hold top starts none{again}){since}"
        out.append(Line(fit(text, width), RED))
    return out


def _ago(when: float, now: float) -> str:
    return f"{format_duration(max(now - when, 0.0))} ago"


def _left(h: dict[str, Any], now: float) -> str:
    expires = h.get("expires")
    if not isinstance(expires, (int, float)):
        return "-"
    left = expires - now
    return format_duration(left) if left > 0 else "ending"


def _label(h: dict[str, Any]) -> str:
    if h.get("why"):  # blocked or unusable: no lease, the reason instead of a label
        return str(h["why"])
    if h.get("foreign") and h.get("record_by"):
        return f"(its lock is held; its record was made by user {h['record_by']}, not believed)"
    if h.get("foreign"):
        return "(its lock is held, but by no ticket daemon)"
    label = repr(h["label"]) if h.get("label") is not None else "(private)"
    return label + (" via another daemon" if h.get("state") == "elsewhere" else "")


def _percent(value: object, digits: int = 0) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    return f"{value:.{digits}f}"


def _bytes(value: object) -> str:
    if isinstance(value, bool) or not isinstance(value, int):
        return "-"
    return size(value)


def _gpu(dev: dict[str, Any]) -> tuple[str, str]:
    """GPU% and GPU MEM (``used/total``) of a device, ``-`` where not known."""
    gpu = dev.get("gpu")
    if not isinstance(gpu, dict):
        return "-", "-"
    used, total = gpu.get("memory_used_bytes"), gpu.get("memory_total_bytes")
    mem = "-" if used is None and total is None else f"{_bytes(used)}/{_bytes(total)}"
    return _percent(gpu.get("util_percent")), mem


def _usage(u: object) -> tuple[str, str, str]:
    """CPU%, RSS and PIDS of a ``usage`` figure, ``-`` where absent."""
    if not isinstance(u, dict):
        return "-", "-", "-"
    pids = u.get("pids")
    return (
        _percent(u.get("cpu_percent"), 1),
        _bytes(u.get("rss_bytes")),
        str(pids) if isinstance(pids, int) and not isinstance(pids, bool) else "-",
    )


def _devices(ans: dict[str, Any], width: int | None, now: float) -> list[Line]:
    rows: list[list[str]] = []
    queues: dict[int, list[str]] = {}  # after row N: its class's queue
    for cls, info in sorted(ans["classes"].items()):
        for dev in info["devices"]:
            name = f"{cls}:{dev['index']}"
            h = dev.get("holder")
            util, mem = _gpu(dev)
            if h is None:
                state = known(dev)
                rows.append([name, state, "", "", "", "", util, mem, str(dev.get("proof", ""))])
                continue
            state = "active" if h["state"] == "elsewhere" else str(h["state"])
            pid = "-" if h.get("pid") is None else str(h["pid"])
            rows.append(
                [
                    name,
                    state,
                    str(h["lease"]),
                    str(h["user"]),
                    pid,
                    _left(h, now),
                    util,
                    mem,
                    _label(h),
                ]
            )
        queues[len(rows)] = queue_lines(info)
    lines = table(DEVICE_HEAD, rows, width, flex=(8,))
    out = [Line(lines[0], HEAD)]
    for n, text in enumerate(lines[1:], 1):
        state = rows[n - 1][1]
        out.append(Line(text, RED if state == "blocked" else PLAIN))
        out += [Line(fit(f"  {q}", width)) for q in queues.get(n, [])]
    return out


def _leases(ans: dict[str, Any], width: int | None, now: float) -> list[Line]:
    """One row per lease (its devices together), with its holder's usage."""
    leases: dict[str, tuple[dict[str, Any], list[str]]] = {}
    for cls, info in sorted(ans["classes"].items()):
        for dev in info["devices"]:
            h = dev.get("holder")
            if h is None or h["state"] in ("blocked", "unusable"):
                continue
            leases.setdefault(str(h["lease"]), (h, []))[1].append(f"{cls}:{dev['index']}")
    if not leases:
        return [Line(fit("LEASES  none", width), HEAD)]
    rows = []
    for lid, (h, devs) in leases.items():
        cpu, rss, pids = _usage(h.get("usage"))
        pid = "-" if h.get("pid") is None else str(h["pid"])
        rows.append(
            [lid, str(h["user"]), pid, ",".join(devs), _left(h, now), cpu, rss, pids, _label(h)]
        )
    lines = table(LEASE_HEAD, rows, width, flex=(8,))
    return [Line(lines[0], HEAD), *(Line(t) for t in lines[1:])]


def _stacks(snap: Snapshot, width: int | None) -> list[Line]:
    """Each running stack's units, with their usage; a stack that did not answer, named."""
    if snap.stacks_error is not None:
        return [Line(fit(f"STACKS  cannot be listed: {snap.stacks_error}", width), RED)]
    if not snap.stacks and not snap.stacks_silent:
        return [Line(fit("STACKS  none running", width), HEAD)]
    rows = []
    for s in sorted(snap.stacks, key=lambda s: str(s.get("stack"))):
        for u in s.get("units", []):
            cpu, rss, pids = _usage(u.get("usage"))
            pid = "-" if u.get("pid") is None else str(u["pid"])
            rows.append(
                [
                    str(s["stack"]),
                    str(u["unit"]),
                    str(u["state"]),
                    pid,
                    format_duration(u.get("uptime")),
                    cpu,
                    rss,
                    pids,
                ]
            )
    rows += [
        [name, "?", "not answering", "?", "-", "-", "-", "-"] for name in sorted(snap.stacks_silent)
    ]
    lines = table(UNIT_HEAD, rows, width, flex=(1,))
    return [
        Line(lines[0], HEAD),
        *(
            Line(t, RED if r[2] == "not answering" else PLAIN)
            for t, r in zip(lines[1:], rows, strict=True)
        ),
    ]


def _strays(snap: Snapshot, width: int | None, now: float) -> list[Line]:
    """The holders the last scan found outside any lease, in red; when it was."""
    out = []
    if snap.audit_error is not None:
        out.append(Line(fit(f"STRAYS  cannot tell: {snap.audit_error}", width), RED))
    doc = snap.audit
    if doc is None:
        return out or [Line(fit("STRAYS  the first scan is running", width), HEAD)]
    strays = [r for r in doc["holders"] if not r["covered"]]
    when = "" if snap.audit_at is None else f"scanned {_ago(snap.audit_at, now)}, "
    scanned = f"({when}{doc['processes']} processes"
    scanned += f", not inspected: {doc['not_inspected']})" if doc.get("not_inspected") else ")"
    if not strays:
        return [*out, Line(fit(f"STRAYS  none {scanned}", width), HEAD)]
    rows = []
    for r in strays:
        device = r["device"] if r["index"] is not None else f"{r['device']} (shared nodes)"
        rows.append(
            [
                device,
                str(r["pid"]),
                str(r["user"]),
                format_duration(r.get("age_s")),
                _bytes(r.get("rss_bytes")),
                str(r["why"]),
                str(r["command"]),
            ]
        )
    lines = table(STRAY_HEAD, rows, width, flex=(5, 6))
    out.append(Line(fit(f"STRAYS  {len(strays)} {scanned}", width), RED))
    out.append(Line(lines[0], HEAD))
    out += [Line(t, RED) for t in lines[1:]]
    return out
