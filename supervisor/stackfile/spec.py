"""A stack as the supervisor runs it: plain frozen dataclasses, no YAML.

:func:`hold_supervisor.stackfile.load.load` reads and checks a file with the tables of
:mod:`hold_supervisor.stackfile.schema` and gives these (their field defaults are
the keys' defaults). They also travel as JSON
(:func:`to_json` / :func:`from_json`): ``hold up --detach`` hands the resolved
stack to its background supervisor, which then needs neither the YAML reader
nor the schema in memory.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

READY_KINDS = ("http", "tcp", "log", "exec", "file", "notify")
LIVENESS_KINDS = ("http", "tcp", "exec", "file")

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class HoldSpec:
    """The ticket the whole stack runs in (checked further by :mod:`hold`)."""

    device: str
    ttl: float | None = None
    label: str | None = None


@dataclass(frozen=True)
class ReadySpec:
    """How a unit proves it is ready: exactly one kind, within ``timeout``."""

    http: str | None = None
    tcp: str | None = None
    log: re.Pattern[str] | None = None
    exec: tuple[str, ...] | None = None
    file: str | None = None
    notify: bool | None = None
    timeout: float = 60.0

    @property
    def kind(self) -> str:
        return next(k for k in READY_KINDS if getattr(self, k) is not None)

    def describe(self) -> str:
        kind = self.kind
        value = getattr(self, kind)
        if kind == "log":
            value = value.pattern
        elif kind == "exec":
            value = " ".join(value)
        elif kind == "notify":
            return "notify READY=1"
        return f"{kind} {value}"


@dataclass(frozen=True)
class LivenessSpec:
    """A periodic check that the unit still works (after it was first ready):
    every ``period``, within ``timeout``; ``failures`` in a row stop the unit."""

    http: str | None = None
    tcp: str | None = None
    exec: tuple[str, ...] | None = None
    file: str | None = None
    period: float = 10.0
    timeout: float = 5.0
    failures: int = 3

    @property
    def kind(self) -> str:
        return next(k for k in LIVENESS_KINDS if getattr(self, k) is not None)

    def as_probe(self) -> ReadySpec:
        """The same check as a readiness probe (one probe engine for both)."""
        return ReadySpec(**{self.kind: getattr(self, self.kind)}, timeout=self.timeout)


@dataclass(frozen=True)
class RestartSpec:
    """Restart policy: ``max`` restarts in a row, waiting ``backoff`` doubled each time
    up to ``max_backoff``; the count starts again once the unit stayed up ``reset_after``."""

    policy: str = "no"
    max: int = 3
    backoff: float = 1.0
    max_backoff: float = 30.0
    reset_after: float = 30.0


@dataclass(frozen=True)
class StopSpec:
    signal: int = int(signal.SIGTERM)
    grace: float = 10.0


@dataclass(frozen=True)
class ScratchSpec:
    """A private directory for one run (``HOLD_SCRATCH``, ``{scratch}``), removed after it
    unless ``keep``; ``min_free``: refuse to start with less free space than this."""

    keep: bool = False
    min_free: int | None = None


def short(value: object) -> str:
    """``value`` as written in a message, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class ArgSpec:
    """One argument a call of a task unit may pass: its type and bounds.

    ``min``/``max`` (inclusive) for ``int`` and ``float``, ``max_len`` (in
    characters) for ``str``, ``choices`` for any type; ``required``: a call
    without it is refused.
    """

    type: str
    min: int | float | None = None
    max: int | float | None = None
    max_len: int | None = None
    choices: tuple[Any, ...] | None = None
    required: bool = False

    def accepted(self) -> str:
        """What a value must be, in words (``an int from 1 to 1000``)."""
        t = self.type
        what = {"int": "an int", "float": "a number", "str": "a string", "bool": "true or false"}[t]
        if self.choices is not None:
            return f"{what}, one of " + ", ".join(short(c) for c in self.choices)
        if self.min is not None and self.max is not None:
            return f"{what} from {self.min!r} to {self.max!r}"
        if self.min is not None:
            return f"{what}, at least {self.min!r}"
        if self.max is not None:
            return f"{what}, at most {self.max!r}"
        if self.max_len is not None:
            return f"{what} of at most {self.max_len} characters"
        return what

    def problem(self, value: object) -> str | None:
        """None if a call may pass ``value`` (as JSON decoded it); else what is accepted.

        Types are exact: ``true`` is no int, ``3.0`` is no int, and a string is
        never converted (see :func:`hold_supervisor.task.args.parse_text_arg` for text).
        """
        if not _of_type(self.type, value):
            return self.accepted()
        if self.choices is not None and not any(
            (type(c) is type(value) or (self.type == "float" and not isinstance(c, bool)))
            and c == value
            for c in self.choices
        ):
            return self.accepted()
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and (
            (self.min is not None and value < self.min)  # type: ignore[operator]
            or (self.max is not None and value > self.max)  # type: ignore[operator]
        ):
            return self.accepted()
        if isinstance(value, str) and self.max_len is not None and len(value) > self.max_len:
            return f"{self.accepted()} (this one has {len(value)})"
        return None


def _of_type(t: str, value: object) -> bool:
    if t == "bool":
        return isinstance(value, bool)
    if t == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "float":
        return (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and value == value
            and abs(value) != float("inf")
        )
    return isinstance(value, str)


@dataclass(frozen=True)
class UnitSpec:
    """One unit, as written; placeholders are filled at start
    (:mod:`hold_supervisor.stackfile.placeholders`).

    ``kind``: ``service`` (started by ``hold up``, supervised), ``oneshot`` (run
    once by ``hold up``, in order; what waits for it starts when it exited 0) or
    ``task`` (run once per call, see :mod:`hold_supervisor.task.task`). ``after``: the
    names it waits for; ``conditions``: for each name given one, ``started``,
    ``ready`` or ``completed``. ``file_env``: the variables of ``env_file``
    (literal values; ``env`` overrides them).
    """

    cmd: tuple[str, ...]
    kind: str = "service"
    cwd: str | None = None
    port: int | str | None = None
    cpus: frozenset[int] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    env_file: str | None = None
    pass_env: tuple[str, ...] = ()
    ready: ReadySpec | None = None
    liveness: LivenessSpec | None = None
    restart: RestartSpec = field(default_factory=RestartSpec)
    stop: StopSpec = field(default_factory=StopSpec)
    after: tuple[str, ...] = ()
    essential: bool = True
    scratch: ScratchSpec | None = None
    timeout: float | None = None
    concurrency: int | None = None
    args: Mapping[str, ArgSpec] | None = None
    conditions: Mapping[str, str] = field(default_factory=dict)
    file_env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StackSpec:
    """A whole stack file, valid; ``path`` and ``lines`` say where each key was."""

    name: str
    units: Mapping[str, UnitSpec]
    hold: HoldSpec | None = None
    path: str = ""  # the file as it was named to load()
    lines: Mapping[Path, int] = field(default_factory=dict)

    @property
    def stack_dir(self) -> str:
        """The directory of the stack file: each unit's default ``cwd``, ``{stack_dir}``."""
        return os.path.dirname(os.path.abspath(self.path))

    def where(self, *keys: str | int) -> str:
        """``FILE:LINE: key.path`` for a message about ``keys`` (e.g. ``"hold", "device"``)."""
        return f"{self.path}:{line_of(self.lines, keys)}: {dotted(keys)}"

    def condition(self, unit: str, dep: str) -> str:
        """What ``unit`` waits for in ``dep``: ``started``, ``ready`` or ``completed``."""
        given = self.units[unit].conditions.get(dep)
        if given is not None:
            return given
        return "completed" if self.units[dep].kind == "oneshot" else "ready"

    def order(self) -> list[str]:
        """Every unit name in an order that respects ``after`` (file order among equals)."""
        done: list[str] = []
        pending = list(self.units)
        while pending:
            for name in pending:
                if all(d in done for d in self.units[name].after):
                    done.append(name)
                    pending.remove(name)
                    break
            else:  # validated: cannot happen
                raise AssertionError(f"cycle among {pending}")
        return done

    def services(self) -> list[str]:
        """What ``hold up`` starts (services and one-shots) in start order."""
        return [n for n in self.order() if self.units[n].kind != "task"]

    def tasks(self) -> list[str]:
        return [n for n, u in self.units.items() if u.kind == "task"]


def fill(
    text: str,
    *,
    unit: str,
    ports: Mapping[str, int],
    run_dir: str,
    stack_dir: str = "",
    scratch: str = "",
) -> str:
    """``text`` with this project's placeholders filled in for ``unit``
    (validated already: every name is known and every port assigned). Here, with
    the specs: a running stack fills its units' strings without the validators."""
    # lazy: off hold down NAME, which imports this module
    from hold_supervisor.stackfile import placeholders

    values = {"run_dir": run_dir, "stack_dir": stack_dir, "scratch": scratch}
    if unit in ports:
        values["port"] = str(ports[unit])
    return placeholders.fill(text, values, ports)


def filled_env(
    spec: UnitSpec,
    unit: str,
    ports: Mapping[str, int],
    run_dir: str,
    stack_dir: str = "",
    scratch: str = "",
) -> dict[str, str]:
    """The unit's own variables: its ``env_file`` (as written), then ``env`` (filled)."""
    out = dict(spec.file_env)
    for k, v in spec.env.items():
        out[k] = fill(
            v, unit=unit, ports=ports, run_dir=run_dir, stack_dir=stack_dir, scratch=scratch
        )
    return out


def dotted(loc: tuple[Any, ...]) -> str:
    """``units.a.cmd[2]`` for the key path ``("units", "a", "cmd", 2)``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def line_of(lines: Mapping[Path, int], loc: tuple[Any, ...]) -> int:
    """The line of ``loc``, or of its nearest parent that has one."""
    loc = tuple(loc)
    while loc and loc not in lines:
        loc = loc[:-1]
    return lines.get(loc, 1)


# ---------------------------------------------------------------------- as JSON

_NESTED: dict[str, Any] = {
    "ready": ReadySpec,
    "liveness": LivenessSpec,
    "restart": RestartSpec,
    "stop": StopSpec,
    "scratch": ScratchSpec,
}


def to_json(spec: StackSpec) -> dict[str, Any]:
    """The resolved stack as plain JSON data (:func:`from_json` gives it back)."""
    return {
        "name": spec.name,
        "path": spec.path,
        "hold": plain(spec.hold) if spec.hold else None,
        "units": {n: plain(u) for n, u in spec.units.items()},
        "lines": [[list(k), v] for k, v in spec.lines.items()],
    }


def plain(obj: Any) -> Any:
    """A spec (or any value in one) as plain JSON data."""
    if hasattr(obj, "__dataclass_fields__"):
        return {f.name: plain(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, re.Pattern):
        return obj.pattern
    if isinstance(obj, frozenset):
        return sorted(obj)
    if isinstance(obj, (tuple, list)):
        return [plain(x) for x in obj]
    if isinstance(obj, Mapping):
        return {k: plain(v) for k, v in obj.items()}
    return obj


def from_json(data: Mapping[str, Any]) -> StackSpec:
    """A stack from :func:`to_json`'s data (made by us: trusted, not re-validated)."""
    hold = HoldSpec(**data["hold"]) if data.get("hold") else None
    units = {n: _unit(u) for n, u in data["units"].items()}
    lines = {tuple(k): v for k, v in data.get("lines", [])}
    return StackSpec(data["name"], units, hold, data.get("path", ""), lines)


def _unit(d: Mapping[str, Any]) -> UnitSpec:
    kw: dict[str, Any] = dict(d)
    for key, cls in _NESTED.items():
        if kw.get(key) is not None:
            kw[key] = cls(**_tuples(kw[key]))
    if kw.get("ready") is not None and kw["ready"].log is not None:
        kw["ready"] = ReadySpec(**{**_fields(kw["ready"]), "log": re.compile(kw["ready"].log)})
    kw["cmd"] = tuple(kw["cmd"])
    kw["pass_env"] = tuple(kw.get("pass_env", ()))
    kw["after"] = tuple(kw.get("after", ()))
    if kw.get("cpus") is not None:
        kw["cpus"] = frozenset(kw["cpus"])
    if kw.get("args") is not None:
        kw["args"] = {k: ArgSpec(**_tuples(a)) for k, a in kw["args"].items()}
    return UnitSpec(**kw)


def _tuples(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}


def _fields(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in fields(obj)}
