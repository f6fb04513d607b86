"""``hold up / ps / logs / down / restart / validate``: stacks, composed with tickets.

:mod:`supervisor.stack` runs the units and knows nothing of devices. The
``hold`` side adds what ``hold`` is for, in rooms of their own:

* :mod:`hold.stackdir`: where a stack lives (``HOLD_STATE_DIR/stacks/NAME/``:
  ``control.sock``, ``logs/UNIT.log``, ``stack.json``, ``supervisor.log`` for
  a detached stack), its file checked by our rules, asking a running stack;
* :mod:`hold.upcmd`: ``hold up`` (the ticket, the trees registered with the
  daemon, the stack run inside the ticket; ``--detach``);
* :mod:`hold.downcmd`: ``hold down`` and ``hold restart``;
* here: the read-only commands, ``hold validate``, ``hold ps``, ``hold logs``,
  and every command's entry point under its old name.
"""

from __future__ import annotations

import json
import os
from typing import Any

from hold.downcmd import main_down, main_restart
from hold.logscmd import main_logs
from hold.stackdir import ask, load_checked, no_such_stack, open_sd, run_dir_of, say
from hold.upcmd import main_up
from hold.validatecmd import main_validate
from supervisor.exitcodes import NO, USAGE
from supervisor.parse import BadValue, format_duration

__all__ = [
    "load_checked",
    "main_down",
    "main_logs",
    "main_ps",
    "main_restart",
    "main_up",
    "main_validate",
    "run_dir_of",
    "say",
]


# ---------------------------------------------------------------------- ps


def main_ps(name: str | None, as_json: bool) -> int:
    try:
        if name is None:
            stacks = _running_stacks()
        else:
            ans = ask(name, {"op": "ps"}, timeout=5)
            stacks = [ans] if ans is not None else []
    except BadValue as e:
        say(str(e), "hold ps")
        return USAGE
    if name is not None and not stacks:
        no_such_stack(name, "hold ps")
        return NO
    if as_json:
        shown = [public(s) for s in stacks]
        doc = {"version": PS_VERSION, "stacks": shown} if name is None else shown[0]
        print(json.dumps(doc, indent=2))
        return 0
    if name is None:
        _print_stacks(stacks)
    else:
        _print_stack(stacks[0])
    return 0


PS_VERSION = 1
_WIRE = ("ev", "done")  # the control channel's framing, not the stack's state


def public(ans: dict[str, Any]) -> dict[str, Any]:
    """A stack's ``ps`` answer as ``hold ps --json`` shows it: versioned, no framing."""
    return {"version": PS_VERSION, **{k: v for k, v in ans.items() if k not in _WIRE}}


def _running_stacks() -> list[dict[str, Any]]:
    from supervisor.stackctl import request

    sd = open_sd()
    base = sd.stacks()
    out = []
    for name in sorted(os.listdir(base)):
        try:
            ans = request(os.path.join(base, name, "control.sock"), {"op": "ps"}, timeout=5)
        except (OSError, TimeoutError, ValueError):
            continue
        out.append(ans)
    return out


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def _print_stacks(stacks: list[dict[str, Any]]) -> None:
    """``hold ps``: one line per running stack."""
    if not stacks:
        print("no stack is running")
        return
    rows = [["STACK", "PID", "UNITS", "READY", "UPTIME", "FILE"]]
    for s in stacks:
        ready = sum(1 for u in s["units"] if u["state"] == "ready")
        rows.append(
            [
                s["stack"],
                str(s["pid"]),
                str(len(s["units"])),
                str(ready),
                format_duration(s["uptime"]),
                s["file"],
            ]
        )
    print(_table(rows))


def _print_stack(s: dict[str, Any]) -> None:
    """``hold ps NAME``: its units, then its running calls."""
    print(
        f"stack {s['stack']} (pid {s['pid']}, {s['phase']}, up {format_duration(s['uptime'])}) "
        f"from {s['file']}"
    )
    head = ["UNIT", "KIND", "STATE", "PID", "PORT", "RESTARTS", "UPTIME", "CPUS", "READY"]
    rows = [[*head, "LIVENESS"]]
    optional = False
    for u in s["units"]:
        essential = u.get("essential", True)
        optional = optional or not essential
        rows.append(
            [
                u["unit"] + ("" if essential else "*"),
                u.get("kind", "service"),
                u["state"],
                str(u["pid"] or "-"),
                str(u["port"] or "-"),
                str(u["restarts"]),
                format_duration(u["uptime"]),
                u["cpus"] or "-",
                u["ready"],
                u.get("liveness") or "-",
            ]
        )
    print(_table(rows))
    if optional:
        print("* not essential: its end is reported, the rest keeps running")
    calls = s.get("calls") or []
    if calls:
        print()
        rows = [["CALL", "UNIT", "STATE", "PID", "RUNNING", "QUEUED", "CPUS"]]
        for c in calls:
            rows.append(
                [
                    c["call"],
                    c["unit"],
                    c["state"],
                    str(c["pid"] or "-"),
                    format_duration(c["running_s"]),
                    format_duration(c["queued_s"]),
                    c["cpus"],
                ]
            )
        print(_table(rows))
