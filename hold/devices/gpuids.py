"""Which GPU a command is told it has, and which devices a caller may lease.

CUDA numbers GPUs in an order of its own (fastest first, unless
``CUDA_DEVICE_ORDER=PCI_BUS_ID``), counting only the GPUs the process may
open, while a lease names device nodes (``/dev/nvidiaN``, N being the
driver's minor number). A GPU's UUID names it whatever the order: NVML maps
the node's minor number to it (:mod:`hold.devices.nvml`, the driver's library).

Nothing here is imported on the hot path, and NVML only for classes whose
nodes are NVIDIA nodes (character major 195, matched by device number, not
by path). Nothing is cached: each call asks the kernel and NVML afresh.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from hold.devices.classes import LAST_GPU_MINOR, NVIDIA_MAJOR, DeviceClass, char_minor

# Every GPU node of the machine, whatever a class names: CUDA counts them all.
NVIDIA_NODES = "/dev/nvidia[0-9]*"
# Variables that take NVIDIA GPU UUIDs (the container toolkit's too).
UUID_VARS = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")


class Gpu(NamedTuple):
    minor: int  # of /dev/nvidiaN
    uuid: str  # "GPU-..."
    bus: tuple[int, ...]  # PCI domain, bus, device, function


def nvidia_minor(path: str) -> int | None:
    """The GPU minor number of ``path`` if it is an NVIDIA GPU node, else None."""
    minor = char_minor(path, NVIDIA_MAJOR)
    return minor if minor is not None and minor <= LAST_GPU_MINOR else None


def can_use(path: str) -> bool:
    """May this process open ``path`` for reading and writing?

    ``access(2)`` consults the permission bits and the device cgroup (both
    cgroup v1's ``devices`` and v2's BPF programs), without opening the node.
    """
    return os.access(path, os.R_OK | os.W_OK)


def nvml_gpus() -> list[Gpu] | None:
    """Every GPU NVML can read; None without NVML (no driver).

    A GPU NVML may not open (a device cgroup's denial) is left out.
    """
    # lazy: NVML (ctypes) only when NVIDIA GPUs are asked about; off npu-hold's path
    from hold.devices import nvml

    found = nvml.gpus()
    if found is None:
        return None
    return [Gpu(g.minor, g.uuid, _bus(g.bus_id)) for g in found]


def _bus(bus_id: str) -> tuple[int, ...]:
    """``"00000000:18:00.0"`` -> ``(0, 0x18, 0, 0)``; unparsable ids sort last."""
    try:
        dom, bus, rest = bus_id.strip().split(":")
        dev, fn = rest.split(".")
        return (int(dom, 16), int(bus, 16), int(dev, 16), int(fn, 16))
    except ValueError:
        return (1 << 32,)


def cuda_order(extra_nodes: Sequence[str] = (), gpus: list[Gpu] | None = None) -> list[int]:
    """The minor numbers of the GPUs this process's CUDA counts, by CUDA ordinal.

    CUDA counts the GPUs whose nodes the process may open. With NVML (``gpus``)
    they are in PCI bus order, which is CUDA's with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
    (and CUDA's default order too where the GPUs are all alike); without it, in
    minor-number order (the driver's probe order, normally the bus order).
    """
    usable: set[int] = set()
    known: set[int] = set()
    for path in [*glob.glob(NVIDIA_NODES), *extra_nodes]:
        minor = nvidia_minor(path)
        if minor is not None:
            known.add(minor)
            if can_use(path):
                usable.add(minor)
    if gpus is None:
        return sorted(usable)
    # A GPU NVML reads but whose node is not here: NVML opened it, so may we.
    return [
        g.minor
        for g in sorted(gpus, key=lambda g: g.bus)
        if g.minor in usable or g.minor not in known
    ]


def visible_env(cls: DeviceClass, indices: Sequence[int]) -> dict[str, str]:
    """The class's visible-devices variables for a command granted ``indices``.

    Every variable names the device indices (``"0,2"``), as for any class,
    except on NVIDIA nodes: there ``CUDA_VISIBLE_DEVICES`` (and
    ``NVIDIA_VISIBLE_DEVICES``, where the class names them) name the granted
    GPUs by UUID (``GPU-...``, from NVML by the node's minor number), with
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so CUDA's own order cannot pick another
    GPU. Without NVML they name the granted GPUs by CUDA ordinal (see
    :func:`cuda_order`). A granted node that is no NVIDIA GPU is left out of
    them: CUDA must not see a GPU that was not leased (an empty value hides
    every GPU from CUDA).
    """
    plain = ",".join(str(i) for i in indices)
    env = dict.fromkeys(cls.visible_env, plain)
    names = [n for n in cls.visible_env if n in UUID_VARS]
    if not names:
        return env
    nodes = cls.device_nodes()
    minors = [nvidia_minor(p) for p in nodes]
    if all(m is None for m in minors):
        return env
    granted = [m for i in indices if 0 <= i < len(nodes) and (m := minors[i]) is not None]
    gpus = nvml_gpus() if granted else None
    by_minor = {g.minor: g.uuid for g in gpus or ()}
    if gpus is not None and all(m in by_minor for m in granted):
        value = ",".join(by_minor[m] for m in granted)
    else:
        order = cuda_order(nodes, gpus)
        value = ",".join(str(order.index(m)) for m in granted if m in order)
    for name in names:
        env[name] = value
    if "CUDA_VISIBLE_DEVICES" in names:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    return env


def parse_visible(value: str) -> list[int | str]:
    """``CUDA_VISIBLE_DEVICES`` as CUDA reads it: ordinals and UUIDs, in order.

    Entries are comma-separated ordinals (``0``) or UUIDs (``GPU-...`` or
    ``MIG-...``, a unique prefix being enough); CUDA ignores everything from
    the first entry that is neither, so reading stops there. An empty value
    names no device.
    """
    out: list[int | str] = []
    for raw in value.split(","):
        entry = raw.strip()
        if entry.isascii() and entry.isdigit():
            out.append(int(entry))
        elif entry.startswith(("GPU-", "MIG-")) and len(entry) > 4:
            out.append(entry)
        else:
            break
    return out


def restricting_var(cls: DeviceClass) -> str | None:
    """The variable through which a caller's environment restricts ``cls``."""
    if "CUDA_VISIBLE_DEVICES" in cls.visible_env:
        return "CUDA_VISIBLE_DEVICES"
    return cls.visible_env[0] if cls.visible_env else None


def usable_indices(cls: DeviceClass, environ: Mapping[str, str]) -> list[int] | None:
    """The indices of ``cls``'s devices that the caller may use; None: all of them.

    Inside an allocation (a Slurm job, a container) only some devices are the
    caller's:

    - a node the caller may not open for reading and writing (permissions,
      or a device cgroup that denies it; see :func:`can_use`) is not usable;
    - where the caller's environment sets the class's variable
      (:func:`restricting_var`: ``CUDA_VISIBLE_DEVICES`` for the ``gpu``
      class), only the devices it names are usable, and an empty value names
      none. For NVIDIA nodes the entries are read as CUDA reads them
      (:func:`parse_visible`): a UUID is matched through NVML; an ordinal
      counts the GPUs the caller may open, in PCI bus order with NVML, in
      minor-number order without it (so without NVML, where every node may be
      opened, ordinal N is ``/dev/nvidiaN``); CUDA's default order
      (``FASTEST_FIRST``) differs from both only on machines with unlike
      GPUs. Without NVML a UUID cannot be matched and ends the list, as an
      invalid entry does for CUDA; so does a MIG instance (a lease is for a
      whole GPU). For other classes the entries are ordinals counting the
      usable nodes in device order.
    """
    nodes = cls.device_nodes()
    if not nodes:
        return None  # one logical device, nothing to restrict
    ok = [i for i, p in enumerate(nodes) if can_use(p)]
    var = restricting_var(cls)
    value = environ.get(var) if var is not None else None
    if value is None:
        return None if len(ok) == len(nodes) else ok
    entries = parse_visible(value)
    minors = [nvidia_minor(p) for p in nodes]
    named: set[int] = set()
    if var in UUID_VARS and any(m is not None for m in minors):
        gpus = nvml_gpus()
        order = cuda_order(nodes, gpus)
        chosen: set[int] = set()
        for entry in entries:
            if isinstance(entry, int):
                if entry >= len(order):
                    break
                chosen.add(order[entry])
            else:
                match = [g.minor for g in gpus or () if g.uuid.lower().startswith(entry.lower())]
                if entry.startswith("MIG-") or len(match) != 1:
                    break
                chosen.add(match[0])
        named = {i for i, m in enumerate(minors) if m is not None and m in chosen}
    else:
        for entry in entries:
            if not isinstance(entry, int) or entry >= len(ok):
                break
            named.add(ok[entry])
    return sorted(named & set(ok))


def why_unusable(cls: DeviceClass, environ: Mapping[str, str], wanted: int) -> str:
    """Why a caller may use fewer of ``cls``'s devices than the ``wanted`` it asks
    for (see :func:`usable_indices`), in words: the nodes it may not open, the
    variable that names the others, and inside a Slurm job, what the job was given."""
    nodes = cls.device_nodes()
    allowed = usable_indices(cls, environ)
    have = "none" if not allowed else ", ".join(f"{cls.name}:{i}" for i in allowed or ())
    parts = [f"cannot lease {wanted} {cls.name} device(s) from here: this process may use {have}"]
    denied = [p for p in nodes if not can_use(p)]
    if denied:
        parts.append(
            "the device cgroup (or the files' permissions) denies "
            + ", ".join(denied[:4])
            + (f" and {len(denied) - 4} more" if len(denied) > 4 else "")
        )
    var = restricting_var(cls)
    if var is not None and var in environ:
        parts.append(f"{var}={environ[var]!r} names the devices it may use")
    job = environ.get("SLURM_JOB_ID")
    if job is not None:
        gpus = environ.get("SLURM_STEP_GPUS", environ.get("SLURM_JOB_GPUS"))
        given = f"GPU(s) {gpus}" if gpus else "no GPU"
        parts.append(
            f"Slurm job {job} was given {given}: ask for them with "
            f"srun/sbatch --gres={cls.name}:{wanted}"
        )
    return "; ".join(parts)
