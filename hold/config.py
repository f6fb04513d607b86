"""The configuration file: where it is, and a strict reading of it.

Found at ``HOLD_CONFIG``, else ``$XDG_CONFIG_HOME/hold/config.yaml``, else
``/etc/hold/config.yaml``, else the embedded defaults. ``yaml`` is imported
only when a file exists: ``npu-hold``'s start-up time is a benchmark, and
most machines run on the defaults.

Unknown keys and values of the wrong kind are errors that name the file and
line, never silently ignored; every problem in the file is reported at once
(:func:`refusal`), as the stack files do.
"""

from __future__ import annotations

import os
import stat
from typing import Any, NamedTuple

from hold.devices.classes import classes_from_config
from hold_supervisor.parse import BadValue, did_you_mean, parse_duration

CGROUP_MODES = ("auto", "off", "required")
BUSY_MODES = ("wait", "warn")
UNREADABLE_MODES = ("refuse", "ignore")


class Config(NamedTuple):
    path: str | None = None
    cgroups: str = "auto"  # auto: use a cgroup leaf where one can be made
    # compat: {home_tokens: false} turns off ~/NPU-TOKEN, ~/GPU-TOKEN (hold.daemon.records).
    home_tokens: bool = True
    # state: {shared: true}: one daemon for several users (run as root): the
    # state directory is made 0755 and the socket 0666; who may do what is
    # still decided from each client's SO_PEERCRED.
    shared_state: bool = False
    # A device held by a process outside any lease: "wait" (not granted until
    # it is empty) or "warn" (granted, and the client is told who holds it).
    busy_devices: str = "wait"
    # A device whose emptiness this daemon cannot prove (it may not read some
    # processes: a per-user daemon, other users'): "refuse" its grant (saying
    # why) or "ignore" the processes it cannot read (the risk accepted).
    unreadable_processes: str = "refuse"
    # limits: {connections: N, queued: N}: what one user (root excepted) may
    # hold open at the daemon at once, and keep waiting in line (issue 24).
    limit_connections: int = 256
    limit_queued: int = 256
    devices: Any = None  # the YAML node; read by the device classes
    # report: {labels: true}: hold report shows other users' labels (not
    # private ones); {sample: 30s}: how often live leases are scanned for "held".
    report_labels: bool = False
    report_sample: float = 30.0
    # scratch: {min_free: SIZE}: the free-space floor of every scratch (hold run
    # --scratch, npu-hold --scratch, a stack unit's without its own min_free);
    # None: hold_supervisor.spawn.scratch.DEFAULT_MIN_FREE; 0: none.
    scratch_min_free: int | None = None


def config_path(environ: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """The file to read, or None for the defaults. ``HOLD_CONFIG`` must exist if set."""
    explicit = environ.get("HOLD_CONFIG")
    if explicit:
        if not os.path.isfile(explicit):
            raise BadValue("HOLD_CONFIG", explicit, "the path of an existing YAML file")
        return explicit
    xdg = environ.get("XDG_CONFIG_HOME") or os.path.join(environ.get("HOME", "/"), ".config")
    for cand in (os.path.join(xdg, "hold", "config.yaml"), "/etc/hold/config.yaml"):
        if os.path.isfile(cand):
            return cand
    return None


def fingerprint(path: str | None) -> str:
    """What a daemon and its client compare to know they read one configuration."""
    if path is None:
        return "defaults"
    # lazy: only for a file; hold run without one imports no importlib
    import importlib

    try:
        # The built-in SHA-256 (same digest): hashlib would load OpenSSL,
        # ~3 ms of npu-hold's start-up.
        sha256 = importlib.import_module("_sha256").sha256
    except ImportError:  # an interpreter built without it
        from hashlib import sha256  # lazy: OpenSSL, only without _sha256
    try:
        # O_NONBLOCK: a FIFO named as the configuration must not block start-up
        # (parse_file then refuses it with a message).
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return "unreadable"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "unreadable"
        with os.fdopen(fd, "rb", closefd=False) as f:
            return str(sha256(f.read()).hexdigest()[:16])
    except OSError:
        return "unreadable"
    finally:
        os.close(fd)


def load(environ: dict[str, str] | os._Environ[str] = os.environ) -> Config:
    path = config_path(environ)
    if path is None:
        return Config()
    return parse_file(path)


TOP_KEYS = (
    "busy_devices",
    "cgroups",
    "compat",
    "devices",
    "limits",
    "report",
    "scratch",
    "state",
    "unreadable_processes",
)
# What people type for our keys (from other tools, or by habit).
SYNONYMS = {
    "cgroup": "cgroups",
    "cgroup_mode": "cgroups",
    "use_cgroups": "cgroups",
    "device": "devices",
    "classes": "devices",
    "device_classes": "devices",
    "busy": "busy_devices",
    "on_busy": "busy_devices",
    "busy_device": "busy_devices",
    "home_tokens": "compat",
    "shared": "state",
    "shared_state": "state",
    "unreadable": "unreadable_processes",
    "unreadable_process": "unreadable_processes",
}


def parse_file(path: str) -> Config:
    """The configuration in ``path``, every value checked (:class:`BadValue` with file:line).

    Read by :mod:`hold_supervisor.yamlsafe` (bounded depth, size and aliases,
    strict UTF-8, duplicate keys refused), so nothing in it can make a
    command run long, grow large or fail after the daemon was asked. Every
    problem found is reported, one line each, in file order (:func:`refusal`);
    only a file that cannot be read as a mapping stops at its first.
    """
    # lazy: PyYAML (~15 ms) only to parse the file; npu-hold takes the daemon's reading
    from hold_supervisor.yamlsafe import load_file

    root = load_file(path)
    if root is None:
        return Config(path=path)
    top = _mapping(root, path, "the top level")
    values: dict[str, Any] = {"path": path}
    problems: list[BadValue] = []
    for key, (knode, vnode) in top.items():
        where = f"{path}:{knode.start_mark.line + 1}"
        try:
            if key == "cgroups":
                values["cgroups"] = _choice(vnode, path, "cgroups", CGROUP_MODES)
            elif key == "compat":
                values["home_tokens"] = _flag(
                    vnode, path, "compat", "home_tokens", problems, default=True
                )
            elif key == "state":
                values["shared_state"] = _flag(vnode, path, "state", "shared", problems)
            elif key == "busy_devices":
                values["busy_devices"] = _choice(vnode, path, "busy_devices", BUSY_MODES)
            elif key == "unreadable_processes":
                values["unreadable_processes"] = _choice(
                    vnode, path, "unreadable_processes", UNREADABLE_MODES
                )
            elif key == "devices":
                values["devices"] = vnode
            elif key == "report":
                values.update(_report(vnode, path, problems))
            elif key == "limits":
                values.update(_limits(vnode, path, problems))
            elif key == "scratch":
                values["scratch_min_free"] = _scratch(vnode, path, problems)
            else:
                raise BadValue(
                    "key",
                    key,
                    "one of " + ", ".join(TOP_KEYS) + did_you_mean(key, TOP_KEYS, SYNONYMS),
                    where,
                )
        except BadValue as e:
            problems.append(e)
    # The device classes are checked now, whoever reads the file: a typo
    # there is the same error (file:line) for every command, not only those
    # that name a device.
    try:
        classes_from_config(values.get("devices"), path)
    except BadValue as e:
        problems.append(e)
    error = refusal(path, problems)
    if error is not None:
        raise error
    return Config(**values)


def refusal(path: str | None, problems: list[BadValue]) -> BadValue | None:
    """One error for every problem found in the file at ``path`` (None if none):
    :func:`hold_supervisor.yamlsafe.refusal`, loaded only when there is one
    (PyYAML is not on the hot path of a file without problems)."""
    if not problems:
        return None
    # lazy: PyYAML, only for a file with problems
    from hold_supervisor.yamlsafe import refusal as one_error

    return one_error(path, problems)


def _choice(node: Any, path: str, what: str, accepted: tuple[str, ...]) -> str:
    # The text as written: `cgroups: off` is YAML 1.1's false, and means off.
    text = _scalar(node, path)
    if text not in accepted:
        raise BadValue(
            what,
            text,
            "one of " + ", ".join(accepted) + did_you_mean(text, accepted),
            f"{path}:{node.start_mark.line + 1}",
        )
    return text


def _flag(
    node: Any,
    path: str,
    section: str,
    name: str,
    problems: list[BadValue],
    *,
    default: bool = False,
) -> bool:
    """``section: {name: true|false}``, the one key such a section has (``default`` if absent).

    A bad key or value is added to ``problems``; a section that is not a mapping is raised.
    """
    value = default
    for key, (knode, vnode) in _mapping(node, path, section).items():
        where = f"{path}:{knode.start_mark.line + 1}"
        try:
            if key != name:
                raise BadValue(f"key {section}.", key, name + did_you_mean(key, (name,)), where)
            text = _scalar(vnode, path)
            if text not in ("true", "false"):
                raise BadValue(f"{section}.{name}", text, "true or false", where)
            value = text == "true"
        except BadValue as e:
            problems.append(e)
    return value


LIMIT_RANGE = (1, 100_000)


def _limits(node: Any, path: str, problems: list[BadValue]) -> dict[str, Any]:
    """``limits: {connections: N, queued: N}``, each a whole number from 1 to 100000
    (what one user may hold at the daemon: :class:`hold.daemon.state.DaemonState`).
    A bad key or value is added to ``problems``."""
    out: dict[str, Any] = {}
    keys = ("connections", "queued")
    for key, (knode, vnode) in _mapping(node, path, "limits").items():
        where = f"{path}:{knode.start_mark.line + 1}"
        try:
            if key not in keys:
                raise BadValue(
                    "key limits.", key, " or ".join(keys) + did_you_mean(key, keys), where
                )
            text = _scalar(vnode, path)
            lo, hi = LIMIT_RANGE
            if not text.isdigit() or not lo <= int(text) <= hi:
                raise BadValue(f"limits.{key}", text, f"a whole number from {lo} to {hi}", where)
            out[f"limit_{key}"] = int(text)
        except BadValue as e:
            problems.append(e)
    return out


def _report(node: Any, path: str, problems: list[BadValue]) -> dict[str, Any]:
    """``report: {labels: true|false, sample: DURATION}`` (see :mod:`hold.daemon.usage`).

    A bad key or value is added to ``problems``; a section that is not a mapping is raised.
    """
    out: dict[str, Any] = {}
    for key, (knode, vnode) in _mapping(node, path, "report").items():
        where = f"{path}:{knode.start_mark.line + 1}"
        try:
            if key == "labels":
                shown = _choice(vnode, path, "report.labels", ("true", "false"))
                out["report_labels"] = shown == "true"
            elif key == "sample":
                sample = parse_duration(
                    _scalar(vnode, path), what="report.sample", plain_unit="seconds", where=where
                )
                if not 0.1 <= sample <= 3600:
                    raise BadValue("report.sample", _scalar(vnode, path), "0.1s to 1h", where)
                out["report_sample"] = sample
            else:
                raise BadValue(
                    "key report.",
                    key,
                    "labels or sample" + did_you_mean(key, ("labels", "sample")),
                    where,
                )
        except BadValue as e:
            problems.append(e)
    return out


def _scratch(node: Any, path: str, problems: list[BadValue]) -> int | None:
    """``scratch: {min_free: SIZE}`` (``500M``, ``2G``; 0: no floor).

    A bad key or value is added to ``problems``; a section that is not a mapping is raised.
    """
    # lazy: stackfile.values (dataclasses, ast) only for a scratch section
    from hold_supervisor.stackfile.values import size

    out: int | None = None
    for key, (knode, vnode) in _mapping(node, path, "scratch").items():
        where = f"{path}:{knode.start_mark.line + 1}"
        try:
            if key != "min_free":
                raise BadValue(
                    "key scratch.", key, "min_free" + did_you_mean(key, ("min_free",)), where
                )
            text = _scalar(vnode, path)
            try:
                out = size(text)
            except ValueError:
                raise BadValue(
                    "scratch.min_free",
                    text,
                    "a size such as 500M, 2G or 1.5GiB (K, M, G, T are powers of 1024), or 0",
                    where,
                ) from None
        except BadValue as e:
            problems.append(e)
    return out


def scratch_min_free(environ: dict[str, str] | os._Environ[str] = os.environ) -> int | None:
    """The configuration's scratch floor (None: the built-in default); :class:`BadValue`
    for a bad file. For ``hold run --scratch``, which otherwise may read no file."""
    return load(environ).scratch_min_free


def _mapping(node: Any, path: str, what: str) -> dict[str, tuple[Any, Any]]:
    """A mapping's keys (each once: the reader refused duplicates) with their nodes."""
    # lazy: PyYAML only to parse the file (see parse_file)
    import yaml

    where = f"{path}:{node.start_mark.line + 1}"
    if not isinstance(node, yaml.MappingNode):
        shown = node.value if isinstance(node, yaml.ScalarNode) else "(a list)"
        raise BadValue(what, shown, "a mapping", where)
    return {_scalar(k, path): (k, v) for k, v in node.value}


def _scalar(node: Any, path: str) -> str:
    # lazy: PyYAML only to parse the file (see parse_file)
    import yaml

    if not isinstance(node, yaml.ScalarNode):
        raise BadValue(
            "value", "(a list or mapping)", "a single value", f"{path}:{node.start_mark.line + 1}"
        )
    return str(node.value)
