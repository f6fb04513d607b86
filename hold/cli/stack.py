"""``hold up / ps / logs / down / restart / validate``: stacks, composed with tickets.

:mod:`hold_supervisor.stack.stack` runs the units and knows nothing of devices. The
``hold`` side adds what ``hold`` is for, in rooms of their own:

* :mod:`hold.cli.stackdir`: where a stack lives (``HOLD_STATE_DIR/stacks/NAME/``:
  ``control.sock``, ``logs/UNIT.log``, ``stack.json``, ``supervisor.log`` for
  a detached stack), its file checked by our rules, asking a running stack;
* :mod:`hold.cli.up`: ``hold up`` (the ticket, the trees registered with the
  daemon, the stack run inside the ticket; ``--detach``);
* :mod:`hold.cli.down`: ``hold down`` and ``hold restart``;
* here: the read-only commands, ``hold validate``, ``hold ps``, ``hold logs``,
  and every command's entry point under its old name.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from hold.cli.down import main_down, main_restart
from hold.cli.logs import main_logs
from hold.cli.stackdir import (
    PS_WAIT,
    ask,
    load_checked,
    no_such_stack,
    not_answering,
    open_sd,
    run_dir_of,
    running_stacks,
    say,
    supervisor_of,
)
from hold.cli.up import main_up
from hold.cli.validate import main_validate
from hold_supervisor.documents import StackRecord
from hold_supervisor.exitcodes import EXPIRED, NO, USAGE
from hold_supervisor.parse import BadValue, format_duration
from hold_supervisor.proc import usage
from hold_supervisor.stack.controlsock import NoAnswer
from hold_supervisor.stack.wire import StackOp
from hold_supervisor.width import columns, fit, table

__all__ = [
    "load_checked",
    "main_down",
    "main_logs",
    "main_ps",
    "main_restart",
    "main_up",
    "main_validate",
    "run_dir_of",
    "running_stacks",
    "say",
]


# ---------------------------------------------------------------------- ps


def main_ps(name: str | None, as_json: bool) -> int:
    """``hold ps [NAME]``: 0; 1 if NAME is not running; 124 if a stack did not
    answer within :data:`~hold.cli.stackdir.PS_WAIT` (named, with its supervisor's pid)."""
    silent: list[str] = []
    try:
        if name is None:
            stacks, silent = running_stacks()
            if not as_json and any(_unrated(s) for s in stacks):
                time.sleep(SECOND_LOOK)  # a CPU per cent needs two readings
                # Only those that answered: one that did not is not waited for twice.
                again, _ = running_stacks({s["stack"] for s in stacks})
                stacks = again if len(again) == len(stacks) else stacks
        else:
            try:
                ans = ask(name, {"op": StackOp.PS}, timeout=PS_WAIT)
                if ans is not None and not as_json and _unrated(ans):
                    # A CPU per cent needs two readings: the second, a moment later.
                    time.sleep(SECOND_LOOK)
                    ans = ask(name, {"op": StackOp.PS}, timeout=PS_WAIT) or ans
            except NoAnswer:
                ans = None
                silent = [name]
            stacks = [ans] if ans is not None else []
    except BadValue as e:
        say(str(e), "hold ps")
        return USAGE
    if name is not None and silent:
        _say_silent(name)
        return EXPIRED
    if name is not None and not stacks:
        no_such_stack(name, "hold ps")
        return NO
    if as_json:
        shown = [public(s) for s in stacks]
        doc: Any = {"version": PS_VERSION, "stacks": shown} if name is None else shown[0]
        if silent:
            doc["not_answering"] = [
                {"stack": n, "pid": supervisor_of(n), "waited_s": PS_WAIT} for n in silent
            ]
        print(json.dumps(doc, indent=2))
    elif name is None:
        _print_stacks(stacks, silent)
    else:
        _print_stack(stacks[0])
    for n in silent:
        _say_silent(n)
    return EXPIRED if silent else 0


SECOND_LOOK = 0.5  # seconds between two asks (the stack's least interval for a per cent)


def _unrated(ans: dict[str, Any]) -> bool:
    """Has a running unit figures but no CPU per cent yet (the first reading)?"""
    return any(
        u.get("pid") and isinstance(u.get("usage"), dict) and u["usage"]["cpu_percent"] is None
        for u in ans.get("units", [])
    )


def _say_silent(name: str) -> None:
    say(
        f"{not_answering(name, supervisor_of(name), PS_WAIT)}; "
        f"hold down {name} stops its units through the ticket daemon",
        "hold ps",
    )


PS_VERSION = 1
_WIRE = ("ev", "done")  # the control channel's framing, not the stack's state


def public(ans: dict[str, Any]) -> dict[str, Any]:
    """A stack's ``ps`` answer as ``hold ps --json`` shows it: versioned, no framing."""
    return {"version": PS_VERSION, **{k: v for k, v in ans.items() if k not in _WIRE}}


def _record(name: str) -> StackRecord | None:
    """The stack's ``stack.json`` (its file, when it started), or None."""
    try:
        return StackRecord.read(os.path.join(run_dir_of(open_sd(), name), "stack.json"))
    except (OSError, ValueError, BadValue):  # BadDocument and UnsafePath among them
        return None


def _table(rows: list[list[str]], flex: tuple[int, ...] = (), drop: tuple[int, ...] = ()) -> str:
    """The one table rule (:func:`hold_supervisor.width.table`): at a terminal, within
    its width, the columns in ``drop`` left out whole (in order) where the rest
    would not fit, then the free-text columns in ``flex`` giving way; piped, whole."""
    return "\n".join(table(rows[0], rows[1:], columns(sys.stdout), flex=flex, drop=drop))


def _print_stacks(stacks: list[dict[str, Any]], silent: list[str]) -> None:
    """``hold ps``: one line per running stack; one that did not answer is there too,
    with what is known of it (its supervisor, its file)."""
    if not stacks and not silent:
        print("no stack is running")
        return
    rows = [["STACK", "PID", "UNITS", "READY", *usage.HEAD, "UPTIME", "FILE"]]
    for s in stacks:
        ready = sum(1 for u in s["units"] if u["state"] == "ready")
        rows.append(
            [
                s["stack"],
                str(s["pid"]),
                str(len(s["units"])),
                str(ready),
                *usage.cells(_stack_usage(s)),
                format_duration(s["uptime"]),
                s["file"],
            ]
        )
    for name in silent:
        rec = _record(name)
        pid = supervisor_of(name)
        unknown = ["?"] * len(usage.HEAD)
        file = "?" if rec is None else rec.file
        rows.append([name, str(pid or "?"), "?", "?", *unknown, "not answering", file])
    rows[1:] = sorted(rows[1:])
    print(_table(rows, flex=(len(rows[0]) - 1,)))


def _stack_usage(s: dict[str, Any]) -> dict[str, Any] | None:
    """A stack's figures: the sum of its units' (a per cent only where each unit has one)."""
    docs = [u["usage"] for u in s["units"] if isinstance(u.get("usage"), dict)]
    if not docs:
        return None
    pcts = [d["cpu_percent"] for d in docs]
    return {
        "cpu_seconds": sum(d["cpu_seconds"] for d in docs),
        "cpu_percent": None if None in pcts else sum(pcts),
        "rss_bytes": sum(d["rss_bytes"] for d in docs),
        "pids": sum(d["pids"] for d in docs),
    }


def _print_stack(s: dict[str, Any]) -> None:
    """``hold ps NAME``: its units, then its running calls."""
    print(
        fit(
            f"stack {s['stack']} (pid {s['pid']}, {s['phase']}, up "
            f"{format_duration(s['uptime'])}) from {s['file']}",
            columns(sys.stdout),
        )
    )
    head = ["UNIT", "KIND", "STATE", "PID", *usage.HEAD, "PORT", "RESTARTS", "UPTIME", "CPUS"]
    rows = [[*head, "READY", "LIVENESS"]]
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
                *usage.cells(u.get("usage")),
                str(u["port"] or "-"),
                str(u["restarts"]),
                format_duration(u["uptime"]),
                u["cpus"] or "-",
                u["ready"],
                u.get("liveness") or "-",
            ]
        )
    # At 80 columns the figures stay; the CPU mask, restarts, uptime, the
    # readiness text and the port give way whole, in that order.
    print(_table(rows, flex=(13, 12), drop=(11, 9, 10, 12, 8)))
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
