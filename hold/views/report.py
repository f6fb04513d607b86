"""``hold report``: who used which device, for how long (the document: :mod:`hold.daemon.report`).

Asked of the daemon that serves the state directory (every user gets the
totals, even of a system daemon whose history only root can read); where no
daemon serves, read from the history file by its owner (a per-user daemon
that left when idle). Never starts a daemon.

A daemon that does not answer within :data:`hold.client.connection.ANSWER_TIMEOUT`
(stopped, stalled) is not waited for: the history file is read here, as
with no daemon, and stderr says so (leases still live are not in the file);
where that file is not ours to read, exit 125 naming the daemon that did
not answer.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import textwrap
import time
from typing import Any

from hold.client.connection import Client, DaemonSilent, DaemonUnreachable
from hold.daemon import history
from hold.daemon.report import build
from hold.errors import HoldError
from hold.protocol import Ev, Op
from hold.statedir import StateDir
from hold_supervisor.parse import BadValue, format_bytes, format_duration, parse_duration
from hold_supervisor.width import columns, cut, fit, room, shown, table

USER_HEAD = (
    "USER",
    "LEASES",
    "LEASED",
    "HELD",
    "CPU",
    "PEAK MEM",
    "WAIT MEDIAN",
    "WAIT MAX",
    "EXPIRED",
    "RELEASED",
    "STRAYS",
    "LABELS",
)
DEVICE_HEAD = USER_HEAD[1:-1]
# Left out whole, in this order, where a terminal is too narrow for every
# column (the same positions in both tables: USER and DEVICE come first).
_DROP = (
    USER_HEAD.index("RELEASED"),
    USER_HEAD.index("WAIT MEDIAN"),
    USER_HEAD.index("EXPIRED"),
    USER_HEAD.index("PEAK MEM"),
    USER_HEAD.index("WAIT MAX"),
)


def parse_since(text: str | None, now: float) -> float:
    """``--since``: a duration back from now (``7d``, ``12h``) or a date (``2025-05-01``,
    ``2025-05-01T08:00``, local time); 0 for the whole history."""
    if text is None:
        return 0.0
    try:
        return now - parse_duration(text, what="--since", plain_unit="minutes")
    except BadValue:
        pass
    try:
        return datetime.datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise BadValue(
            "--since",
            text,
            "a duration back from now (7d, 12h, 30m) or a date (2025-05-01, 2025-05-01T08:00)",
        ) from None


def fetch(sd: StateDir, since: float, show_labels: bool) -> dict[str, Any]:
    """The report: the daemon's answer, or the history file read here (no daemon)."""
    try:
        client = Client.connect(sd, autostart=False)
    except DaemonSilent as e:
        return _from_file(sd, since, show_labels, e)
    except DaemonUnreachable:
        return _from_file(sd, since, show_labels)
    try:
        ans = client.request({"op": Op.REPORT, "since": since})
    except DaemonSilent as e:
        return _from_file(sd, since, show_labels, e)
    finally:
        client.close()
    if ans.get("ev") != Ev.REPORT:
        raise HoldError(f"the daemon refused the report: {ans.get('error', ans)}")
    ans.pop("ev", None)
    return ans


def _from_file(
    sd: StateDir, since: float, show_labels: bool, silent: Exception | None = None
) -> dict[str, Any]:
    """The report read here; ``silent``: why the daemon was not asked (it did not answer)."""
    try:
        entries = history.read(sd.path, since)
    except PermissionError:
        if silent is not None:
            raise HoldError(f"{silent}, and its history is not yours to read") from None
        raise HoldError(
            f"no daemon serves {sd.path}, and its history is not yours to read"
        ) from None
    if silent is not None:
        print(
            f"hold report: {silent}; the report is read from its history file here "
            "(leases still live are not in it)",
            file=sys.stderr,
        )
    return build(entries, os.geteuid(), show_labels=show_labels, since=since)


def main_report(doc: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(doc, indent=2, sort_keys=True))
        return
    width = columns(sys.stdout)
    print("\n".join(fit(line, width) if width else line for line in text_lines(doc, width)))


def text_lines(doc: dict[str, Any], width: int | None) -> list[str]:
    """The report for people: a table of users, one of devices, the latest strays."""
    since = doc.get("since")
    start = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if since else "the start"
    now = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(doc["now"]))
    intro = (
        f"hold report: from {start} to {now} (times are device time; held: seen in use; "
        "CPU and peak memory: their processes)"
    )
    # At a terminal: the sentence wrapped at words, the tables' least needed
    # columns left out whole, a long line cut with "..."; never a word cut.
    out = textwrap.wrap(intro, room(width)) if width else [intro]
    rows = [[u["user"], *_figures(u), _labels(u["labels"])] for u in doc["users"]]
    flex = (len(USER_HEAD) - 1,)
    out += table(USER_HEAD, rows, width, flex=flex, drop=_DROP) if rows else ["no leases"]
    rows = [[d["device"], *_figures(d)] for d in doc["devices"]]
    if rows:
        out += ["", *table(("DEVICE", *DEVICE_HEAD), rows, width, drop=_DROP)]
    for s in doc["strays"][-10:]:
        when = time.strftime("%m-%d %H:%M:%S", time.localtime(s["seen"]))
        mem = f" {s['memory_bytes']} bytes" if s.get("memory_bytes") else ""
        what = f": {s['command']}" if s.get("command") else ""
        line = f"stray {when} {s['device']} pid {s['pid']} user {s['user']}{mem}{what}"
        out.append(cut(shown(line), room(width)) if width else line)
    return out


def _figures(a: dict[str, Any]) -> list[str]:
    held = format_duration(a["held_s"]) if a["leased_s"] > a["unmeasured_s"] else "-"
    return [
        str(a["leases"]),
        format_duration(a["leased_s"]),
        held,
        _cpu(a),
        format_bytes(a.get("peak_bytes")),
        format_duration(a["wait_median_s"]),
        format_duration(a["wait_max_s"]),
        str(a["expiries"]),
        str(a["releases"]),
        str(a["strays"]),
    ]


def _cpu(a: dict[str, Any]) -> str:
    """CPU time; ``-`` where no lease had it (history written before it was recorded),
    ``>=`` where some had not."""
    cpu = a.get("cpu_s")
    if cpu is None:
        return "-"
    return (">=" if a.get("cpu_unmeasured") else "") + format_duration(cpu)


def _labels(labels: dict[str, float] | None) -> str:
    if labels is None:
        return "(hidden)"
    return ", ".join(f"{k} {format_duration(v)}" for k, v in labels.items())
