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
from typing import Any, NamedTuple

from supervisor.parse import BadValue


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
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
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
DRM_MAJOR = 226


def _nvidia_render_node(path: str) -> bool:
    """Is ``path`` a DRM node whose GPU the ``nvidia`` driver runs (sysfs says)?"""
    try:
        st = os.stat(path)
    except OSError:
        return False
    if not stat.S_ISCHR(st.st_mode) or os.major(st.st_rdev) != DRM_MAJOR:
        return False
    driver = f"/sys/dev/char/{DRM_MAJOR}:{os.minor(st.st_rdev)}/device/driver"
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

_CLASS_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
_KEYS = ("nodes", "shared_nodes", "visible_env", "allowed_holders")


def classes_from_config(node: Any, path: str | None) -> dict[str, DeviceClass]:
    """The defaults, with classes from the configuration's ``devices:`` replacing them."""
    out = dict(DEFAULT_CLASSES)
    if node is None:
        return out
    import yaml

    def where(n: Any) -> str:
        return f"{path}:{n.start_mark.line + 1}"

    if not isinstance(node, yaml.MappingNode):
        raise BadValue("devices", "(not a mapping)", "a mapping of class names", where(node))
    for knode, vnode in node.value:
        name = str(knode.value)
        if not _CLASS_NAME.fullmatch(name):
            raise BadValue("device class name", name,
                           "lower-case letters, digits and _, starting with a letter",
                           where(knode))  # fmt: skip
        if not isinstance(vnode, yaml.MappingNode):
            raise BadValue(
                f"devices.{name}",
                "(not a mapping)",
                "a mapping with nodes, shared_nodes, visible_env",
                where(vnode),
            )
        fields: dict[str, tuple[str, ...]] = {}
        for fk, fv in vnode.value:
            key = str(fk.value)
            if key not in _KEYS:
                raise BadValue(f"key devices.{name}.", key, "one of " + ", ".join(_KEYS),
                               where(fk))  # fmt: skip
            if not isinstance(fv, yaml.SequenceNode) or not all(
                isinstance(i, yaml.ScalarNode) for i in fv.value
            ):
                raise BadValue(f"devices.{name}.{key}", "(not a list)", "a list of strings",
                               where(fv))  # fmt: skip
            items = tuple(str(i.value) for i in fv.value)
            for item in items:
                if key != "visible_env" and not os.path.isabs(item):
                    raise BadValue(f"devices.{name}.{key}", item, "an absolute path pattern",
                                   where(fv))  # fmt: skip
            fields[key] = items
        if "nodes" not in fields:
            raise BadValue(f"devices.{name}", "(no nodes)", "a class needs nodes: [...]",
                           where(vnode))  # fmt: skip
        out[name] = DeviceClass(name, **fields)
    return out


def parse_device_spec(
    text: str, classes: dict[str, DeviceClass], *, what: str = "--device"
) -> tuple[str, tuple[int, ...] | None]:
    """``gpu`` or ``gpu:0,2`` -> ``("gpu", None)`` / ``("gpu", (0, 2))``."""
    name, sep, rest = text.partition(":")
    if name not in classes:
        raise BadValue(what, text, "a device class: " + ", ".join(sorted(classes)))
    if not sep:
        return name, None
    count = classes[name].size()
    try:
        indices = tuple(sorted({int(i) for i in rest.split(",")}))
    except ValueError:
        raise BadValue(what, text, f"CLASS:INDEX[,INDEX...] with indices 0-{count - 1}") from None
    if not indices or any(i < 0 or i >= count for i in indices):
        raise BadValue(what, text, f"indices 0-{count - 1} ({name} has {count} here)")
    return name, indices
