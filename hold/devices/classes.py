"""Device classes: which nodes make up a class, and what a command is told.

A class names per-device nodes (one device each, in sorted order), shared
nodes (control nodes every user of the class opens, such as
``/dev/nvidiactl``) and the variables that tell a program which devices it
may use. A class with no node on this machine still has one logical device,
so tickets work everywhere.
"""

from __future__ import annotations

import glob
import os
import re
import stat
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from hold_supervisor.parse import BadValue, did_you_mean


class DeviceClass(NamedTuple):
    name: str
    nodes: tuple[str, ...]  # glob patterns, one device per matching node
    shared_nodes: tuple[str, ...] = ()
    visible_env: tuple[str, ...] = ()
    # Executables (absolute paths) that hold the nodes on purpose and are
    # neither strays nor in anyone's way when run by root: a persistence
    # daemon. Matched by the process's /proc/PID/exe, never by its name
    # (anyone can name a process anything; only root can run one as root).
    allowed_holders: tuple[str, ...] = ()

    def allows(self, pid: int, uid: int) -> bool:
        """Is ``pid`` (running as ``uid``) one of the class's allowed holders?"""
        if uid != 0 or not self.allowed_holders:
            return False
        from hold_supervisor.proc import scan  # here: the configuration needs no /proc reader

        try:
            exe = scan.exe(pid)
        except OSError:
            return False
        return exe in self.allowed_holders

    def device_nodes(self) -> list[str]:
        """The per-device nodes present now, in device order (natural sort).

        A device is its device number, not a path: two paths to one node (a
        hard link, a second node with the same numbers, a symlink) are one
        device, listed once under the first path in that order.
        """
        found: set[str] = set()
        for pattern in self.nodes:
            found.update(glob.glob(pattern))
        out: list[str] = []
        seen: set[str] = set()
        for path in sorted(found, key=_natural):
            key = node_key(path)
            if key is None or key in seen:
                continue
            seen.add(key)
            out.append(path)
        if any(k.startswith(f"c{NVIDIA_MAJOR}-") for k in seen):
            # nvidia-drm gives each NVIDIA GPU a DRM render node too: the same
            # GPU by another number. Counted once, by its /dev/nvidiaN node.
            out = [p for p in out if not _nvidia_render_node(p)]
        return out

    def device_keys(self) -> list[str]:
        """The machine-wide identity of each device, in device order (see :func:`node_key`).

        A class without nodes has one logical device, named by the class.
        """
        keys = [node_key(p) for p in self.device_nodes()]
        return [k for k in keys if k is not None] or [f"logical-{self.name}"]

    def size(self) -> int:
        """How many devices this class has here (at least one, a logical one)."""
        return max(1, len(self.device_nodes()))


def node_key(path: str) -> str | None:
    """What one device is, machine-wide: ``c<major>-<minor>`` for a character
    node (``b`` for a block node), ``f<dev>-<inode>`` for a regular file (a
    test's stand-in). None if the path is gone or is something else.

    Every arbiter on the machine names a device's kernel lock by this key, so
    two configurations that reach one node through different paths still
    exclude each other.
    """
    try:
        st = os.stat(path)
    except OSError:
        return None
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        kind = "c" if stat.S_ISCHR(st.st_mode) else "b"
        return f"{kind}{os.major(st.st_rdev)}-{os.minor(st.st_rdev)}"
    if stat.S_ISREG(st.st_mode):
        return f"f{st.st_dev:x}-{st.st_ino}"
    return None


NVIDIA_MAJOR = 195
# Minors 254 (nvidia-modeset) and 255 (nvidiactl) are control nodes, not GPUs.
LAST_GPU_MINOR = 253
DRM_MAJOR = 226


def char_minor(path: str, major: int) -> int | None:
    """The minor number of ``path`` if it is a character node of ``major``, else None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISCHR(st.st_mode) or os.major(st.st_rdev) != major:
        return None
    return os.minor(st.st_rdev)


def _nvidia_render_node(path: str) -> bool:
    """Is ``path`` a DRM node whose GPU the ``nvidia`` driver runs (sysfs says)?"""
    minor = char_minor(path, DRM_MAJOR)
    if minor is None:
        return False
    driver = f"/sys/dev/char/{DRM_MAJOR}:{minor}/device/driver"
    try:
        return os.path.basename(os.readlink(driver)) == "nvidia"
    except OSError:
        return False


def _natural(path: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]


DEFAULT_CLASSES: dict[str, DeviceClass] = {
    "npu": DeviceClass("npu", ("/dev/accel/accel*",)),
    "gpu": DeviceClass(
        "gpu",
        ("/dev/nvidia[0-9]*", "/dev/dri/renderD*"),
        ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/kfd"),
        ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"),
    ),
}

_CLASS_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}", re.ASCII)
_KEYS = ("nodes", "shared_nodes", "visible_env", "allowed_holders")
# What people type for a class's keys.
_SYNONYMS = {
    "node": "nodes",
    "devices": "nodes",
    "paths": "nodes",
    "device_nodes": "nodes",
    "shared": "shared_nodes",
    "control_nodes": "shared_nodes",
    "env": "visible_env",
    "environment": "visible_env",
    "visible_devices": "visible_env",
    "variables": "visible_env",
    "holders": "allowed_holders",
    "allowed": "allowed_holders",
    "allow": "allowed_holders",
}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
# Variables hold sets itself for every command: a class may not name them.
_OWN_ENV = ("PATH", "CUDA_DEVICE_ORDER")
# Variables that change how a program is loaded or run, or where it finds its
# files, rather than which devices it sees: a class that named one would hand
# every command of its leases e.g. ``LD_PRELOAD=0`` or ``HOME=0,1`` (issue 24).
_NOT_VISIBILITY = frozenset(
    (
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "TERM",
        "TZ",
        "LANG",
        "LANGUAGE",
        "TMPDIR",
        "PWD",
        "OLDPWD",
        "IFS",
        "PS4",
        "ENV",
        "BASH_ENV",
        "CDPATH",
        "SHELLOPTS",
        "BASHOPTS",
        "GCONV_PATH",
        "LOCPATH",
        "NLSPATH",
        "HOSTALIASES",
        "RESOLV_HOST_CONF",
        "GLIBC_TUNABLES",
        "NODE_OPTIONS",
        "JAVA_TOOL_OPTIONS",
        "_JAVA_OPTIONS",
        "NOTIFY_SOCKET",
    )
)
_NOT_VISIBILITY_PREFIXES = (
    "LD_",
    "DYLD_",
    "LC_",
    "MALLOC_",
    "PYTHON",
    "PERL",
    "RUBY",
    "BASH_FUNC_",
    "XDG_",
    "SSL_",
)


def classes_from_config(node: Any, path: str | None) -> dict[str, DeviceClass]:
    """The defaults, with classes from the configuration's ``devices:`` replacing them.

    Every value is checked here, with its file:line, before any command asks
    the daemon for anything: a class name, its keys (a "did you mean" for an
    unknown one), node patterns and holders (absolute, normalised, no control
    characters), variable names (``[A-Za-z_][A-Za-z0-9_]*``, none of hold's own).
    Every problem found is reported at once (:func:`hold.config.refusal`).
    """
    out = dict(DEFAULT_CLASSES)
    if node is None:
        return out
    # lazy: PyYAML only for a file parsed here; npu-hold takes the daemon's classes
    import yaml

    def where(n: Any) -> str:
        return f"{path}:{n.start_mark.line + 1}"

    if not isinstance(node, yaml.MappingNode):
        raise BadValue("devices", "(not a mapping)", "a mapping of class names", where(node))
    problems: list[BadValue] = []
    for knode, vnode in node.value:
        name = str(knode.value)
        found = len(problems)
        if not _CLASS_NAME.fullmatch(name):
            problems.append(
                BadValue(
                    "device class name",
                    name,
                    "lower-case letters, digits and _, starting with a letter, "
                    "at most 32 characters",
                    where(knode),
                )
            )
        if not isinstance(vnode, yaml.MappingNode):
            problems.append(
                BadValue(
                    f"devices.{name}",
                    "(not a mapping)",
                    "a mapping with nodes, shared_nodes, visible_env, allowed_holders",
                    where(vnode),
                )
            )
            continue
        fields = _class_fields(name, vnode, where, problems)
        if "nodes" not in fields and not any(str(fk.value) == "nodes" for fk, _ in vnode.value):
            problems.append(
                BadValue(
                    f"devices.{name}", "(no nodes)", "a class needs nodes: [...]", where(vnode)
                )
            )
        if len(problems) == found:
            out[name] = DeviceClass(name, **fields)
    if problems:
        from hold_supervisor.yamlsafe import refusal  # PyYAML: loaded above already

        error = refusal(path, problems)
        assert error is not None
        raise error
    return out


def _class_fields(
    name: str, vnode: Any, where: Callable[[Any], str], problems: list[BadValue]
) -> dict[str, tuple[str, ...]]:
    """A class's lists, by key; each bad key, list or item is added to ``problems``."""
    # lazy: PyYAML only for a file parsed here; npu-hold takes the daemon's classes
    import yaml

    fields: dict[str, tuple[str, ...]] = {}
    for fk, fv in vnode.value:
        key = str(fk.value)
        if key not in _KEYS:
            problems.append(
                BadValue(
                    f"key devices.{name}.",
                    key,
                    "one of " + ", ".join(_KEYS) + did_you_mean(key, _KEYS, _SYNONYMS),
                    where(fk),
                )
            )
            continue
        if not isinstance(fv, yaml.SequenceNode):
            problems.append(
                BadValue(f"devices.{name}.{key}", "(not a list)", "a list of strings", where(fv))
            )
            continue
        items: list[str] = []
        for inode in fv.value:
            if not isinstance(inode, yaml.ScalarNode):
                problems.append(
                    BadValue(
                        f"devices.{name}.{key}",
                        "(a list or mapping)",
                        "a list of strings",
                        where(inode),
                    )
                )
                continue
            item = str(inode.value)
            why = _item_problem(key, item)
            if why:
                problems.append(BadValue(f"devices.{name}.{key}", item, why, where(inode)))
                continue
            items.append(item)
        fields[key] = tuple(items)
    return fields


def classes_from_defs(defs: Mapping[str, Any]) -> dict[str, DeviceClass]:
    """The classes as a daemon sent them (its ``class_defs``): what it grants from.

    Already checked by the daemon when it read its configuration; taken as
    they are (a daemon that sends nonsense gets nonsense back from the grant).
    """
    out: dict[str, DeviceClass] = {}
    for name, d in defs.items():
        if isinstance(d, dict):
            out[str(name)] = DeviceClass(
                str(name), *(tuple(str(v) for v in d.get(k) or ()) for k in _KEYS)
            )
    return out


def _item_problem(key: str, item: str) -> str | None:
    """Why one item of a class's list is refused, or None."""
    if key == "visible_env":
        if not _ENV_NAME.fullmatch(item):
            return "a variable name: letters, digits and _, not starting with a digit"
        if item.startswith("HOLD_") or item in _OWN_ENV:
            return "a variable hold does not set itself (not HOLD_*, " + ", ".join(_OWN_ENV) + ")"
        if item in _NOT_VISIBILITY or item.startswith(_NOT_VISIBILITY_PREFIXES):
            return (
                "a variable that selects devices (CUDA_VISIBLE_DEVICES...), not one that "
                "changes how programs load, run or find their files (LD_*, HOME, PATH, ...)"
            )
        return None
    what = "an absolute path" if key == "allowed_holders" else "an absolute path pattern"
    if any(ord(c) < 32 or ord(c) == 127 for c in item):
        return f"{what} without control characters"
    if not item.startswith("/"):
        return what
    if "/../" in item + "/" or "/./" in item + "/" or "//" in item or item.endswith("/"):
        return f"{what}, normalised (no '.', '..' or empty components, no trailing /)"
    return None


_INDICES = re.compile(r"[0-9]{1,6}(?:,[0-9]{1,6})*", re.ASCII)


def parse_device_spec(
    text: str,
    classes: Mapping[str, DeviceClass],
    *,
    what: str = "--device",
    sizes: Mapping[str, int] | None = None,
) -> tuple[str, tuple[int, ...] | None]:
    """``gpu`` or ``gpu:0,2`` -> ``("gpu", None)`` / ``("gpu", (0, 2))``.

    Strict: ASCII digits only (``int()`` would take ``+1``, `` 1`` and other
    scripts' digits), each index once, each one a device of the class here.
    ``sizes``: each class's device count as the daemon counts them (else
    counted here, by globbing the nodes).
    """
    name, sep, rest = text.partition(":")
    if name not in classes:
        raise BadValue(
            what,
            text,
            "a device class: " + ", ".join(sorted(classes)) + did_you_mean(name, sorted(classes)),
        )
    if not sep:
        return name, None
    count = sizes[name] if sizes is not None and name in sizes else classes[name].size()
    if not _INDICES.fullmatch(rest):
        raise BadValue(what, text, f"CLASS:INDEX[,INDEX...] with indices 0-{count - 1}")
    listed = [int(i) for i in rest.split(",")]
    if len(set(listed)) != len(listed):
        raise BadValue(what, text, "each index once")
    indices = tuple(sorted(listed))
    if any(i >= count for i in indices):
        raise BadValue(what, text, f"indices 0-{count - 1} ({name} has {count} here)")
    return name, indices
