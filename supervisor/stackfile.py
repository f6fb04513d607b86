"""The stack file: a YAML description of units, read strictly.

:func:`load` returns a :class:`StackSpec` or raises :class:`StackFileError`
carrying *every* problem found, each as ``FILE:LINE: KEY.PATH: message``
(``stack.yaml:12: units.model.ready.timeout: '5x' is not valid: ...``).

How: the YAML is *composed* (not loaded), so every key keeps the line it came
from; the plain data is validated by pydantic models that forbid unknown keys
and parse durations and CPU lists with :mod:`supervisor.parse`; then the
checks that span units (``after`` names and cycles, placeholders, ports) run
over the same data, whether or not pydantic was happy with it, so one run
reports all errors at once.

Nothing here knows about devices or tickets: the optional ``hold:`` section is
only checked for shape; :mod:`hold` checks the device class and label, using
:meth:`StackSpec.where` for the line.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Callable, Iterator, Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    PrivateAttr,
    ValidationError,
    model_validator,
)

from supervisor.environ import check_name
from supervisor.errors import SupervisorError
from supervisor.exitcodes import USAGE
from supervisor.parse import BadValue, did_you_mean, parse_cpus, parse_duration
from supervisor.stackctl import STACK_NAME

READY_KINDS = ("http", "tcp", "log", "exec", "file")
UNIT_KINDS = ("service", "task")
ARG_TYPES = ("int", "float", "str", "bool")
# Keys that make sense for one kind only (checked in _cross_checks, with their line).
SERVICE_ONLY = ("port", "ready", "restart", "after")
TASK_ONLY = ("timeout", "concurrency", "args")
RESTART_POLICIES = ("no", "on-failure", "always")
MAX_ERRORS = 100  # listed in one refusal; the rest are counted

# For an unknown key: what users of process-compose, docker-compose and
# systemd type for ours (by model; a close spelling is found by difflib).
SYNONYMS: dict[str, dict[str, str]] = {
    "StackSpec": {
        "services": "units", "processes": "units", "programs": "units", "project": "name",
        "project_name": "name", "ticket": "hold", "lease": "hold", "device": "hold",
    },
    "UnitSpec": {
        "command": "cmd", "exec": "cmd", "execstart": "cmd", "exec_start": "cmd",
        "entrypoint": "cmd", "argv": "cmd", "depends_on": "after", "requires": "after",
        "wants": "after", "needs": "after", "dependencies": "after",
        "environment": "env", "envs": "env", "vars": "env", "passenvironment": "pass_env",
        "pass_environment": "pass_env", "inherit_env": "pass_env", "ports": "port",
        "readiness_probe": "ready", "readiness": "ready", "healthcheck": "ready",
        "health_check": "ready", "liveness_probe": "ready", "restart_policy": "restart",
        "availability": "restart", "stop_signal": "stop", "killsignal": "stop",
        "shutdown": "stop", "cpuset": "cpus", "cpu_set": "cpus", "cpuset_cpus": "cpus",
        "cpu": "cpus", "cpuaffinity": "cpus", "affinity": "cpus", "type": "kind",
        "parallelism": "concurrency", "max_parallel": "concurrency",
    },
    "ReadySpec": {
        "http_get": "http", "httpget": "http", "path": "http", "url": "http",
        "tcp_socket": "tcp", "port": "tcp", "command": "exec", "cmd": "exec",
        "log_line": "log", "log_pattern": "log", "pattern": "log", "regex": "log",
        "path_exists": "file", "timeout_seconds": "timeout", "timeoutstartsec": "timeout",
    },
    "RestartSpec": {
        "max_restarts": "max", "retries": "max", "restarts": "max", "backoff_seconds": "backoff",
        "restartsec": "backoff", "delay": "backoff", "restart": "policy", "condition": "policy",
        "mode": "policy",
    },
    "StopSpec": {
        "timeout": "grace", "timeout_seconds": "grace", "timeoutstopsec": "grace",
        "kill_timeout": "grace", "stop_grace_period": "grace", "grace_period": "grace",
        "killsignal": "signal", "stop_signal": "signal",
    },
    "HoldSpec": {
        "class": "device", "devices": "device", "time": "ttl", "timeout": "ttl",
        "duration": "ttl", "limit": "ttl", "description": "label", "comment": "label",
    },
    "ArgSpec": {
        "kind": "type", "minimum": "min", "maximum": "max", "maxlength": "max_len",
        "max_length": "max_len", "enum": "choices", "values": "choices",
        "mandatory": "required",
    },
}  # fmt: skip

_UNIT_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}", re.ASCII)
_ARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}", re.ASCII)
# {{ and }} are literal braces; {anything else} is a placeholder.
_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([^{}]*)\}")
_UNIT_PORT = re.compile(r"units\.([^.]+)\.port")
PLACEHOLDERS_ACCEPTED = "{port}, {units.NAME.port} or {run_dir} ({{ and }} for literal braces)"

Path = tuple[str | int, ...]


class StackFileError(SupervisorError):
    """The stack file is not acceptable; ``errors`` lists every problem, one line each."""

    exit_code = USAGE

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


# ------------------------------------------------------------------ values
# Each validator takes what YAML produced and raises ValueError with
# "<value> is not valid: <what is accepted>"; the key path and line are added
# by the caller from pydantic's error location.


def _bad(value: object, accepted: str) -> ValueError:
    return ValueError(f"{value!r} is not valid: {accepted}")


def _duration(allow_zero: bool) -> Any:
    def parse(v: object) -> float:
        accepted = "a duration with its unit: 250ms, 10s, 4m, 2h" + (
            "" if allow_zero else " (more than zero)"
        )
        # A plain number is refused: `-t 5` is minutes and `--grace 5` is
        # seconds on the command line, and a file should not make anyone guess.
        if not isinstance(v, str) or not re.fullmatch(r"\s*[0-9.]+\s*(ms|s|m|h|d)\s*", v):
            raise _bad(v, accepted)
        try:
            return parse_duration(v, plain_unit="seconds", allow_zero=allow_zero)
        except BadValue as e:
            raise _bad(v, e.accepted) from None

    return PlainValidator(parse)


Duration = Annotated[float, _duration(False)]
Grace = Annotated[float, _duration(True)]


def _cpus(v: object) -> frozenset[int]:
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise _bad(v, "a CPU list like 0-3,8")
    try:
        return parse_cpus(str(v))
    except BadValue as e:
        raise _bad(v, e.accepted) from None


Cpus = Annotated[frozenset[int], PlainValidator(_cpus)]


def _arg(v: object) -> str:
    # Numbers are taken as written (`--port, 8080`); a YAML boolean is refused,
    # since `yes`/`no`/`on`/`off` would silently become True/False.
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise _bad(v, "a string (quote values like yes, no, on, off)")
    s = v if isinstance(v, str) else str(v)
    if "\0" in s:
        raise _bad(v, "no NUL characters")
    return s


Arg = Annotated[str, PlainValidator(_arg)]


def _argv(v: object) -> tuple[str, ...]:
    if not isinstance(v, list) or not v:
        raise _bad(v, "a non-empty list: [program, arg, ...]")
    out: list[str] = []
    for i, item in enumerate(v):
        try:
            out.append(_arg(item))
        except ValueError as e:
            raise ValueError(f"item {i}: {e}") from None
    if not out[0]:
        raise _bad(v, "a program name first")
    return tuple(out)


def _exec_argv(v: object) -> tuple[str, ...]:
    if isinstance(v, str) and v.strip():
        return ("/bin/sh", "-c", v)
    return _argv(v)


def _env_name(v: object) -> str:
    if not isinstance(v, str):
        raise _bad(v, "a variable name")
    try:
        return check_name(v)
    except BadValue as e:
        raise _bad(v, e.accepted) from None


EnvName = Annotated[str, PlainValidator(_env_name)]


def _port(v: object) -> int | Literal["auto"]:
    if v == "auto":
        return "auto"
    if isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 65535:
        return v
    raise _bad(v, "auto (the kernel picks a free port) or a port number 1-65535")


def _signal(v: object) -> int:
    accepted = "a signal name or number such as TERM, INT, HUP, QUIT, USR1 (not KILL or STOP)"
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise _bad(v, accepted)
    name = str(v).upper().removeprefix("SIG")
    if name.isdigit():
        num = int(name)
        if num in signal.valid_signals() and num not in (0, signal.SIGKILL, signal.SIGSTOP):
            return num
        raise _bad(v, accepted)
    sig = getattr(signal, "SIG" + name, None)
    if isinstance(sig, signal.Signals) and sig not in (signal.SIGKILL, signal.SIGSTOP):
        return int(sig)
    raise _bad(v, accepted)


def _regex(v: object) -> re.Pattern[str]:
    if not isinstance(v, str) or not v:
        raise _bad(v, "a regular expression (Python syntax), matched against each output line")
    try:
        return re.compile(v)
    except re.error as e:
        raise _bad(v, f"a regular expression (Python syntax): {e}") from None


def _policy(v: object) -> str:
    # YAML 1.1 reads an unquoted `no` as false.
    if v is False:
        return "no"
    if v not in RESTART_POLICIES:
        raise _bad(v, "one of " + ", ".join(RESTART_POLICIES))
    assert isinstance(v, str)
    return v


def _count(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise _bad(v, "a whole number, 0 or more")
    return v


def _kind(v: object) -> str:
    if v not in UNIT_KINDS:
        raise _bad(v, "one of " + ", ".join(UNIT_KINDS))
    assert isinstance(v, str)
    return v


def _text(v: object) -> str:
    if not isinstance(v, str) or not v:
        raise _bad(v, "a non-empty string")
    if "\0" in v:
        raise _bad(v, "no NUL characters")
    return v


def _stack_name(v: object) -> str:
    if not isinstance(v, str) or not STACK_NAME.fullmatch(v):
        raise _bad(
            v,
            "letters, digits, '.', '_' and '-', starting with a letter or digit, "
            "at most 64 characters (it names a directory)",
        )
    return v


def _http_path(v: object) -> str:
    if not isinstance(v, str) or not v.startswith("/"):
        raise _bad(v, "a path such as /health (probed as http://127.0.0.1:{port}PATH)")
    return v


def _tcp(v: object) -> str:
    if isinstance(v, int) and not isinstance(v, bool):
        if 1 <= v <= 65535:
            return str(v)
    elif isinstance(v, str) and (v == "{port}" or (v.isdigit() and 1 <= int(v) <= 65535)):
        return v
    raise _bad(v, '"{port}" (the unit\'s own port) or a port number 1-65535')


def _positive(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise _bad(v, "a whole number, 1 or more")
    return v


def _arg_name(v: object) -> str:
    if not isinstance(v, str) or not _ARG_NAME.fullmatch(v):
        raise _bad(
            v,
            "an argument name: letters, digits and '_', not starting with a digit, "
            "at most 64 characters",
        )
    return v


def _arg_type(v: object) -> str:
    if v not in ARG_TYPES:
        raise _bad(v, "one of " + ", ".join(ARG_TYPES))
    assert isinstance(v, str)
    return v


def _number(v: object) -> int | float:
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or v != v
        or v
        in (
            float("inf"),
            float("-inf"),
        )
    ):
        raise _bad(v, "a finite number")
    return v


def _flag(v: object) -> bool:
    if not isinstance(v, bool):
        raise _bad(v, "true or false")
    return v


def _choices(v: object) -> tuple[Any, ...]:
    if not isinstance(v, list) or not v:
        raise _bad(v, "a non-empty list of the values accepted")
    return tuple(v)


# ------------------------------------------------------------------ models


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)


class HoldSpec(_Strict):
    """The ticket the whole stack runs in (checked further by :mod:`hold`)."""

    device: Annotated[str, PlainValidator(_text)]
    ttl: Duration | None = None
    label: Annotated[str, PlainValidator(_text)] | None = None


class ReadySpec(_Strict):
    """How a unit proves it is ready: exactly one kind, within ``timeout``."""

    http: Annotated[str, PlainValidator(_http_path)] | None = None
    tcp: Annotated[str, PlainValidator(_tcp)] | None = None
    log: Annotated[re.Pattern[str], PlainValidator(_regex)] | None = None
    exec: Annotated[tuple[str, ...], PlainValidator(_exec_argv)] | None = None
    file: Annotated[str, PlainValidator(_text)] | None = None
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
        return f"{kind} {value}"


class RestartSpec(_Strict):
    """Restart policy: ``max`` restarts in a row, waiting ``backoff`` doubled each time
    up to ``max_backoff``; the count starts again once the unit stayed up ``reset_after``."""

    policy: Annotated[str, PlainValidator(_policy)] = "no"
    max: Annotated[int, PlainValidator(_count)] = 3
    backoff: Grace = 1.0
    max_backoff: Grace = 30.0
    reset_after: Duration = 30.0


class StopSpec(_Strict):
    signal: Annotated[int, PlainValidator(_signal)] = int(signal.SIGTERM)
    grace: Grace = 10.0


class ArgSpec(_Strict):
    """One argument a call of a task unit may pass: its type and bounds.

    ``min``/``max`` (inclusive) for ``int`` and ``float``, ``max_len`` (in
    characters) for ``str``, ``choices`` for any type; ``required``: a call
    without it is refused.
    """

    type: Annotated[str, PlainValidator(_arg_type)]
    min: Annotated[int | float, PlainValidator(_number)] | None = None
    max: Annotated[int | float, PlainValidator(_number)] | None = None
    max_len: Annotated[int, PlainValidator(_count)] | None = None
    choices: Annotated[tuple[Any, ...], PlainValidator(_choices)] | None = None
    required: Annotated[bool, PlainValidator(_flag)] = False

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
            return f"{what}, one of " + ", ".join(_short(c) for c in self.choices)
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


class UnitSpec(_Strict):
    """One unit, as written; placeholders are filled at start (:func:`fill`).

    ``kind`` ``service`` (started by ``hold up``, supervised) or ``task`` (run
    once per call, see :mod:`supervisor.task`): ``timeout``, ``concurrency``
    and ``args`` are a task's; ``port``, ``ready``, ``restart`` and ``after``
    a service's (checked with their lines by the cross-unit checks).
    """

    kind: Annotated[str, PlainValidator(_kind)] = "service"
    cmd: Annotated[tuple[Arg, ...], Field(min_length=1)]
    port: Annotated[int | str, PlainValidator(_port)] | None = None
    cpus: Cpus | None = None
    env: dict[EnvName, Arg] = Field(default_factory=dict)
    pass_env: tuple[EnvName, ...] = ()
    ready: ReadySpec | None = None
    restart: RestartSpec = Field(default_factory=RestartSpec)
    stop: StopSpec = Field(default_factory=StopSpec)
    after: tuple[Annotated[str, PlainValidator(_text)], ...] = ()
    timeout: Duration | None = None
    concurrency: Annotated[int, PlainValidator(_positive)] | None = None
    args: dict[Annotated[str, PlainValidator(_arg_name)], ArgSpec] | None = None


class StackSpec(_Strict):
    """A whole stack file, valid; ``path`` and ``lines`` say where each key was."""

    name: Annotated[str, PlainValidator(_stack_name)]
    hold: HoldSpec | None = None
    units: dict[str, UnitSpec]
    _path: str = PrivateAttr("")
    _lines: dict[Path, int] = PrivateAttr(default_factory=dict)

    @property
    def path(self) -> str:
        """The file as it was named to :func:`load`."""
        return self._path

    def where(self, *keys: str | int) -> str:
        """``FILE:LINE: key.path`` for a message about ``keys`` (e.g. ``"hold", "device"``)."""
        return f"{self._path}:{_line_of(self._lines, keys)}: {_dotted(keys)}"

    def order(self) -> list[str]:
        """Unit names in a start order that respects ``after`` (file order among equals)."""
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


# ------------------------------------------------------------------ loading


# The caller's own checks over the plain data: (key path, message) for each problem.
ExtraCheck = Callable[[dict[str, Any]], list[tuple[Path, str]]]


def load(path: str, *, text: str | None = None, extra_check: ExtraCheck | None = None) -> StackSpec:
    """Read and validate the stack file at ``path`` (or ``text`` as if it were there).

    ``extra_check`` adds the caller's checks (:mod:`hold` checks the device
    class and label of ``hold:``); their problems are reported with the rest.
    """
    from supervisor import yamlsafe  # only here: the rest of the supervisor needs no YAML

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
        try:
            spec = StackSpec.model_validate(data)
        except ValidationError as e:
            for err in e.errors():
                loc = tuple(x for x in err["loc"] if x != "[key]")
                errors.append((_line_of(lines, loc), f"{_dotted(loc)}: {_message(err, loc)}"))
        else:
            spec._path = shown
            spec._lines = lines
        errors.extend(_cross_checks(data, lines))
        if extra_check is not None:
            for loc, msg in extra_check(data):
                errors.append((_line_of(lines, loc), f"{_dotted(loc)}: {msg}"))
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


def _plain(
    node: Any, path: Path, lines: dict[Path, int], shown: str, errors: list[tuple[int, str]]
) -> Any:
    """The composed YAML as plain data, recording each key's line in ``lines``.

    The reader bounded the depth and the size with aliases expanded, and
    refused duplicate and non-scalar keys, so this recursion is bounded.
    """
    import yaml

    from supervisor.yamlsafe import scalar_value

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
    if isinstance(value, (int, float)) and not isinstance(value, bool) and _as_written(path):
        # A number in a command or a variable is the text written: YAML 1.1
        # would make `010` 8, `1:30` 90 and `1_000` 1000.
        return str(node.value)
    return value


def _as_written(path: Path) -> bool:
    """Is ``path`` an argument of a command or a variable's value (see :func:`_arg`)?"""
    if len(path) < 4 or path[0] != "units":
        return False
    return (len(path) == 4 and path[2] in ("cmd", "env")) or (
        len(path) == 5 and path[2:4] == ("ready", "exec")
    )


def _dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _line_of(lines: Mapping[Path, int], loc: tuple[Any, ...]) -> int:
    loc = tuple(loc)
    while loc and loc not in lines:
        loc = loc[:-1]
    return lines.get(loc, 1)


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model whose fields are valid keys at ``loc`` (for "accepted: ..." hints)."""
    models: dict[tuple[str, ...], type[BaseModel]] = {
        (): StackSpec,
        ("hold",): HoldSpec,
        ("units", "*"): UnitSpec,
        ("units", "*", "ready"): ReadySpec,
        ("units", "*", "restart"): RestartSpec,
        ("units", "*", "stop"): StopSpec,
        ("units", "*", "args", "*"): ArgSpec,
    }
    key = tuple(
        "*" if loc[0] == "units" and (i == 1 or (i == 3 and loc[2] == "args")) else str(p)
        for i, p in enumerate(loc)
    )
    return models.get(key)


def _accepted(parent: tuple[Any, ...], key: str = "") -> str:
    """``accepted: a, b, c`` at ``parent``, and a "did you mean" for ``key`` if one fits."""
    model = _model_at(parent)
    if model is None:
        return "no keys here"
    names = list(model.model_fields)
    hint = did_you_mean(key, names, SYNONYMS.get(model.__name__)) if key else ""
    return "accepted: " + ", ".join(names) + hint


def _message(err: Any, loc: tuple[Any, ...]) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return "unknown key; " + _accepted(loc[:-1], str(loc[-1]) if loc else "")
    if kind == "missing":
        return "missing (required)"
    if kind == "value_error":
        return str(err["ctx"]["error"])
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        what = "a mapping" if loc else "a mapping with name and units"
        return f"{_short(err['input'])} is not valid: {what}"
    if kind in ("tuple_type", "list_type", "too_short"):
        return f"{_short(err['input'])} is not valid: a non-empty list"
    msg = str(err["msg"])
    return f"{_short(err['input'])} is not valid: {msg[0].lower()}{msg[1:]}"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ------------------------------------------------------------------ cross-unit checks


def _strings(unit: Mapping[str, Any]) -> Iterator[tuple[tuple[Any, ...], str]]:
    """(key path within the unit, text) for every value that may hold placeholders."""
    cmd = unit.get("cmd")
    if isinstance(cmd, list):
        for i, a in enumerate(cmd):
            if isinstance(a, str):
                yield ("cmd", i), a
    env = unit.get("env")
    if isinstance(env, dict):
        for k, v in env.items():
            if isinstance(v, str):
                yield ("env", k), v
    ready = unit.get("ready")
    if isinstance(ready, dict):
        for k in ("http", "tcp", "file"):
            if isinstance(ready.get(k), str):
                yield ("ready", k), ready[k]
        ex = ready.get("exec")
        if isinstance(ex, str):
            yield ("ready", "exec"), ex
        elif isinstance(ex, list):
            for i, a in enumerate(ex):
                if isinstance(a, str):
                    yield ("ready", "exec", i), a


def _cross_checks(data: dict[str, Any], lines: Mapping[Path, int]) -> list[tuple[int, str]]:
    errors: list[tuple[int, str]] = []

    def err(loc: tuple[Any, ...], msg: str) -> None:
        errors.append((_line_of(lines, loc), f"{_dotted(loc)}: {msg}"))

    units = data.get("units")
    if not isinstance(units, dict):
        return errors
    names = [n for n in units if isinstance(n, str)]
    for name in units:
        if not isinstance(name, str) or not _UNIT_NAME.fullmatch(name):
            err(
                ("units", str(name)),
                f"{name!r} is not a valid unit name: letters, digits, "
                "'_' and '-', starting with a letter or '_', at most 64 characters",
            )
    has_port = {n: isinstance(u, dict) and u.get("port") is not None for n, u in units.items()}

    # after: known units, no cycles.
    graph: dict[str, list[str]] = {}
    for name, unit in units.items():
        graph[name] = []
        after = unit.get("after") if isinstance(unit, dict) else None
        if not isinstance(after, list):
            continue
        for i, dep in enumerate(after):
            if not isinstance(dep, str):
                continue
            if dep not in units:
                err(
                    ("units", name, "after", i),
                    f"{dep!r} names no unit (units: {', '.join(names)})",
                )
            elif dep == name:
                err(("units", name, "after", i), f"cycle: {name} -> {name}")
            else:
                graph[name].append(dep)
    for cycle in _cycles(graph):
        first = cycle[0]
        err(("units", first, "after"), "cycle: " + " -> ".join([*cycle, first]))

    # What each kind takes: a task runs once per call (no port, probe, restart
    # or order) and must have its own CPU lane; a service waits for no task.
    kinds = {
        n: (u.get("kind", "service") if isinstance(u, dict) else None) for n, u in units.items()
    }
    for name, unit in units.items():
        if not isinstance(unit, dict) or kinds[name] not in UNIT_KINDS:
            continue
        if kinds[name] == "task":
            for key in SERVICE_ONLY:
                if key in unit:
                    err(
                        ("units", name, key),
                        "not for a task unit (a task runs once per call); "
                        "a task takes: cmd, cpus, timeout, concurrency, args, env, "
                        "pass_env, stop",
                    )
            if unit.get("cpus") is None:
                err(
                    ("units", name, "cpus") if "cpus" in unit else ("units", name),
                    "cpus is required for a task unit: its own CPU lane, a CPU list like "
                    "14-15 (never 'no pinning')",
                )
        else:
            for key in TASK_ONLY:
                if key in unit:
                    err(("units", name, key), "only for a task unit (kind: task)")
            after = unit.get("after")
            if isinstance(after, list):
                for i, dep in enumerate(after):
                    if isinstance(dep, str) and kinds.get(dep) == "task":
                        err(
                            ("units", name, "after", i),
                            f"{dep!r} is a task unit: it runs per call and is never "
                            "'ready' to wait for",
                        )

    # Placeholders name known things; {port} needs a port.
    for name, unit in units.items():
        if not isinstance(unit, dict):
            continue
        for sub, text in _strings(unit):
            loc = ("units", name, *sub)
            for m in _PLACEHOLDER.finditer(text):
                inner = m.group(1)
                if inner is None:
                    continue
                if inner == "port":
                    if not has_port[name]:
                        err(
                            loc,
                            f"{{port}} used, but unit {name} has no port "
                            "(add port: auto or a number)",
                        )
                    continue
                if inner == "run_dir":
                    continue
                pm = _UNIT_PORT.fullmatch(inner)
                if pm is not None:
                    other = pm.group(1)
                    if other not in units:
                        err(loc, f"{{{inner}}} names no unit (units: {', '.join(names)})")
                    elif not has_port[other]:
                        err(loc, f"{{{inner}}}: unit {other} has no port")
                    continue
                err(loc, f"unknown placeholder {{{inner}}}: accepted {PLACEHOLDERS_ACCEPTED}")
            # A lone brace is a typo for a placeholder, not text.
            rest = _PLACEHOLDER.sub("", text)
            if "{" in rest or "}" in rest:
                err(loc, f"{text!r} has an unmatched brace; accepted {PLACEHOLDERS_ACCEPTED}")
        ready = unit.get("ready")
        if isinstance(ready, dict) and "http" in ready and not has_port[name]:
            err(
                ("units", name, "ready", "http"),
                f"an http probe needs the unit's port (add port: auto or a number to {name})",
            )

    # A named port belongs to one unit.
    owners: dict[int, str] = {}
    for name, unit in units.items():
        port = unit.get("port") if isinstance(unit, dict) else None
        if isinstance(port, int) and not isinstance(port, bool):
            if port in owners:
                err(("units", name, "port"), f"port {port} is already unit {owners[port]}'s")
            else:
                owners[port] = name
    return errors


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


# ------------------------------------------------------------------ placeholders


def fill(text: str, *, unit: str, ports: Mapping[str, int], run_dir: str) -> str:
    """``text`` with ``{port}``, ``{units.NAME.port}``, ``{run_dir}`` filled in
    (validated already: every name is known and every port assigned)."""

    def sub(m: re.Match[str]) -> str:
        whole, inner = m.group(0), m.group(1)
        if inner is None:
            return whole[0]  # {{ -> {, }} -> }
        if inner == "port":
            return str(ports[unit])
        if inner == "run_dir":
            return run_dir
        pm = _UNIT_PORT.fullmatch(inner)
        assert pm is not None, inner
        return str(ports[pm.group(1)])

    return _PLACEHOLDER.sub(sub, text)


def filled_env(spec: UnitSpec, unit: str, ports: Mapping[str, int], run_dir: str) -> dict[str, str]:
    return {k: fill(v, unit=unit, ports=ports, run_dir=run_dir) for k, v in spec.env.items()}
