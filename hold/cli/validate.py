"""``hold validate FILE [--json]``: the stack file checked, and what ``hold up`` would do.

Text: the services and one-shots in start order, each with what it waits for
(``api after migrate (completed), model (ready)``), how it is ready, its
liveness check and whether it is essential; the task units apart (``hold up``
never starts them: each ``hold call`` runs one). ``--json``: the resolved stack,
every default filled in, versioned (``{"version": 1, ...}``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

from hold.cli.stackdir import load_checked, say
from hold_supervisor.exitcodes import OK, USAGE
from hold_supervisor.parse import BadValue, format_cpus
from hold_supervisor.stackfile.spec import plain

if TYPE_CHECKING:
    from hold_supervisor.stackfile.load import StackSpec, UnitSpec

VERSION = 1


def main_validate(path: str, as_json: bool = False) -> int:
    # lazy: the stack file's reader, off hold down NAME (which imports this module)
    from hold_supervisor.stackfile.load import StackFileError

    try:
        spec = load_checked(path)
    except StackFileError as e:
        for line in e.errors:
            print(line, file=sys.stderr)
        return USAGE
    except BadValue as e:
        say(str(e), "hold validate")
        return USAGE
    if as_json:
        print(json.dumps(resolved(spec, path), indent=2))
    else:
        print("\n".join(plan_lines(spec, path)))
    return OK


def resolved(spec: StackSpec, path: str) -> dict[str, Any]:
    """The stack as ``hold up`` reads it: every unit with its defaults, its conditions."""
    units: dict[str, Any] = {}
    for name, u in spec.units.items():
        d = plain(u)
        del d["conditions"], d["file_env"]  # the conditions are in `after`; values may be secret
        d["cpus"] = format_cpus(u.cpus) if u.cpus else None
        d["stop"]["signal"] = signal.Signals(u.stop.signal).name
        d["after"] = [{"unit": dep, "condition": spec.condition(name, dep)} for dep in u.after]
        units[name] = d
    return {
        "version": VERSION,
        "stack": spec.name,
        "file": os.path.abspath(path),
        "stack_dir": spec.stack_dir,
        "hold": plain(spec.hold) if spec.hold else None,
        "start_order": spec.services(),
        "tasks": spec.tasks(),
        "units": units,
    }


def plan_lines(spec: StackSpec, path: str) -> list[str]:
    """What ``hold up`` would do, for people."""
    services, tasks = spec.services(), spec.tasks()
    hold = f", inside a {spec.hold.device} ticket" if spec.hold else ""
    out = [
        f"{path}: stack {spec.name} is valid: {len(services)} unit(s) started by hold up"
        + (f", {len(tasks)} task unit(s)" if tasks else "")
        + hold,
        "start order:",
    ]
    width = max((len(n) for n in spec.units), default=0)
    for i, name in enumerate(services, 1):
        u = spec.units[name]
        out.append(f"  {i}. {name.ljust(width)}  {u.kind:<7}  {_what(spec, name, u)}")
    if tasks:
        out.append(f"task units (never started by hold up; hold call {spec.name} UNIT):")
        for name in tasks:
            u = spec.units[name]
            cpus = format_cpus(u.cpus) if u.cpus else "-"
            limit = f"timeout {u.timeout:g}s" if u.timeout is not None else "no timeout"
            out.append(
                f"  {name.ljust(width)}  cpus {cpus}, {limit}, concurrency {u.concurrency or 1}"
            )
    return out


def _what(spec: StackSpec, name: str, u: UnitSpec) -> str:
    """``after migrate (completed); ready: http /health; liveness: ...; not essential``."""
    parts = []
    if u.after:
        conds = ", ".join(f"{dep} ({spec.condition(name, dep)})" for dep in u.after)
        parts.append(f"after {conds}")
    if u.kind == "oneshot":
        parts.append("done when it exits 0")
    else:
        parts.append(f"ready: {u.ready.describe() if u.ready else 'at start'}")
    if u.liveness is not None:
        lv = u.liveness
        every = f"every {lv.period:g}s, restart after {lv.failures} failures"
        parts.append(f"liveness: {lv.as_probe().describe()} {every}")
    if not u.essential:
        parts.append("not essential")
    return "; ".join(parts)
