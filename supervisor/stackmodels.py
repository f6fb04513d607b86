"""The stack file's models: what each key means and what it takes.

Values are read by :mod:`supervisor.stackvalues`; checks that span units
(dependencies, placeholders, ports, what each kind takes) are
:mod:`supervisor.stackchecks`; :mod:`supervisor.stackfile` loads a file into
these.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from supervisor.stackvalues import (
    Arg,
    ArgName,
    ArgType,
    Choices,
    Count,
    Cpus,
    Duration,
    EnvName,
    ExecArgv,
    Flag,
    Grace,
    HttpPath,
    Kind,
    NotifyFlag,
    Number,
    PathText,
    Policy,
    Port,
    Positive,
    Regex,
    Signal,
    Size,
    StackName,
    TcpPort,
    Text,
    short,
)

READY_KINDS = ("http", "tcp", "log", "exec", "file", "notify")
LIVENESS_KINDS = ("http", "tcp", "exec", "file")

Path = tuple[str | int, ...]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)


class HoldSpec(_Strict):
    """The ticket the whole stack runs in (checked further by :mod:`hold`)."""

    device: Text
    ttl: Duration | None = None
    label: Text | None = None


class ReadySpec(_Strict):
    """How a unit proves it is ready: exactly one kind, within ``timeout``."""

    http: HttpPath | None = None
    tcp: TcpPort | None = None
    log: Regex | None = None
    exec: ExecArgv | None = None
    file: Text | None = None
    notify: NotifyFlag | None = None
    timeout: Duration = 60.0

    @model_validator(mode="after")
    def _one_kind(self) -> ReadySpec:
        given = [k for k in READY_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"exactly one of {', '.join(READY_KINDS)} is needed"
                + (f" (got {', '.join(given)})" if given else "")
            )
        return self

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


class RestartSpec(_Strict):
    """Restart policy: ``max`` restarts in a row, waiting ``backoff`` doubled each time
    up to ``max_backoff``; the count starts again once the unit stayed up ``reset_after``."""

    policy: Policy = "no"
    max: Count = 3
    backoff: Grace = 1.0
    max_backoff: Grace = 30.0
    reset_after: Duration = 30.0


class StopSpec(_Strict):
    signal: Signal = int(signal.SIGTERM)
    grace: Grace = 10.0


class ArgSpec(_Strict):
    """One argument a call of a task unit may pass: its type and bounds.

    ``min``/``max`` (inclusive) for ``int`` and ``float``, ``max_len`` (in
    characters) for ``str``, ``choices`` for any type; ``required``: a call
    without it is refused.
    """

    type: ArgType
    min: Number | None = None
    max: Number | None = None
    max_len: Count | None = None
    choices: Choices | None = None
    required: Flag = False

    @model_validator(mode="after")
    def _fits_type(self) -> ArgSpec:
        t = self.type
        if t not in ("int", "float") and (self.min is not None or self.max is not None):
            raise ValueError(f"min and max are for int and float arguments, not {t}")
        if t == "int":
            for key in ("min", "max"):
                bound = getattr(self, key)
                if bound is not None and not isinstance(bound, int):
                    raise ValueError(f"{key} {bound!r} is not valid: a whole number for an int")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min!r} is more than max {self.max!r}")
        if self.max_len is not None and t != "str":
            raise ValueError(f"max_len is for str arguments, not {t}")
        if self.choices is not None:
            unbounded = self.model_copy(update={"choices": None})
            for c in self.choices:
                if unbounded.problem(c) is not None:
                    raise ValueError(f"choice {c!r} is not valid: {unbounded.accepted()}")
        return self

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
        never converted (see :func:`supervisor.task.parse_text_arg` for text).
        """
        t = self.type
        if t == "bool":
            ok = isinstance(value, bool)
        elif t == "int":
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif t == "float":
            ok = (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and value == value
                and abs(value) != float("inf")
            )
        else:
            ok = isinstance(value, str)
        if not ok:
            return self.accepted()
        if self.choices is not None and not any(
            (type(c) is type(value) or (t == "float" and not isinstance(c, bool))) and c == value
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


class LivenessSpec(_Strict):
    """A periodic check that the unit still works (after it was first ready).

    Every ``period`` the probe runs, given ``timeout``; after ``failures``
    failures in a row the unit is stopped and its restart policy decides.
    """

    http: HttpPath | None = None
    tcp: TcpPort | None = None
    exec: ExecArgv | None = None
    file: Text | None = None
    period: Duration = 10.0
    timeout: Duration = 5.0
    failures: Positive = 3

    @model_validator(mode="after")
    def _one_kind(self) -> LivenessSpec:
        given = [k for k in LIVENESS_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"exactly one of {', '.join(LIVENESS_KINDS)} is needed"
                + (f" (got {', '.join(given)})" if given else "")
            )
        return self

    @property
    def kind(self) -> str:
        return next(k for k in LIVENESS_KINDS if getattr(self, k) is not None)

    def as_probe(self) -> ReadySpec:
        """The same check as a readiness probe (one probe engine for both)."""
        # Validated already, as this model's fields: no second reading.
        return ReadySpec.model_construct(
            **{self.kind: getattr(self, self.kind), "timeout": self.timeout}
        )


class ScratchSpec(_Strict):
    """A private directory for one run (``HOLD_SCRATCH``, ``{scratch}``), removed after it
    unless ``keep``; ``min_free``: refuse to start with less free space than this."""

    keep: Flag = False
    min_free: Size | None = None


class UnitSpec(_Strict):
    """One unit, as written; placeholders are filled at start (:mod:`supervisor.placeholders`).

    ``kind``: ``service`` (started by ``hold up``, supervised), ``oneshot`` (run
    once by ``hold up``, in order; what waits for it starts when it exited 0) or
    ``task`` (run once per call, see :mod:`supervisor.task`). The keys each kind
    takes are checked with their lines by :mod:`supervisor.stackchecks`.
    ``after``: names (wait until ready, or until completed for a oneshot) or a
    mapping of name to condition (``started``, ``ready``, ``completed``).
    """

    kind: Kind = "service"
    cmd: Annotated[tuple[Arg, ...], Field(min_length=1)]
    cwd: PathText | None = None
    port: Port | None = None
    cpus: Cpus | None = None
    env: dict[EnvName, Arg] = Field(default_factory=dict)
    env_file: PathText | None = None
    pass_env: tuple[EnvName, ...] = ()
    ready: ReadySpec | None = None
    liveness: LivenessSpec | None = None
    restart: RestartSpec = Field(default_factory=RestartSpec)
    stop: StopSpec = Field(default_factory=StopSpec)
    after: tuple[Text, ...] = ()
    essential: Flag = True
    scratch: ScratchSpec | None = None
    timeout: Duration | None = None
    concurrency: Positive | None = None
    args: dict[ArgName, ArgSpec] | None = None
    _conditions: dict[str, str] = PrivateAttr(default_factory=dict)
    _file_env: dict[str, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _after_forms(cls, data: Any, handler: Any) -> UnitSpec:
        # `after` is a list of names or a mapping name -> condition; the model
        # keeps the names in order and the conditions apart (checked, with
        # their lines, by stackchecks).
        conditions: dict[str, str] = {}
        if isinstance(data, dict) and isinstance(data.get("after"), dict):
            conditions = {k: v for k, v in data["after"].items() if isinstance(v, str)}
            data = {**data, "after": list(data["after"])}
        # `scratch: true` is `scratch: {}`; `scratch: false` is none.
        if isinstance(data, dict) and isinstance(data.get("scratch"), bool):
            data = {**data, "scratch": {} if data["scratch"] else None}
        unit: UnitSpec = handler(data)
        unit._conditions = conditions
        return unit

    @property
    def file_env(self) -> Mapping[str, str]:
        """The variables of ``env_file`` (literal values; ``env`` overrides them)."""
        return self._file_env


class StackSpec(_Strict):
    """A whole stack file, valid; ``path`` and ``lines`` say where each key was."""

    name: StackName
    hold: HoldSpec | None = None
    units: dict[str, UnitSpec]
    _path: str = PrivateAttr("")
    _lines: dict[Path, int] = PrivateAttr(default_factory=dict)

    @property
    def path(self) -> str:
        """The file as it was named to :func:`supervisor.stackfile.load`."""
        return self._path

    @property
    def stack_dir(self) -> str:
        """The directory of the stack file: each unit's default ``cwd``, ``{stack_dir}``."""
        return os.path.dirname(os.path.abspath(self._path))

    def where(self, *keys: str | int) -> str:
        """``FILE:LINE: key.path`` for a message about ``keys`` (e.g. ``"hold", "device"``)."""
        return f"{self._path}:{line_of(self._lines, keys)}: {dotted(keys)}"

    def condition(self, unit: str, dep: str) -> str:
        """What ``unit`` waits for in ``dep``: ``started``, ``ready`` or ``completed``."""
        given = self.units[unit]._conditions.get(dep)
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
