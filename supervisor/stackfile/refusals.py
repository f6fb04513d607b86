"""A stack file read by the pydantic models: what :func:`hold_supervisor.stackfile.load.load`
does when the quick path (:mod:`hold_supervisor.stackfile.plain`) gave up, so that every
refusal is found and worded here, each with its key path (the caller adds the line).

Imported only then: pydantic and the models' schemas cost ~80 ms.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from hold_supervisor.parse import did_you_mean
from hold_supervisor.stackfile.models import (
    ArgModel,
    HoldModel,
    LivenessModel,
    ReadyModel,
    RestartModel,
    ScratchModel,
    StackModel,
    StopModel,
    UnitModel,
    to_spec,
)
from hold_supervisor.stackfile.spec import Path, StackSpec, dotted, line_of
from hold_supervisor.stackfile.values import short

# For an unknown key: what users of process-compose, docker-compose and
# systemd type for ours (by model; a close spelling is found by difflib).
SYNONYMS: dict[str, dict[str, str]] = {
    "StackModel": {
        "services": "units",
        "processes": "units",
        "programs": "units",
        "project": "name",
        "project_name": "name",
        "ticket": "hold",
        "lease": "hold",
        "device": "hold",
    },
    "UnitModel": {
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
    "ReadyModel": {
        "http_get": "http",
        "httpget": "http",
        "path": "http",
        "url": "http",
        "tcp_socket": "tcp",
        "port": "tcp",
        "command": "exec",
        "cmd": "exec",
        "log_line": "log",
        "log_pattern": "log",
        "pattern": "log",
        "regex": "log",
        "path_exists": "file",
        "timeout_seconds": "timeout",
        "timeoutstartsec": "timeout",
        "sd_notify": "notify",
        "type": "notify",
    },
    "LivenessModel": {
        "http_get": "http",
        "httpget": "http",
        "path": "http",
        "url": "http",
        "tcp_socket": "tcp",
        "port": "tcp",
        "command": "exec",
        "cmd": "exec",
        "interval": "period",
        "period_seconds": "period",
        "every": "period",
        "timeout_seconds": "timeout",
        "failure_threshold": "failures",
        "retries": "failures",
    },
    "ScratchModel": {"keep_after": "keep", "free": "min_free", "min_space": "min_free"},
    "RestartModel": {
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
    "StopModel": {
        "timeout": "grace",
        "timeout_seconds": "grace",
        "timeoutstopsec": "grace",
        "kill_timeout": "grace",
        "stop_grace_period": "grace",
        "grace_period": "grace",
        "killsignal": "signal",
        "stop_signal": "signal",
    },
    "HoldModel": {
        "class": "device",
        "devices": "device",
        "time": "ttl",
        "timeout": "ttl",
        "duration": "ttl",
        "limit": "ttl",
        "description": "label",
        "comment": "label",
    },
    "ArgModel": {
        "kind": "type",
        "minimum": "min",
        "maximum": "max",
        "maxlength": "max_len",
        "max_length": "max_len",
        "enum": "choices",
        "values": "choices",
        "mandatory": "required",
    },
}


def validate(
    data: dict[str, Any], shown: str, lines: dict[Path, int]
) -> tuple[StackSpec | None, list[tuple[int, str]]]:
    """The spec if the models accept ``data``; else None and each problem, ``(line, text)``."""
    try:
        return to_spec(StackModel.model_validate(data), shown, lines), []
    except ValidationError as e:
        errors = []
        for err in e.errors():
            loc = tuple(x for x in err["loc"] if x != "[key]")
            errors.append((line_of(lines, loc), f"{dotted(loc)}: {_message(err, loc)}"))
        return None, errors


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model whose fields are valid keys at ``loc`` (for "accepted: ..." hints)."""
    models: dict[tuple[str, ...], type[BaseModel]] = {
        (): StackModel,
        ("hold",): HoldModel,
        ("units", "*"): UnitModel,
        ("units", "*", "ready"): ReadyModel,
        ("units", "*", "liveness"): LivenessModel,
        ("units", "*", "scratch"): ScratchModel,
        ("units", "*", "restart"): RestartModel,
        ("units", "*", "stop"): StopModel,
        ("units", "*", "args", "*"): ArgModel,
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
        return f"{short(err['input'])} is not valid: {what}"
    if kind in ("tuple_type", "list_type", "too_short"):
        return f"{short(err['input'])} is not valid: a non-empty list"
    msg = str(err["msg"])
    return f"{short(err['input'])} is not valid: {msg[0].lower()}{msg[1:]}"
