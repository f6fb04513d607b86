"""A task call's arguments, and the refusals that come before anything starts.

A call may pass only the arguments its unit declares, of their declared type
and within their range and size: a model-supplied argument can never choose
the task's size or its CPUs. Every problem is reported at once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from hold_supervisor.errors import SupervisorError
from hold_supervisor.exitcodes import BUSY, USAGE
from hold_supervisor.stackfile.spec import ArgSpec

ARGS_LIMIT = 64 << 10  # bytes of a call's arguments, as JSON


# ---------------------------------------------------------------------- refusals


class CallRefused(SupervisorError):
    """The call was refused before anything started; ``code`` is the exit status,
    ``errors`` every reason (one line each)."""

    code = USAGE

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors
        self.exit_code = self.code


class ArgsRefused(CallRefused):
    """An argument is unknown, of the wrong type, out of range or too large (exit 2)."""

    code = USAGE


class Busy(CallRefused):
    """Every slot is taken and the caller asked not to wait (exit 75)."""

    code = BUSY


class Closed(CallRefused):
    """The runner is closing (its stack is stopping) and takes no more calls (exit 75)."""

    code = BUSY


# ---------------------------------------------------------------------- arguments

_INT = re.compile(r"[+-]?[0-9]+", re.ASCII)
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)


def parse_text_arg(spec: ArgSpec, text: str) -> object:
    """A value given as text (``hold call --arg KEY=VALUE``) read as ``spec``'s type.

    ``int``: decimal digits; ``float``: a decimal number (no nan/inf); ``bool``:
    ``true`` or ``false``; ``str``: the text as it is. Raises ``ValueError``
    naming what is accepted; the value's range is checked afterwards.
    """
    t = spec.type
    if t == "str":
        return text
    if t == "bool":
        if text in ("true", "false"):
            return text == "true"
    elif t == "int":
        if _INT.fullmatch(text):
            return int(text)
    elif _FLOAT.fullmatch(text):
        return float(text)
    raise ValueError(spec.accepted())


def check_args(
    unit: str,
    specs: Mapping[str, ArgSpec],
    args: object,
    text_args: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The call's arguments, checked against the unit's ``args``; raises
    :class:`ArgsRefused` with every problem.

    ``args`` is what JSON gave (a mapping of exact types); ``text_args`` are
    values given as text, read by their declared type (:func:`parse_text_arg`).
    A name in both is refused: which one was meant is not for us to guess.
    """
    errors: list[str] = []
    accepted = ", ".join(sorted(specs)) or "none: this task takes no arguments"
    if not isinstance(args, Mapping):
        raise ArgsRefused([f"arguments {_short(args)} are not valid: a JSON object"])
    out: dict[str, Any] = {}
    for key, value in args.items():
        if not isinstance(key, str):
            errors.append(f"argument name {key!r} is not valid: a string")
            continue
        out[key] = value
    for key, text in (text_args or {}).items():
        spec = specs.get(key)
        if key in out:
            errors.append(f"argument {key!r} is given twice (as JSON and as text)")
        elif spec is None:
            out[key] = text  # reported as unknown below
        else:
            try:
                out[key] = parse_text_arg(spec, text)
            except ValueError as e:
                errors.append(f"argument {key!r}: {text!r} is not valid: {e}")
                out.pop(key, None)
    for key, value in out.items():
        spec = specs.get(key)
        if spec is None:
            errors.append(f"argument {key!r} is not accepted by task {unit} (accepted: {accepted})")
            continue
        why = spec.problem(value)
        if why is not None:
            errors.append(f"argument {key!r}: {_short(value)} is not valid: {why}")
    for key, spec in specs.items():
        if spec.required and key not in out and not any(key in e for e in errors):
            errors.append(f"argument {key!r} is required ({spec.accepted()})")
    if not errors:
        size = len(args_json(out))
        if size > ARGS_LIMIT:
            errors.append(
                f"the arguments are {size} bytes as JSON: too large (at most {ARGS_LIMIT})"
            )
    if errors:
        raise ArgsRefused(errors)
    return out


def args_json(args: Mapping[str, Any]) -> bytes:
    # Sorted, compact: the same arguments always give the same bytes (and digest).
    return json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
