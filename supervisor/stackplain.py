"""The quick path of :func:`supervisor.stackfile.load`: a valid stack file's spec
without pydantic.

Importing pydantic and building the models' schemas costs about 80 ms of every
``hold up`` and ``hold validate``; reading a file with them, about 1 ms. So the
plain data is first read here, key by key, with the models' own value readers
(:mod:`supervisor.stackvalues`), defaults and rules (unknown keys, required
keys, nullable keys, ``after`` in either form, ``scratch: true``, one probe
kind, a task argument's bounds). A file that passes becomes its spec at once.

This path only ever *accepts*: at the first thing that is not plainly valid it
gives up (None), and :mod:`supervisor.stackmodels` reads the whole file again,
so every refusal is still found and worded by the models, all at once, with its
``FILE:LINE``. Where in doubt (a shape pydantic might coerce), it gives up too.
tests/test_stackplain.py checks it against the models: the same spec for every
file they accept, and None for every file they refuse.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from supervisor import stackspec as ss
from supervisor import stackvalues as sv
from supervisor.stackspec import LIVENESS_KINDS, READY_KINDS, Path, StackSpec


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
    sv.arg_fits(kw["type"], kw["min"], kw["max"], kw["max_len"], kw["choices"])
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
    "device": (sv.text, _REQUIRED),
    "ttl": (_nullable(sv.duration), None),
    "label": (_nullable(sv.text), None),
}
_PROBE = {
    "http": (_nullable(sv.http_path), None),
    "tcp": (_nullable(sv.tcp_port), None),
    "exec": (_nullable(sv.exec_argv), None),
    "file": (_nullable(sv.text), None),
    "timeout": (sv.duration, 60.0),
}
_READY = {**_PROBE, "log": (_nullable(sv.regex), None), "notify": (_nullable(sv.notify_flag), None)}
_LIVENESS = {
    **_PROBE,
    "period": (sv.duration, 10.0),
    "timeout": (sv.duration, 5.0),
    "failures": (sv.positive, 3),
}
_RESTART = {
    "policy": (sv.policy, "no"),
    "max": (sv.count, 3),
    "backoff": (sv.grace, 1.0),
    "max_backoff": (sv.grace, 30.0),
    "reset_after": (sv.duration, 30.0),
}
_STOP = {"signal": (sv.stop_signal, ss.StopSpec.signal), "grace": (sv.grace, 10.0)}
_SCRATCH = {"keep": (sv.flag, False), "min_free": (_nullable(sv.size), None)}
_ARG = {
    "type": (sv.arg_type, _REQUIRED),
    "min": (_nullable(sv.number), None),
    "max": (_nullable(sv.number), None),
    "max_len": (_nullable(sv.count), None),
    "choices": (_nullable(sv.choices), None),
    "required": (sv.flag, False),
}
_UNIT: dict[str, tuple[Read, Any]] = {
    "kind": (sv.kind, "service"),
    "cmd": (_items(sv.arg, at_least=1), _REQUIRED),
    "cwd": (_nullable(sv.path_text), None),
    "port": (_nullable(sv.port), None),
    "cpus": (_nullable(sv.cpus), None),
    "env": (_mapping(sv.env_name, sv.arg), dict),
    "env_file": (_nullable(sv.path_text), None),
    "pass_env": (_items(sv.env_name), ()),
    "ready": (_nullable(_model(_one_kind(READY_KINDS, ss.ReadySpec), _READY)), None),
    "liveness": (_nullable(_model(_one_kind(LIVENESS_KINDS, ss.LivenessSpec), _LIVENESS)), None),
    "restart": (_model(ss.RestartSpec, _RESTART), ss.RestartSpec),
    "stop": (_model(ss.StopSpec, _STOP), ss.StopSpec),
    "after": (_items(sv.text), ()),
    "essential": (sv.flag, True),
    "scratch": (_nullable(_model(ss.ScratchSpec, _SCRATCH)), None),
    "timeout": (_nullable(sv.duration), None),
    "concurrency": (_nullable(sv.positive), None),
    "args": (_nullable(_mapping(sv.arg_name, _model(_arg_spec, _ARG))), None),
}
_STACK: dict[str, tuple[Read, Any]] = {
    "name": (sv.stack_name, _REQUIRED),
    "hold": (_nullable(_model(ss.HoldSpec, _HOLD)), None),
    "units": (_mapping(_name, _unit), _REQUIRED),
}
