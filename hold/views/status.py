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
from hold_supervisor.proc import usage
from hold_supervisor.width import columns, fit, table

HEAD = ("DEVICE", "STATE", "LEASE", "USER", "PID", *usage.HEAD, "LEFT", "UNTIL", "SINCE", "LABEL")
# At a narrow terminal these give way whole, in this order (at 80 columns: SINCE and
# UNTIL; LEFT stays): the since and until clock times, the process count, the CPU time.
DROPPED = (11, 10, 8, 6)


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


SECOND_LOOK = 0.5  # seconds between two asks, for a CPU per cent (the daemon's least interval)


def unrated(ans: dict[str, Any]) -> bool:
    """Does a lease in ``ans`` have figures but no CPU per cent yet (the daemon had
    no earlier reading of it)? Then the text view asks once more, after
    :data:`SECOND_LOOK`."""
    return any(
        isinstance(u := (d.get("holder") or {}).get("usage"), dict) and u["cpu_percent"] is None
        for info in ans["classes"].values()
        for d in info["devices"]
    )


def with_gpu(ans: dict[str, Any]) -> dict[str, Any]:
    """``ans`` (the daemon's ``status`` answer) with ``gpu`` added to each device
    that is an NVIDIA GPU (``nvidia_minor``): its utilisation and memory now,
    from NVML, read here rather than by the daemon (see
    :func:`hold.daemon.status._nvidia_minor`). Without NVML: no ``gpu`` key.
    NVML is loaded only where such a device is."""
    devices = [d for info in ans["classes"].values() for d in info["devices"]]
    if not any(isinstance(d.get("nvidia_minor"), int) for d in devices):
        return ans
    # lazy: NVML (ctypes) only where such a device is; off hold status's start
    from hold.devices import nvml

    figures = nvml.figures()
    if figures is None:
        return ans
    for d in devices:
        got = figures.get(d.get("nvidia_minor", -1))
        if got is not None:
            d["gpu"] = got.doc()
    return ans


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


def known(dev: dict[str, Any]) -> str:
    """What is known of a device nobody holds: ``free``, ``unknown`` or ``unproven``
    (an older daemon says nothing: ``free``, as it meant)."""
    return str(dev.get("known", "free"))


def _label(h: dict[str, Any]) -> str:
    if h.get("why"):  # blocked or unusable: no lease, the reason instead of a label
        return str(h["why"])
    if h.get("foreign") and h.get("record_by"):
        return f"(its lock is held; its record was made by user {h['record_by']}, not believed)"
    if h.get("foreign"):
        return "(its lock is held, but by no ticket daemon)"
    return repr(h["label"]) if h.get("label") is not None else "(private)"


def _pid(h: dict[str, Any]) -> str:
    """The holder's pid, or ``-`` where none holds it (a lock file nobody can use)."""
    return "-" if h.get("pid") is None else str(h["pid"])


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
                out.append(f"{name:<8} {known(dev):<7} {dev.get('proof', '')}".rstrip())
                continue
            state = "active" if h["state"] == "elsewhere" else h["state"]
            line = f"{name:<8} {state:<7} lease {h['lease']}  {_label(h)}  user {h['user']}"
            line += f"  pid {_pid(h)}"
            if h.get("usage"):
                line += f"  {usage.words(h['usage'])}"
            if _timed(h):
                since = time.strftime("%H:%M:%S", time.localtime(h["since"]))
                until = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["expires"]))
                line += f"  since {since} ({int(now - h['since'])}s)  until {until}"
            out.append(line + (" via another daemon" if h["state"] == "elsewhere" else ""))
        out += [f"{'':<8} {q}" for q in queue_lines(info)]
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
                rows.append([name, known(dev), *[""] * (len(HEAD) - 3), str(dev.get("proof", ""))])
                continue
            state = "active" if h["state"] == "elsewhere" else h["state"]
            left = until = since = ""
            if _timed(h):
                left = time_left(h["expires"], now).removesuffix(" left")
                until = format_when(h["expires"], now)
                since = format_when(h["since"], now)
            label = _label(h) + (" via another daemon" if h["state"] == "elsewhere" else "")
            figures = usage.cells(h.get("usage")) if "usage" in h else [""] * len(usage.HEAD)
            who = [name, state, h["lease"], h["user"], _pid(h)]
            rows.append([*who, *figures, left, until, since, label])
        queues[len(rows)] = queue_lines(info)
    lines = table(HEAD, rows, width, flex=(len(HEAD) - 1,), drop=DROPPED)
    out = lines[:1]
    for n, line in enumerate(lines[1:], 1):
        out.append(line)
        out += [fit(f"  {q}", width) for q in queues.get(n, [])]
    return out


def queue_lines(info: dict[str, Any]) -> list[str]:
    """A class's line of waiting requests, one sentence each (``queue 1: ...``)."""
    out = []
    for n, w in enumerate(info["queue"], 1):
        what = ",".join(map(str, w["indices"])) if w["indices"] else f"{w['count']} device(s)"
        out.append(f"queue {n}: {_label(w)} pid {w['pid']} user {w['user']} wants {what}")
    return out
