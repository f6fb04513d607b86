"""``hold status``: each device, its holder and its queue.

Piped, one line per device in words (``user ann  pid 4242  since ...``), never
cut. At a terminal, a table fitted to the width by the one rule of
:mod:`hold_supervisor.width`: the label gives way first.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from hold.config import fingerprint
from hold_supervisor.parse import format_when, time_left
from hold_supervisor.width import columns, fit, table

HEAD = ("DEVICE", "STATE", "LEASE", "USER", "PID", "UNTIL", "SINCE", "LABEL")


def main_status(ans: dict[str, Any], as_json: bool) -> None:
    """Print the daemon's ``status`` answer ``ans``."""
    if as_json:
        print(json.dumps(status_document(ans), indent=2, sort_keys=True))
        return
    width = columns(sys.stdout)
    lines = [fit(arbiter_line(ans), width)]
    if ans.get("limits"):
        lines.append(fit(limits_line(ans["limits"]), width))
    lines += (
        [fit(ln, None) for ln in status_lines(ans)] if width is None else status_table(ans, width)
    )
    print("\n".join(lines))


def status_document(ans: dict[str, Any]) -> dict[str, Any]:
    """``hold status --json`` (version 1); ``hold web``'s ``/status.json`` is the same."""
    doc = {"version": 1, "arbiter": ans.get("arbiter"), "classes": ans["classes"]}
    if ans.get("limits"):  # a daemon from before the limits has none
        doc["limits"] = ans["limits"]
    return doc


def limits_line(lim: dict[str, Any]) -> str:
    """Each user's limits at the daemon, and this user's use of them."""
    yours = lim.get("yours") or {}
    return (
        f"limits per user (not root): {lim.get('connections')} connections, "
        f"{lim.get('queued')} requests waiting; yours: {yours.get('connections')} open, "
        f"{yours.get('queued')} waiting"
    )


def arbiter_line(ans: dict[str, Any]) -> str:
    arb = ans.get("arbiter") or {}
    kinds = {"system": "system daemon", "shared": f"shared daemon of {arb.get('user')}"}
    kind = kinds.get(str(arb.get("kind")), f"per-user daemon of {arb.get('user')}")
    config = arb.get("config")
    reads = f", reads {config}" if config else ", reads no file (the defaults)"
    if config and arb.get("config_digest") and fingerprint(str(config)) != arb["config_digest"]:
        reads += " -- changed since it read it (hold daemon --reload)"
    return f"arbiter: {kind} (pid {arb.get('pid')}, {arb.get('state_dir')}){reads}"


def _label(h: dict[str, Any]) -> str:
    if h.get("why"):  # blocked or unusable: no lease, the reason instead of a label
        return str(h["why"])
    if h.get("foreign"):
        return "(its lock is held, but by no ticket daemon)"
    return repr(h["label"]) if h.get("label") is not None else "(private)"


def _timed(h: dict[str, Any]) -> bool:
    return isinstance(h.get("since"), (int, float)) and isinstance(h.get("expires"), (int, float))


def status_lines(ans: dict[str, Any]) -> list[str]:
    """Piped: a line per device, in words, whole."""
    now = time.time()
    out = []
    for cls, info in sorted(ans["classes"].items()):
        for dev in info["devices"]:
            h = dev["holder"]
            name = f"{cls}:{dev['index']}"
            if h is None:
                out.append(f"{name:<8} free")
                continue
            state = "active" if h["state"] == "elsewhere" else h["state"]
            line = f"{name:<8} {state:<7} lease {h['lease']}  {_label(h)}  user {h['user']}"
            line += f"  pid {h['pid']}"
            if _timed(h):
                since = time.strftime("%H:%M:%S", time.localtime(h["since"]))
                until = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["expires"]))
                line += f"  since {since} ({int(now - h['since'])}s)  until {until}"
            out.append(line + (" via another daemon" if h["state"] == "elsewhere" else ""))
        out += [f"{'':<8} {q}" for q in _queue(info)]
    return out


def status_table(ans: dict[str, Any], width: int) -> list[str]:
    """At a terminal: a table within ``width`` columns; the queue under each class."""
    now = time.time()
    rows: list[list[str]] = []
    queues: dict[int, list[str]] = {}  # after row N: the class's queue
    for cls, info in sorted(ans["classes"].items()):
        for dev in info["devices"]:
            h = dev["holder"]
            name = f"{cls}:{dev['index']}"
            if h is None:
                rows.append([name, "free", "", "", "", "", "", ""])
                continue
            state = "active" if h["state"] == "elsewhere" else h["state"]
            until = since = ""
            if _timed(h):
                until = f"{format_when(h['expires'], now)} ({time_left(h['expires'], now)})"
                since = format_when(h["since"], now)
            label = _label(h) + (" via another daemon" if h["state"] == "elsewhere" else "")
            rows.append([name, state, h["lease"], h["user"], str(h["pid"]), until, since, label])
        queues[len(rows)] = _queue(info)
    lines = table(HEAD, rows, width, flex=(7, 6))
    out = lines[:1]
    for n, line in enumerate(lines[1:], 1):
        out.append(line)
        out += [fit(f"  {q}", width) for q in queues.get(n, [])]
    return out


def _queue(info: dict[str, Any]) -> list[str]:
    out = []
    for n, w in enumerate(info["queue"], 1):
        what = ",".join(map(str, w["indices"])) if w["indices"] else f"{w['count']} device(s)"
        out.append(f"queue {n}: {_label(w)} pid {w['pid']} user {w['user']} wants {what}")
    return out
