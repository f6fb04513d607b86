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
            click.echo(render_table(doc, width))
        for line in _killed_lines(doc):
            click.echo(fit(line, width))
        if not kill:
            for line in adopt_hints(doc):
                click.echo(line, err=True)
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
    """For each stray process of the caller's (root: anyone's) on a device no lease
    holds: the command that gives it a lease (``--adopt``)."""
    import os

    uid = os.geteuid()
    out: list[str] = []
    for r in doc["holders"]:
        if r["covered"] or r["lease"] is not None or uid not in (0, r["uid"]):
            continue
        cls = r["cls"]
        prog = f"{cls}-hold" if cls in ("npu", "gpu") else f"hold run --device {cls}"
        line = f"hold: pid {r['pid']} ({r['user']}) holds {r['device']} outside any lease; "
        line += f"to give it one: {prog} --adopt {r['pid']} -t DURATION"
        if line not in out:
            out.append(line)
    return out
