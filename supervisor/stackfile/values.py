"""The values a stack file holds, each read strictly.

Each reader takes what YAML produced and returns the value, or raises
``ValueError`` with "<value> is not valid: <what is accepted>". The tables of
:mod:`hold_supervisor.stackfile.schema` name one for each key, and add the key path
(and :mod:`hold_supervisor.stackfile.load` the line) to a refusal.
"""

from __future__ import annotations

import re
import signal
from typing import Any, Literal

from hold_supervisor.environ import check_name
from hold_supervisor.parse import BadValue, parse_cpus, parse_duration
from hold_supervisor.stackfile.name import STACK_NAME
from hold_supervisor.stackfile.spec import ArgSpec

UNIT_KINDS = ("service", "oneshot", "task")
ARG_TYPES = ("int", "float", "str", "bool")
RESTART_POLICIES = ("no", "on-failure", "always")
# What a unit may wait for in another (process-compose's process_started,
# process_healthy, process_completed_successfully).
CONDITIONS = ("started", "ready", "completed")
CONDITION_SYNONYMS = {
    "process_started": "started",
    "process_healthy": "ready",
    "healthy": "ready",
    "process_completed_successfully": "completed",
    "completed_successfully": "completed",
    "service_started": "started",
    "service_healthy": "ready",
    "service_completed_successfully": "completed",
}

_ARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}", re.ASCII)
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B?|B)?\s*", re.ASCII)
_SIZE_FACTOR = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def short(value: object) -> str:
    """``value`` as written in a message, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _bad(value: object, accepted: str) -> ValueError:
    return ValueError(f"{value!r} is not valid: {accepted}")


def _duration(v: object, allow_zero: bool) -> float:
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


def duration(v: object) -> float:
    """A duration with its unit, more than zero (``timeout``, ``ttl``, ``period``...)."""
    return _duration(v, False)


def grace(v: object) -> float:
    """A duration with its unit, zero allowed (``grace``, ``backoff``)."""
    return _duration(v, True)


def cpus(v: object) -> frozenset[int]:
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise _bad(v, "a CPU list like 0-3,8")
    try:
        return parse_cpus(str(v))
    except BadValue as e:
        raise _bad(v, e.accepted) from None


class YamlWord:
    """An unquoted word that YAML read as a boolean or null (``yes``, ``off``, ``~``,
    nothing) where text was meant: kept as written, to be refused by name."""

    def __init__(self, text: str, value: bool | None) -> None:
        self.text = text
        self.value = value

    def __repr__(self) -> str:
        return repr(self.text)

    def problem(self) -> str:
        if self.value is None:
            shown = f"{self.text!r}" if self.text else "an empty value"
            return f"YAML reads {shown} as null, not text: quote it ('{self.text}')"
        what = "true" if self.value else "false"
        return (
            f"YAML reads the unquoted word {self.text!r} as the boolean {what}, not text: "
            f"quote it ('{self.text}')"
        )


def arg(v: object) -> str:
    # Numbers are taken as written (`--port, 8080`); a YAML boolean or null is
    # refused, since `yes`/`no`/`on`/`off` would silently become True/False.
    if isinstance(v, YamlWord):
        raise ValueError(v.problem())
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise _bad(v, "a string (quote values like yes, no, on, off)")
    s = v if isinstance(v, str) else str(v)
    if "\0" in s:
        raise _bad(v, "no NUL characters")
    return s


def argv(v: object) -> tuple[str, ...]:
    if not isinstance(v, list) or not v:
        raise _bad(v, "a non-empty list: [program, arg, ...]")
    out: list[str] = []
    for i, item in enumerate(v):
        try:
            out.append(arg(item))
        except ValueError as e:
            raise ValueError(f"item {i}: {e}") from None
    if not out[0]:
        raise _bad(v, "a program name first")
    return tuple(out)


def exec_argv(v: object) -> tuple[str, ...]:
    if isinstance(v, str) and v.strip():
        return ("/bin/sh", "-c", v)
    return argv(v)


def env_name(v: object) -> str:
    if not isinstance(v, str):
        raise _bad(v, "a variable name")
    try:
        return check_name(v)
    except BadValue as e:
        raise _bad(v, e.accepted) from None


def port(v: object) -> int | Literal["auto"]:
    if v == "auto":
        return "auto"
    if isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 65535:
        return v
    raise _bad(v, "auto (the kernel picks a free port) or a port number 1-65535")


def stop_signal(v: object) -> int:
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


def regex(v: object) -> re.Pattern[str]:
    if not isinstance(v, str) or not v:
        raise _bad(v, "a regular expression (Python syntax), matched against each output line")
    try:
        return re.compile(v)
    except re.error as e:
        raise _bad(v, f"a regular expression (Python syntax): {e}") from None


def policy(v: object) -> str:
    # YAML 1.1 reads an unquoted `no` as false.
    if v is False:
        return "no"
    if v not in RESTART_POLICIES:
        raise _bad(v, "one of " + ", ".join(RESTART_POLICIES))
    assert isinstance(v, str)
    return v


def count(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise _bad(v, "a whole number, 0 or more")
    return v


def kind(v: object) -> str:
    if v not in UNIT_KINDS:
        raise _bad(v, "one of " + ", ".join(UNIT_KINDS))
    assert isinstance(v, str)
    return v


def text(v: object) -> str:
    if not isinstance(v, str) or not v:
        raise _bad(v, "a non-empty string")
    if "\0" in v:
        raise _bad(v, "no NUL characters")
    return v


def stack_name(v: object) -> str:
    if not isinstance(v, str) or not STACK_NAME.fullmatch(v):
        raise _bad(
            v,
            "letters, digits, '.', '_' and '-', starting with a letter or digit, "
            "at most 64 characters (it names a directory)",
        )
    return v


def http_path(v: object) -> str:
    if not isinstance(v, str) or not v.startswith("/"):
        raise _bad(v, "a path such as /health (probed as http://127.0.0.1:{port}PATH)")
    return v


def tcp_port(v: object) -> str:
    if isinstance(v, int) and not isinstance(v, bool):
        if 1 <= v <= 65535:
            return str(v)
    elif isinstance(v, str) and (v == "{port}" or (v.isdigit() and 1 <= int(v) <= 65535)):
        return v
    raise _bad(v, '"{port}" (the unit\'s own port) or a port number 1-65535')


def positive(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise _bad(v, "a whole number, 1 or more")
    return v


def arg_name(v: object) -> str:
    if not isinstance(v, str) or not _ARG_NAME.fullmatch(v):
        raise _bad(
            v,
            "an argument name: letters, digits and '_', not starting with a digit, "
            "at most 64 characters",
        )
    return v


def arg_type(v: object) -> str:
    if v not in ARG_TYPES:
        raise _bad(v, "one of " + ", ".join(ARG_TYPES))
    assert isinstance(v, str)
    return v


def number(v: object) -> int | float:
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


def flag(v: object) -> bool:
    if not isinstance(v, bool):
        raise _bad(v, "true or false")
    return v


def choices(v: object) -> tuple[Any, ...]:
    if not isinstance(v, list) or not v:
        raise _bad(v, "a non-empty list of the values accepted")
    return tuple(v)


def size(v: object) -> int:
    """Bytes in ``500M``, ``2G``, ``1.5GiB``, ``4096`` (binary units: K is 1024)."""
    accepted = "a size such as 500M, 2G or 1.5GiB (K, M, G, T are powers of 1024)"
    m = _SIZE.fullmatch(v) if isinstance(v, str) else None
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return v
    if m is None:
        raise _bad(v, accepted)
    unit = (m.group(2) or "").rstrip("B").rstrip("i") or ("B" if m.group(2) else "")
    return int(float(m.group(1)) * _SIZE_FACTOR[unit])


def path_text(v: object) -> str:
    value = text(v)
    if "\n" in value:
        raise _bad(v, "a path on one line")
    return value


def notify_flag(v: object) -> bool:
    if v is not True:
        raise _bad(v, "true (the unit is ready when it sends READY=1 to $NOTIFY_SOCKET)")
    return True


def arg_fits(
    t: str,
    low: int | float | None,
    high: int | float | None,
    max_len: int | None,
    allowed: tuple[Any, ...] | None,
) -> None:
    """A task argument's bounds fit its type ``t`` (``ValueError`` if not)."""
    if t not in ("int", "float") and (low is not None or high is not None):
        raise ValueError(f"min and max are for int and float arguments, not {t}")
    if t == "int":
        for key, bound in (("min", low), ("max", high)):
            if bound is not None and not isinstance(bound, int):
                raise ValueError(f"{key} {bound!r} is not valid: a whole number for an int")
    if low is not None and high is not None and low > high:
        raise ValueError(f"min {low!r} is more than max {high!r}")
    if max_len is not None and t != "str":
        raise ValueError(f"max_len is for str arguments, not {t}")
    if allowed is not None:
        unbounded = ArgSpec(t, low, high, max_len, None)
        for c in allowed:
            if unbounded.problem(c) is not None:
                raise ValueError(f"choice {c!r} is not valid: {unbounded.accepted()}")
