"""The stack file's schema: one table of keys per mapping, and the one reader that walks it.

Each mapping of a stack file (the stack, ``hold``, a unit, its ``ready``,
``liveness``, ``restart``, ``stop``, ``scratch``, a task's argument) is a
:class:`Table`: its keys in order, each with what reads its value (a reader of
:mod:`hold_supervisor.stackfile.values`, which says what is accepted when it
refuses, or a nested :class:`Table`, :class:`ListOf` or :class:`MapOf`), the
frozen spec it becomes (:mod:`hold_supervisor.stackfile.spec`) and, for an
unknown key, the words other tools use for ours. The spec's own field defaults
are the keys' defaults: a key whose field has none is required, and a key whose
default is none may also be written null (``ready: ~``) for "none".

:func:`read` walks the tables over a file's plain data: the :class:`StackSpec`
of a valid file, or none and *every* problem at once, each with its key path
(``units.a.ready.timeout``: ``'5x' is not valid: ...``; the caller adds the line).
No pydantic (its import and models cost a refused file ~80-380 ms, see
bench/HISTORY.md): reading a file here takes about a millisecond.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from hold_supervisor.parse import did_you_mean
from hold_supervisor.stackfile import spec as ss
from hold_supervisor.stackfile import values
from hold_supervisor.stackfile.spec import LIVENESS_KINDS, READY_KINDS, Path, StackSpec
from hold_supervisor.stackfile.values import short

# (key path, message) for each problem found.
Problems = list[tuple[Path, str]]
# A value reader: the value, or ValueError saying "<value> is not valid: <accepted>".
Reader = Callable[[Any], Any]


class _Invalid:
    """What a read gives when it found problems (they are in the list already)."""


INVALID = _Invalid()


def read_value(shape: Any, value: Any, loc: Path, problems: Problems) -> Any:
    """``value`` read by ``shape`` (a table, list, mapping or value reader), or INVALID."""
    if isinstance(shape, (Table, ListOf, MapOf, Flagged)):
        return shape.read(value, loc, problems)
    try:
        return shape(value)
    except ValueError as e:
        problems.append((loc, str(e)))
        return INVALID


class ListOf:
    """A YAML list, each item read by ``item`` (its problems at ``[i]``)."""

    # Plain classes, not dataclasses: making a dataclass compiles its methods at every start.
    __slots__ = ("at_least", "item")

    def __init__(self, item: Any, at_least: int = 0) -> None:
        self.item = item
        self.at_least = at_least

    def read(self, value: Any, loc: Path, problems: Problems) -> Any:
        if not isinstance(value, list) or len(value) < self.at_least:
            # One wording for every list, as before (an empty one is fine where at_least is 0).
            problems.append((loc, f"{short(value)} is not valid: a non-empty list"))
            return INVALID
        items = [read_value(self.item, x, (*loc, i), problems) for i, x in enumerate(value)]
        return INVALID if any(x is INVALID for x in items) else tuple(items)


class MapOf:
    """A YAML mapping: each key read by ``key``, each value by ``value`` (both at ``.KEY``)."""

    __slots__ = ("key", "value")

    def __init__(self, key: Reader, value: Any) -> None:
        self.key = key
        self.value = value

    def read(self, value: Any, loc: Path, problems: Problems) -> Any:
        if not isinstance(value, dict):
            problems.append((loc, f"{short(value)} is not valid: a mapping"))
            return INVALID
        out: dict[Any, Any] = {}
        bad = False
        for k, v in value.items():
            name = read_value(self.key, k, (*loc, k), problems)
            got = read_value(self.value, v, (*loc, k), problems)
            bad = bad or name is INVALID or got is INVALID
            out[name] = got
        return INVALID if bad else out


class Flagged:
    """A table that may also be written ``true`` (all its defaults) or ``false`` (none)."""

    __slots__ = ("table",)

    def __init__(self, table: Table) -> None:
        self.table = table

    def read(self, value: Any, loc: Path, problems: Problems) -> Any:
        if isinstance(value, bool):
            return self.table.read({}, loc, problems) if value else None
        return self.table.read(value, loc, problems)


class Key:
    """One key of a table: its name, what reads its value, and (from the spec) its
    default (a factory's value; none when required) and whether ``key: ~`` is as
    good as absent (its default is none)."""

    __slots__ = ("default", "name", "nullable", "required", "shape")

    def __init__(self, name: str, shape: Any, required: bool, default: Any) -> None:
        self.name = name
        self.shape = shape
        self.required = required
        self.default = default
        self.nullable = not required and default is None


class Table:
    """A mapping of the stack file: its keys (in order) read into ``make``, a spec class.

    ``check``: a rule across the keys, run on the spec once every key was read
    (``ValueError``: the problem, at the table). ``derived``: fields of the spec
    that are no keys, computed from the mapping as written.
    ``synonyms``: for an unknown key, what users of process-compose,
    docker-compose and systemd type for ours (a close spelling is found by
    difflib).
    """

    def __init__(
        self,
        make: type[Any],
        keys: Mapping[str, Any],
        *,
        synonyms: Mapping[str, str] | None = None,
        check: Callable[[Any], None] | None = None,
        derived: Mapping[str, Callable[[dict[str, Any]], Any]] | None = None,
    ) -> None:
        self.make = make
        self.synonyms = dict(synonyms or {})
        self.check = check
        self.derived = dict(derived or {})
        fields = {f.name: f for f in dataclasses.fields(make)}
        self.keys: dict[str, Key] = {}
        for name, shape in keys.items():
            f = fields[name]
            if f.default is not dataclasses.MISSING:
                default, required = f.default, False
            elif f.default_factory is not dataclasses.MISSING:
                default, required = f.default_factory(), False
            else:
                default, required = None, True
            self.keys[name] = Key(name, shape, required, default)

    def accepted(self, unknown: str = "") -> str:
        """``accepted: a, b, c``, and a "did you mean" for the key ``unknown`` if one fits."""
        names = list(self.keys)
        hint = did_you_mean(unknown, names, self.synonyms) if unknown else ""
        return "accepted: " + ", ".join(names) + hint

    def read(self, value: Any, loc: Path, problems: Problems) -> Any:
        """The spec of the mapping ``value`` at ``loc``; INVALID if it had any problem."""
        if not isinstance(value, dict):
            problems.append((loc, f"{short(value)} is not valid: a mapping"))
            return INVALID
        found = len(problems)
        for k in value:
            if k not in self.keys:
                problems.append(((*loc, k), "unknown key; " + self.accepted(str(k))))
        kw: dict[str, Any] = {}
        for name, key in self.keys.items():
            if name not in value:
                if key.required:
                    problems.append(((*loc, name), "missing (required)"))
            elif not (key.nullable and value[name] is None):
                kw[name] = read_value(key.shape, value[name], (*loc, name), problems)
        if len(problems) > found:
            return INVALID
        for name, derive in self.derived.items():
            kw[name] = derive(value)
        made = self.make(**kw)
        if self.check is not None:
            try:
                self.check(made)
            except ValueError as e:
                problems.append((loc, str(e)))
                return INVALID
        return made

    def tables(self, loc: Path = ()) -> Iterator[tuple[Path, Table]]:
        """This table and each one below it, with its key path (``*`` for any name)."""
        yield loc, self
        for name, key in self.keys.items():
            shape, at = key.shape, (*loc, name)
            while isinstance(shape, (MapOf, ListOf, Flagged)):
                if isinstance(shape, MapOf):
                    shape, at = shape.value, (*at, "*")
                elif isinstance(shape, ListOf):
                    shape, at = shape.item, (*at, 0)
                else:
                    shape = shape.table
            if isinstance(shape, Table):
                yield from shape.tables(at)


def read(
    data: dict[str, Any], path: str, lines: Mapping[Path, int]
) -> tuple[StackSpec | None, Problems]:
    """The spec of a stack file's plain ``data`` (``path`` and ``lines`` kept in it),
    or None and every problem, ``(key path, message)``."""
    problems: Problems = []
    spec = STACK.read(data, (), problems)
    if spec is INVALID:
        return None, problems
    return dataclasses.replace(spec, path=path, lines=lines), []


# ---------------------------------------------------------------------- the rules


def _exactly_one(kinds: tuple[str, ...]) -> Callable[[Any], None]:
    """A probe: exactly one of ``kinds`` given."""

    def check(probe: Any) -> None:
        given = [k for k in kinds if getattr(probe, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"exactly one of {', '.join(kinds)} is needed"
                + (f" (got {', '.join(given)})" if given else "")
            )

    return check


def _arg_fits(a: ss.ArgSpec) -> None:
    values.arg_fits(a.type, a.min, a.max, a.max_len, a.choices)


def _after(value: Any) -> Any:
    """``after``: a list of names, or a mapping of name to condition (the names in order)."""
    return list(value) if isinstance(value, dict) else value


def _conditions(unit: dict[str, Any]) -> dict[str, str]:
    """The conditions of ``after`` written as a mapping (checked by stackfile.checks)."""
    after = unit.get("after")
    if not isinstance(after, dict):
        return {}
    return {k: c for k, c in after.items() if isinstance(c, str)}


class _AfterNames(ListOf):
    """``after`` in either form, as its names."""

    def read(self, value: Any, loc: Path, problems: Problems) -> Any:
        return super().read(_after(value), loc, problems)


def _unit_name(v: object) -> str:
    return str(v)  # checked with the other units (stackfile.checks): a unit's name


# ---------------------------------------------------------------------- the tables

HOLD = Table(
    ss.HoldSpec,
    {"device": values.text, "ttl": values.duration, "label": values.text},
    synonyms={
        "class": "device",
        "devices": "device",
        "time": "ttl",
        "timeout": "ttl",
        "duration": "ttl",
        "limit": "ttl",
        "description": "label",
        "comment": "label",
    },
)

_PROBE_SYNONYMS = {
    "http_get": "http",
    "httpget": "http",
    "path": "http",
    "url": "http",
    "tcp_socket": "tcp",
    "port": "tcp",
    "command": "exec",
    "cmd": "exec",
    "timeout_seconds": "timeout",
}

# What each probe kind reads (a probe has exactly one of its kinds).
_PROBE_KINDS: dict[str, Reader] = {
    "http": values.http_path,
    "tcp": values.tcp_port,
    "log": values.regex,
    "exec": values.exec_argv,
    "file": values.text,
    "notify": values.notify_flag,
}

READY = Table(
    ss.ReadySpec,
    {**{k: _PROBE_KINDS[k] for k in READY_KINDS}, "timeout": values.duration},
    check=_exactly_one(READY_KINDS),
    synonyms={
        **_PROBE_SYNONYMS,
        "log_line": "log",
        "log_pattern": "log",
        "pattern": "log",
        "regex": "log",
        "path_exists": "file",
        "timeoutstartsec": "timeout",
        "sd_notify": "notify",
        "type": "notify",
    },
)

LIVENESS = Table(
    ss.LivenessSpec,
    {
        **{k: _PROBE_KINDS[k] for k in LIVENESS_KINDS},
        "period": values.duration,
        "timeout": values.duration,
        "failures": values.positive,
    },
    check=_exactly_one(LIVENESS_KINDS),
    synonyms={
        **_PROBE_SYNONYMS,
        "interval": "period",
        "period_seconds": "period",
        "every": "period",
        "failure_threshold": "failures",
        "retries": "failures",
    },
)

RESTART = Table(
    ss.RestartSpec,
    {
        "policy": values.policy,
        "max": values.count,
        "backoff": values.grace,
        "max_backoff": values.grace,
        "reset_after": values.duration,
    },
    synonyms={
        "max_restarts": "max",
        "retries": "max",
        "restarts": "max",
        "backoff_seconds": "backoff",
        "restartsec": "backoff",
        "delay": "backoff",
        "restart": "policy",
        "condition": "policy",
        "mode": "policy",
    },
)

STOP = Table(
    ss.StopSpec,
    {"signal": values.stop_signal, "grace": values.grace},
    synonyms={
        "timeout": "grace",
        "timeout_seconds": "grace",
        "timeoutstopsec": "grace",
        "kill_timeout": "grace",
        "stop_grace_period": "grace",
        "grace_period": "grace",
        "killsignal": "signal",
        "stop_signal": "signal",
    },
)

SCRATCH = Table(
    ss.ScratchSpec,
    {"keep": values.flag, "min_free": values.size},
    synonyms={"keep_after": "keep", "free": "min_free", "min_space": "min_free"},
)

ARG = Table(
    ss.ArgSpec,
    {
        "type": values.arg_type,
        "min": values.number,
        "max": values.number,
        "max_len": values.count,
        "choices": values.choices,
        "required": values.flag,
    },
    check=_arg_fits,
    synonyms={
        "kind": "type",
        "minimum": "min",
        "maximum": "max",
        "maxlength": "max_len",
        "max_length": "max_len",
        "enum": "choices",
        "values": "choices",
        "mandatory": "required",
    },
)

UNIT = Table(
    ss.UnitSpec,
    {
        "kind": values.kind,
        "cmd": ListOf(values.arg, at_least=1),
        "cwd": values.path_text,
        "port": values.port,
        "cpus": values.cpus,
        "env": MapOf(values.env_name, values.arg),
        "env_file": values.path_text,
        "pass_env": ListOf(values.env_name),
        "ready": READY,
        "liveness": LIVENESS,
        "restart": RESTART,
        "stop": STOP,
        "after": _AfterNames(values.text),
        "essential": values.flag,
        "scratch": Flagged(SCRATCH),
        "timeout": values.duration,
        "concurrency": values.positive,
        "args": MapOf(values.arg_name, ARG),
    },
    derived={"conditions": _conditions},
    synonyms={
        "command": "cmd",
        "exec": "cmd",
        "execstart": "cmd",
        "exec_start": "cmd",
        "entrypoint": "cmd",
        "argv": "cmd",
        "depends_on": "after",
        "requires": "after",
        "wants": "after",
        "needs": "after",
        "dependencies": "after",
        "environment": "env",
        "envs": "env",
        "vars": "env",
        "passenvironment": "pass_env",
        "pass_environment": "pass_env",
        "inherit_env": "pass_env",
        "ports": "port",
        "readiness_probe": "ready",
        "readiness": "ready",
        "healthcheck": "ready",
        "health_check": "ready",
        "liveness_probe": "liveness",
        "livenessprobe": "liveness",
        "alive": "liveness",
        "restart_policy": "restart",
        "working_dir": "cwd",
        "working_directory": "cwd",
        "workingdirectory": "cwd",
        "workdir": "cwd",
        "directory": "cwd",
        "dir": "cwd",
        "chdir": "cwd",
        "envfile": "env_file",
        "environmentfile": "env_file",
        "environment_file": "env_file",
        "dotenv": "env_file",
        "tmpdir": "scratch",
        "tmp": "scratch",
        "scratch_dir": "scratch",
        "required": "essential",
        "critical": "essential",
        "availability": "restart",
        "stop_signal": "stop",
        "killsignal": "stop",
        "shutdown": "stop",
        "cpuset": "cpus",
        "cpu_set": "cpus",
        "cpuset_cpus": "cpus",
        "cpu": "cpus",
        "cpuaffinity": "cpus",
        "affinity": "cpus",
        "type": "kind",
        "parallelism": "concurrency",
        "max_parallel": "concurrency",
    },
)

STACK = Table(
    StackSpec,
    {"name": values.stack_name, "hold": HOLD, "units": MapOf(_unit_name, UNIT)},
    synonyms={
        "services": "units",
        "processes": "units",
        "programs": "units",
        "project": "name",
        "project_name": "name",
        "ticket": "hold",
        "lease": "hold",
        "device": "hold",
    },
)
