"""The checks of a stack file that span keys or units, over the plain data.

They run whether or not the schema accepted the file, so one run reports every
problem; each is ``(line, "key.path: message")``. What each kind takes, the
``after`` names, conditions and cycles, placeholders, ports.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from hold_supervisor.stackfile import placeholders
from hold_supervisor.stackfile.spec import Path, dotted, line_of
from hold_supervisor.stackfile.values import CONDITION_SYNONYMS, CONDITIONS, UNIT_KINDS

_UNIT_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}", re.ASCII)
# Keys that make sense for some kinds only.
TAKES = {
    "service": (
        "cmd",
        "cwd",
        "port",
        "cpus",
        "env",
        "env_file",
        "pass_env",
        "ready",
        "liveness",
        "restart",
        "stop",
        "after",
        "essential",
        "scratch",
        "kind",
    ),
    "oneshot": (
        "cmd",
        "cwd",
        "cpus",
        "env",
        "env_file",
        "pass_env",
        "stop",
        "after",
        "essential",
        "scratch",
        "timeout",
        "kind",
    ),
    "task": (
        "cmd",
        "cwd",
        "cpus",
        "env",
        "env_file",
        "pass_env",
        "stop",
        "scratch",
        "timeout",
        "concurrency",
        "args",
        "kind",
    ),
}
WHY_NOT = {
    "task": "a task runs once per call",
    "oneshot": "a oneshot runs once, to completion, when the stack starts",
    "service": "a service runs until the stack stops",
}


class Problems:
    """The problems found so far, each with the line of its key."""

    def __init__(self, lines: Mapping[Path, int]) -> None:
        self.lines = lines
        self.found: list[tuple[int, str]] = []

    def add(self, loc: tuple[Any, ...], msg: str) -> None:
        self.found.append((line_of(self.lines, loc), f"{dotted(loc)}: {msg}"))


def cross_checks(data: dict[str, Any], lines: Mapping[Path, int]) -> list[tuple[int, str]]:
    """Every problem that spans keys or units in the plain stack data."""
    p = Problems(lines)
    units = data.get("units")
    if not isinstance(units, dict):
        return p.found
    for name in units:
        if not isinstance(name, str) or not _UNIT_NAME.fullmatch(name):
            p.add(
                ("units", str(name)),
                f"{name!r} is not a valid unit name: letters, digits, "
                "'_' and '-', starting with a letter or '_', at most 64 characters",
            )
    units = {n: u for n, u in units.items() if isinstance(u, dict)}
    kinds = {n: u.get("kind", "service") for n, u in units.items()}
    _kind_keys(p, units, kinds)
    graph = _dependencies(p, units, kinds)
    for cycle in _cycles(graph):
        p.add(("units", cycle[0], "after"), "cycle: " + " -> ".join([*cycle, cycle[0]]))
    _placeholders(p, units)
    _ports(p, units)
    return p.found


def _kind_keys(p: Problems, units: dict[str, Any], kinds: dict[str, Any]) -> None:
    """Each kind takes its keys; a task has its own CPU lane."""
    for name, unit in units.items():
        kind = kinds[name]
        if kind not in UNIT_KINDS:
            continue
        for key in unit:
            if key in TAKES[kind] or not any(key in TAKES[k] for k in UNIT_KINDS):
                continue  # an unknown key is the schema's to report
            takers = [k for k in UNIT_KINDS if key in TAKES[k]]
            if takers == ["task"]:
                p.add(("units", name, key), "only for a task unit (kind: task)")
                continue
            p.add(
                ("units", name, key),
                f"not for a {kind} unit ({WHY_NOT[kind]}); {key} is for "
                + " and ".join(f"kind: {k}" for k in takers)
                + f"; a {kind} takes: "
                + ", ".join(k for k in TAKES[kind] if k != "kind"),
            )
        if kind == "task" and unit.get("cpus") is None:
            p.add(
                ("units", name, "cpus") if "cpus" in unit else ("units", name),
                "cpus is required for a task unit: its own CPU lane, a CPU list like "
                "14-15 (never 'no pinning')",
            )
        ready = unit.get("ready")
        if isinstance(ready, dict) and "http" in ready and unit.get("port") is None:
            p.add(
                ("units", name, "ready", "http"),
                f"an http probe needs the unit's port (add port: auto or a number to {name})",
            )
        live = unit.get("liveness")
        if isinstance(live, dict) and "http" in live and unit.get("port") is None:
            p.add(
                ("units", name, "liveness", "http"),
                f"an http check needs the unit's port (add port: auto or a number to {name})",
            )


def _after_items(unit: dict[str, Any]) -> Iterator[tuple[tuple[Any, ...], Any, Any]]:
    """(key path, name, condition or None) for each entry of ``after``, either form."""
    after = unit.get("after")
    if isinstance(after, list):
        for i, dep in enumerate(after):
            yield ("after", i), dep, None
    elif isinstance(after, dict):
        for dep, cond in after.items():
            yield ("after", dep), dep, cond


def _dependencies(
    p: Problems, units: dict[str, Any], kinds: dict[str, Any]
) -> dict[str, list[str]]:
    """Check ``after``: known units, a condition the other kind can meet; the graph."""
    names = list(units)
    graph: dict[str, list[str]] = {n: [] for n in units}
    for name, unit in units.items():
        for sub, dep, cond in _after_items(unit):
            loc = ("units", name, *sub)
            if not isinstance(dep, str):
                continue
            if dep not in units:
                p.add(loc, f"{dep!r} names no unit (units: {', '.join(names)})")
                continue
            if dep == name:
                p.add(loc, f"cycle: {name} -> {name}")
                continue
            graph[name].append(dep)
            problem = _condition_problem(dep, kinds.get(dep), cond)
            if problem:
                p.add(loc, problem)
    return graph


def _condition_problem(dep: str, kind: Any, cond: Any) -> str | None:
    if kind == "task":
        return f"{dep!r} is a task unit: it runs per call and is never 'ready' to wait for"
    if cond is None:
        return None
    if cond not in CONDITIONS:
        hint = f" ({cond} is {CONDITION_SYNONYMS[cond]} here)" if cond in CONDITION_SYNONYMS else ""
        return f"{cond!r} is not valid: one of {', '.join(CONDITIONS)}{hint}"
    if kind == "oneshot" and cond == "ready":
        return (
            f"{dep} is a oneshot: it has no readiness; wait for started or completed "
            "(exited with status 0)"
        )
    if kind != "oneshot" and cond == "completed":
        return f"{dep} is a {kind}: it does not complete; wait for started or ready"
    return None


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """One representative of each dependency cycle (each cycle reported once)."""
    out: list[list[str]] = []
    reported: set[frozenset[str]] = set()
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        path.append(n)
        for d in graph.get(n, []):
            if state.get(d) == 1:
                cyc = path[path.index(d) :]
                key = frozenset(cyc)
                if key not in reported:
                    reported.add(key)
                    out.append(cyc)
            elif d not in state:
                visit(d)
        path.pop()
        state[n] = 2

    for n in graph:
        if n not in state:
            visit(n)
    return out


def strings(unit: Mapping[str, Any]) -> Iterator[tuple[tuple[Any, ...], str]]:
    """(key path within the unit, text) for every value that may hold placeholders."""
    cmd = unit.get("cmd")
    if isinstance(cmd, list):
        for i, a in enumerate(cmd):
            if isinstance(a, str):
                yield ("cmd", i), a
    if isinstance(unit.get("cwd"), str):
        yield ("cwd",), unit["cwd"]
    env = unit.get("env")
    if isinstance(env, dict):
        for k, v in env.items():
            if isinstance(v, str):
                yield ("env", k), v
    for probe in ("ready", "liveness"):
        spec = unit.get(probe)
        if not isinstance(spec, dict):
            continue
        for k in ("http", "tcp", "file"):
            if isinstance(spec.get(k), str):
                yield (probe, k), spec[k]
        ex = spec.get("exec")
        if isinstance(ex, str):
            yield (probe, "exec"), ex
        elif isinstance(ex, list):
            for i, a in enumerate(ex):
                if isinstance(a, str):
                    yield (probe, "exec", i), a


def _placeholders(p: Problems, units: dict[str, Any]) -> None:
    """Our placeholders name known things: ``{port}`` needs a port, ``{scratch}`` a scratch."""
    names = list(units)
    for name, unit in units.items():
        for sub, text in strings(unit):
            loc = ("units", name, *sub)
            for use in placeholders.uses(text):
                problem = _use_problem(use, name, units, names)
                if problem:
                    p.add(loc, problem)
            cut = placeholders.cut_short(text)
            if cut is not None:
                p.add(loc, f"{cut!r} has no closing brace; accepted {placeholders.ACCEPTED}")


def _use_problem(
    use: placeholders.Use, name: str, units: dict[str, Any], names: list[str]
) -> str | None:
    unit = units[name]
    if use.unit is not None:
        if use.unit not in units:
            return f"{{{use.name}}} names no unit (units: {', '.join(names)})"
        if units[use.unit].get("port") is None:
            return f"{{{use.name}}}: unit {use.unit} has no port"
        return None
    if use.name == "port" and unit.get("port") is None:
        return f"{{port}} used, but unit {name} has no port (add port: auto or a number)"
    if use.name == "scratch" and unit.get("kind") == "task":
        return "a task's scratch is each call's own: use $HOLD_SCRATCH, not {scratch}"
    if use.name == "scratch" and unit.get("scratch") in (None, False):
        return f"{{scratch}} used, but unit {name} has no scratch (add scratch: {{}})"
    if use.name in placeholders.SIMPLE:
        return None
    return f"unknown placeholder {{{use.name}}}: accepted {placeholders.ACCEPTED}"


def _ports(p: Problems, units: dict[str, Any]) -> None:
    """A port number belongs to one unit."""
    owners: dict[int, str] = {}
    for name, unit in units.items():
        port = unit.get("port")
        if isinstance(port, int) and not isinstance(port, bool):
            if port in owners:
                p.add(("units", name, "port"), f"port {port} is already unit {owners[port]}'s")
            else:
                owners[port] = name
