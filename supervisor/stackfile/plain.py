"""The quick path of :func:`hold_supervisor.stackfile.load.load`: a valid stack file's spec
without pydantic.

Importing pydantic and building the models' schemas costs about 80 ms of every
``hold up`` and ``hold validate``; reading a file with them, about 1 ms. So the
plain data is first read here, key by key, with the models' own value readers
(:mod:`hold_supervisor.stackfile.values`), defaults and rules (unknown keys, required
keys, nullable keys, ``after`` in either form, ``scratch: true``, one probe
kind, a task argument's bounds). A file that passes becomes its spec at once.

This path only ever *accepts*: at the first thing that is not plainly valid it
gives up (None), and :mod:`hold_supervisor.stackfile.models` reads the whole file again,
so every refusal is still found and worded by the models, all at once, with its
``FILE:LINE``. Where in doubt (a shape pydantic might coerce), it gives up too.
tests/test_stackplain.py checks it against the models: the same spec for every
file they accept, and None for every file they refuse.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hold_supervisor.stackfile import spec as ss
from hold_supervisor.stackfile import values
from hold_supervisor.stackfile.spec import LIVENESS_KINDS, READY_KINDS, Path, StackSpec


class GiveUp(Exception):
    """Not plainly valid: the models decide, and word the refusal."""


Read = Callable[[Any], Any]
_REQUIRED = object()


def to_spec(data: dict[str, Any], path: str, lines: Mapping[Path, int]) -> StackSpec | None:
    """The spec of ``data`` (a stack file's plain data), or None: let the models read it."""
    try:
        fields = _fields(data, _STACK)
    except Exception:  # GiveUp, a reader's ValueError, or anything else: the models decide
        return None
    return StackSpec(fields["name"], fields["units"], fields["hold"], path, lines)


def _fields(data: object, table: Mapping[str, tuple[Read, Any]]) -> dict[str, Any]:
    """A model's keys: no unknown key, each read, the default where it is absent."""
    if not isinstance(data, dict) or not all(isinstance(k, str) and k in table for k in data):
        raise GiveUp
    out: dict[str, Any] = {}
    for key, (read, default) in table.items():
        if key in data:
            out[key] = read(data[key])
        elif default is _REQUIRED:
            raise GiveUp
        else:
            out[key] = default() if callable(default) else default
    return out


def _nullable(read: Read) -> Read:
    """``X | None``: an explicit null (``key: ~``) is as good as absent."""
    return lambda value: None if value is None else read(value)


def _items(read: Read, at_least: int = 0) -> Read:
    """``tuple[X, ...]`` from a YAML list (any other shape: the models decide)."""

    def items(value: Any) -> tuple[Any, ...]:
        if not isinstance(value, list) or len(value) < at_least:
            raise GiveUp
        return tuple(read(x) for x in value)

    return items


def _mapping(key: Read, read: Read) -> Read:
    """``dict[K, X]`` from a YAML mapping, keys read too."""

    def mapping(value: Any) -> dict[Any, Any]:
        if not isinstance(value, dict):
            raise GiveUp
        out = {key(k): read(x) for k, x in value.items()}
        if len(out) != len(value):  # two keys read as one
            raise GiveUp
        return out

    return mapping


def _model(make: Callable[..., Any], table: Mapping[str, tuple[Read, Any]]) -> Read:
    return lambda value: make(**_fields(value, table))


def _one_kind(kinds: tuple[str, ...], make: Callable[..., Any]) -> Callable[..., Any]:
    """A probe: exactly one of ``kinds`` given."""

    def build(**kw: Any) -> Any:
        if sum(1 for k in kinds if kw[k] is not None) != 1:
            raise GiveUp
        return make(**kw)

    return build


def _arg_spec(**kw: Any) -> ss.ArgSpec:
    values.arg_fits(kw["type"], kw["min"], kw["max"], kw["max_len"], kw["choices"])
    return ss.ArgSpec(**kw)


def _name(value: Any) -> str:
    if not isinstance(value, str):
        raise GiveUp
    return value


def _unit(value: Any) -> ss.UnitSpec:
    """A unit, with ``after`` as a list or a mapping (its conditions kept apart) and
    ``scratch: true`` / ``false`` as ``{}`` / none, as the model reads them."""
    if not isinstance(value, dict):
        raise GiveUp
    conditions: dict[str, str] = {}
    if isinstance(value.get("after"), dict):
        conditions = {k: c for k, c in value["after"].items() if isinstance(c, str)}
        value = {**value, "after": list(value["after"])}
    if isinstance(value.get("scratch"), bool):
        value = {**value, "scratch": {} if value["scratch"] else None}
    return ss.UnitSpec(**_fields(value, _UNIT), conditions=conditions)


_HOLD = {
    "device": (values.text, _REQUIRED),
    "ttl": (_nullable(values.duration), None),
    "label": (_nullable(values.text), None),
}
_PROBE = {
    "http": (_nullable(values.http_path), None),
    "tcp": (_nullable(values.tcp_port), None),
    "exec": (_nullable(values.exec_argv), None),
    "file": (_nullable(values.text), None),
    "timeout": (values.duration, 60.0),
}
_READY = {
    **_PROBE,
    "log": (_nullable(values.regex), None),
    "notify": (_nullable(values.notify_flag), None),
}
_LIVENESS = {
    **_PROBE,
    "period": (values.duration, 10.0),
    "timeout": (values.duration, 5.0),
    "failures": (values.positive, 3),
}
_RESTART = {
    "policy": (values.policy, "no"),
    "max": (values.count, 3),
    "backoff": (values.grace, 1.0),
    "max_backoff": (values.grace, 30.0),
    "reset_after": (values.duration, 30.0),
}
_STOP = {"signal": (values.stop_signal, ss.StopSpec.signal), "grace": (values.grace, 10.0)}
_SCRATCH = {"keep": (values.flag, False), "min_free": (_nullable(values.size), None)}
_ARG = {
    "type": (values.arg_type, _REQUIRED),
    "min": (_nullable(values.number), None),
    "max": (_nullable(values.number), None),
    "max_len": (_nullable(values.count), None),
    "choices": (_nullable(values.choices), None),
    "required": (values.flag, False),
}
_UNIT: dict[str, tuple[Read, Any]] = {
    "kind": (values.kind, "service"),
    "cmd": (_items(values.arg, at_least=1), _REQUIRED),
    "cwd": (_nullable(values.path_text), None),
    "port": (_nullable(values.port), None),
    "cpus": (_nullable(values.cpus), None),
    "env": (_mapping(values.env_name, values.arg), dict),
    "env_file": (_nullable(values.path_text), None),
    "pass_env": (_items(values.env_name), ()),
    "ready": (_nullable(_model(_one_kind(READY_KINDS, ss.ReadySpec), _READY)), None),
    "liveness": (_nullable(_model(_one_kind(LIVENESS_KINDS, ss.LivenessSpec), _LIVENESS)), None),
    "restart": (_model(ss.RestartSpec, _RESTART), ss.RestartSpec),
    "stop": (_model(ss.StopSpec, _STOP), ss.StopSpec),
    "after": (_items(values.text), ()),
    "essential": (values.flag, True),
    "scratch": (_nullable(_model(ss.ScratchSpec, _SCRATCH)), None),
    "timeout": (_nullable(values.duration), None),
    "concurrency": (_nullable(values.positive), None),
    "args": (_nullable(_mapping(values.arg_name, _model(_arg_spec, _ARG))), None),
}
_STACK: dict[str, tuple[Read, Any]] = {
    "name": (values.stack_name, _REQUIRED),
    "hold": (_nullable(_model(ss.HoldSpec, _HOLD)), None),
    "units": (_mapping(_name, _unit), _REQUIRED),
}
