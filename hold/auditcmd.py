"""``hold audit``, the command: options checked, the report, ``--kill``, the exit status."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from hold.devices import DeviceClass
from hold.statedir import StateDir
from supervisor.exitcodes import NO, SURVIVORS, USAGE
from supervisor.width import columns, fit


def main_audit(sd: StateDir, classes: dict[str, DeviceClass], cls: str | None, as_json: bool,
               kill: bool, yes: bool, grace: float) -> int:  # fmt: skip
    """Scan, attribute, print (and with ``kill``, stop the strays); the exit status:
    0 all covered, 1 a stray, 3 a stop left survivors."""
    from hold.audit import build_report, kill_strays
    from hold.auditview import render_table

    doc = build_report(sd, classes, cls)
    strays = [r for r in doc["holders"] if not r["covered"]]
    width = columns(sys.stdout)
    asked = kill and strays and not yes
    if asked:
        if not sys.stdin.isatty():
            click.echo("hold: --kill without --yes needs a terminal to ask at", err=True)
            return USAGE
        click.echo(render_table(doc, width))
        if not click.confirm(f"Stop the trees of {len(strays)} stray holder(s)?"):
            return NO
    if kill and strays:
        doc["killed"] = kill_strays(doc, sd, grace)
    if as_json:
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
    else:
        if not asked:
            click.echo(render_table(doc, width, notes=[] if kill else adopt_hints(doc)))
        for line in _killed_lines(doc):
            click.echo(fit(line, width))
    if any(k.get("survivors") or not k.get("stopped") for k in doc.get("killed", [])):
        return SURVIVORS
    return NO if strays else 0


def _killed_lines(doc: dict[str, Any]) -> list[str]:
    out = []
    for k in doc.get("killed", []):
        state = "stopped" if k.get("stopped") else "NOT stopped"
        out.append(f"pid {k['pid']}: {state} {k.get('why') or k.get('outcome', '')}")
        for s in k.get("survivors", []):
            out.append(f"  survivor pid {s['pid']} ({s['found_by']}): {s['command']}")
    return out


def adopt_hints(doc: dict[str, Any]) -> list[str]:
    """For each stray process of the caller's (root: anyone's) on a device (not only
    its class's shared nodes) that no lease holds, the command that gives it a lease
    (``--adopt``); not for one below another such stray (that one's tree has it)."""
    import os

    from supervisor.procscan import ancestors

    uid = os.geteuid()
    rows = {r["pid"]: r for r in doc["holders"]
            if not r["covered"] and r["lease"] is None and r["index"] is not None
            and uid in (0, r["uid"])}  # fmt: skip
    out: list[str] = []
    for pid, r in rows.items():
        if any(a.pid in rows for a in ancestors(pid)):
            continue
        cls = r["cls"]
        prog = f"{cls}-hold" if cls in ("npu", "gpu") else f"hold run --device {cls}"
        # The pid last: a line with " PID " in it is that process's row.
        out.append(f"to lease a stray of yours: {prog} -t DURATION --adopt {pid}")
    return out
