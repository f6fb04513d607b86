"""The stack file: a YAML description of units, read strictly.

:func:`load` returns a :class:`StackSpec` or raises :class:`StackFileError`
carrying *every* problem found, each as ``FILE:LINE: KEY.PATH: message``
(``stack.yaml:12: units.model.ready.timeout: '5x' is not valid: ...``).

How: the YAML is *composed* (not loaded), so every key keeps the line it came
from; the plain data is read by the one schema (:mod:`hold_supervisor.stackfile.schema`:
a table of keys per mapping, unknown keys refused, values read by
:mod:`hold_supervisor.stackfile.values`, every problem worded); then the checks that
span units (:mod:`hold_supervisor.stackfile.checks`) run over the same data, whether or
not the schema was happy with it, so one run reports all errors at once;
last, each unit's ``env_file`` is read (:mod:`hold_supervisor.stackfile.dotenv`) and its
``cwd`` checked.

Nothing here knows about devices or tickets: the optional ``hold:`` section is
only checked for shape; :mod:`hold` checks the device class and label, using
:meth:`StackSpec.where` for the line.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import yaml

from hold_supervisor import yamlsafe
from hold_supervisor.errors import SupervisorError
from hold_supervisor.exitcodes import USAGE
from hold_supervisor.stackfile import dotenv, placeholders, schema
from hold_supervisor.stackfile.checks import cross_checks
from hold_supervisor.stackfile.spec import (
    READY_KINDS,
    ArgSpec,
    HoldSpec,
    LivenessSpec,
    Path,
    ReadySpec,
    RestartSpec,
    ScratchSpec,
    StackSpec,
    StopSpec,
    UnitSpec,
    dotted,
    fill,
    filled_env,
    line_of,
)
from hold_supervisor.stackfile.values import UNIT_KINDS, YamlWord
from hold_supervisor.yamlsafe import scalar_value

__all__ = [
    "READY_KINDS",
    "UNIT_KINDS",
    "ArgSpec",
    "HoldSpec",
    "LivenessSpec",
    "ReadySpec",
    "RestartSpec",
    "ScratchSpec",
    "StackFileError",
    "StackSpec",
    "StopSpec",
    "UnitSpec",
    "fill",
    "filled_env",
    "load",
]

MAX_ERRORS = 100  # listed in one refusal; the rest are counted
PLACEHOLDERS_ACCEPTED = placeholders.ACCEPTED


class StackFileError(SupervisorError):
    """The stack file is not acceptable; ``errors`` lists every problem, one line each."""

    exit_code = USAGE

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


# The caller's own checks over the plain data: (key path, message) for each problem.
ExtraCheck = Callable[[dict[str, Any]], list[tuple[Path, str]]]


def load(path: str, *, text: str | None = None, extra_check: ExtraCheck | None = None) -> StackSpec:
    """Read and validate the stack file at ``path`` (or ``text`` as if it were there).

    ``extra_check`` adds the caller's checks (:mod:`hold` checks the device
    class and label of ``hold:``); their problems are reported with the rest.
    """
    shown = path
    try:
        if text is None:
            root = yamlsafe.load_file(path, shown=shown)
        else:
            root = yamlsafe.compose(text, shown)
    except yamlsafe.YamlError as e:
        raise StackFileError(e.lines) from None
    if root is None:
        raise StackFileError([f"{shown}:1: the file is empty: a stack needs name and units"])

    errors: list[tuple[int, str]] = []
    lines: dict[Path, int] = {}
    data = _plain(root, (), lines, shown, errors)

    spec: StackSpec | None = None
    if isinstance(data, dict):
        spec, found = schema.read(data, shown, lines)
        if extra_check is not None:
            found.extend(extra_check(data))
        errors.extend((line_of(lines, loc), f"{dotted(loc)}: {msg}") for loc, msg in found)
        if spec is not None:
            spec, problems = _files(spec)
            errors.extend(problems)
        errors.extend(cross_checks(data, lines))
    else:
        errors.append((1, "the top level must be a mapping with name and units"))

    if errors:
        seen: set[str] = set()
        out: list[str] = []
        for line, msg in sorted(errors):
            text_ = f"{shown}:{line}: {msg}"
            if text_ not in seen:
                seen.add(text_)
                out.append(text_)
        if len(out) > MAX_ERRORS:
            out[MAX_ERRORS:] = [f"{shown}: ... and {len(out) - MAX_ERRORS} more problems"]
        raise StackFileError(out)
    assert spec is not None
    return spec


def _files(spec: StackSpec) -> tuple[StackSpec, list[tuple[int, str]]]:
    """Each unit's ``env_file`` read into it, and its ``cwd`` checked (both relative to
    the stack file); the spec with the files' variables, and the problems found."""
    errors: list[tuple[int, str]] = []
    units = dict(spec.units)
    for name, unit in spec.units.items():
        if unit.env_file is not None:
            loc = ("units", name, "env_file")
            path = os.path.join(spec.stack_dir, unit.env_file)
            found, problems = dotenv.read(path, unit.env_file)
            errors.extend((line_of(spec.lines, loc), f"{dotted(loc)}: {m}") for m in problems)
            units[name] = dataclasses.replace(unit, file_env=found)
        if unit.cwd is not None and not any(True for _ in placeholders.uses(unit.cwd)):
            cwd = os.path.join(spec.stack_dir, unit.cwd)
            if not os.path.isdir(cwd):
                loc = ("units", name, "cwd")
                where = "" if os.path.isabs(unit.cwd) else f" (in {spec.stack_dir})"
                errors.append(
                    (
                        line_of(spec.lines, loc),
                        f"{dotted(loc)}: {unit.cwd!r} is not a directory{where}",
                    )
                )
    return dataclasses.replace(spec, units=units), errors


def _plain(
    node: Any, path: Path, lines: dict[Path, int], shown: str, errors: list[tuple[int, str]]
) -> Any:
    """The composed YAML as plain data, recording each key's line in ``lines``.

    The reader bounded the depth and the size with aliases expanded, and
    refused duplicate and non-scalar keys, so this recursion is bounded.
    """
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for knode, vnode in node.value:
            key = str(knode.value)
            lines[(*path, key)] = knode.start_mark.line + 1
            out[key] = _plain(vnode, (*path, key), lines, shown, errors)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_plain(v, (*path, i), lines, shown, errors) for i, v in enumerate(node.value)]
    value = scalar_value(node)
    if not _as_written(path):
        return value
    if isinstance(value, bool) or value is None:
        # `yes`, `off`, `~` or nothing where text was meant: refused by name.
        return YamlWord(str(node.value), value)
    if isinstance(value, (int, float)):
        # A number in a command or a variable is the text written: YAML 1.1
        # would make `010` 8, `1:30` 90 and `1_000` 1000.
        return str(node.value)
    return value


def _as_written(path: Path) -> bool:
    """Is ``path`` an argument of a command or a variable's value (see :func:`_arg`)?"""
    if len(path) < 4 or path[0] != "units":
        return False
    return (len(path) == 4 and path[2] in ("cmd", "env")) or (
        len(path) == 5 and path[2] in ("ready", "liveness") and path[3] == "exec"
    )
