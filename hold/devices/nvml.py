"""NVML, the NVIDIA driver's management library, through ctypes: the few calls hold needs.

Not nvidia-ml-py: importing ``pynvml`` takes about 50 ms on a machine with a
large site-packages (it declares the whole API), more than the rest of
``hold audit``; binding these few functions costs under a millisecond. The
structures are NVML's (``nvml.h``), the functions those every driver since
R510 has.

Without the library (no driver) or when it will not start, every function
here answers None, and each GPU or call that fails is left out: the callers
then go without (no device memory, CUDA ordinals instead of UUIDs).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

from hold.errors import HoldError

LIBRARY = "libnvidia-ml.so.1"
SUCCESS = 0
INSUFFICIENT_SIZE = 7  # NVML_ERROR_INSUFFICIENT_SIZE: the count holds the size needed
NOT_AVAILABLE = (1 << 64) - 1  # NVML_VALUE_NOT_AVAILABLE in usedGpuMemory
UUID_SIZE = 96  # NVML_DEVICE_UUID_V2_BUFFER_SIZE
RETRIES = 4  # processes may start between asking for the count and for the list
PROCESS_CALLS = (
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetGraphicsRunningProcesses_v3",
)


class NvmlError(HoldError):
    """An NVML call that did not return NVML_SUCCESS (or is not in this driver: code -1);
    never leaves this module."""

    def __init__(self, name: str, code: int) -> None:
        super().__init__(f"{name}: NVML error {code}")
        self.code = code


class PciInfo(ctypes.Structure):
    """``nvmlPciInfo_t`` (what ``nvmlDeviceGetPciInfo_v3`` fills)."""

    _fields_ = [
        ("busIdLegacy", ctypes.c_char * 16),
        ("domain", ctypes.c_uint),
        ("bus", ctypes.c_uint),
        ("device", ctypes.c_uint),
        ("pciDeviceId", ctypes.c_uint),
        ("pciSubSystemId", ctypes.c_uint),
        ("busId", ctypes.c_char * 32),
    ]


class ProcessInfo(ctypes.Structure):
    """``nvmlProcessInfo_v2_t``, what the ``_v3`` process lists are made of."""

    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


class Utilization(ctypes.Structure):
    """``nvmlUtilization_t``: per cent of the last sample period busy (kernels, memory)."""

    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class Memory(ctypes.Structure):
    """``nvmlMemory_t``, bytes."""

    _fields_ = [
        ("total", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


class GpuFigures(NamedTuple):
    """What a GPU does now: None where NVML does not say (the call failed)."""

    util_percent: int | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None

    def doc(self) -> dict[str, int | None]:
        return self._asdict()


class NvGpu(NamedTuple):
    minor: int  # of /dev/nvidiaN
    uuid: str  # "GPU-..."
    bus_id: str  # "00000000:18:00.0"


def load() -> Any:
    """The driver's library; OSError where there is none (tests put a fake here)."""
    return ctypes.CDLL(LIBRARY)


class Session:
    """NVML between ``nvmlInit_v2`` and ``nvmlShutdown`` (:func:`open_session`)."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib

    def call(self, name: str, *args: Any) -> None:
        try:
            fn = getattr(self.lib, name)
        except AttributeError:  # an older driver
            raise NvmlError(name, -1) from None
        rc = fn(*args)
        if rc != SUCCESS:
            raise NvmlError(name, rc)

    def close(self) -> None:
        try:
            self.call("nvmlShutdown")
        except NvmlError:
            pass

    def handles(self) -> list[ctypes.c_void_p]:
        """Every device's handle, in NVML's index order."""
        count = ctypes.c_uint(0)
        self.call("nvmlDeviceGetCount_v2", ctypes.byref(count))
        out = []
        for i in range(count.value):
            h = ctypes.c_void_p()
            self.call("nvmlDeviceGetHandleByIndex_v2", i, ctypes.byref(h))
            out.append(h)
        return out

    def minor(self, h: ctypes.c_void_p) -> int:
        n = ctypes.c_uint(0)
        self.call("nvmlDeviceGetMinorNumber", h, ctypes.byref(n))
        return n.value

    def uuid(self, h: ctypes.c_void_p) -> str:
        buf = ctypes.create_string_buffer(UUID_SIZE)
        self.call("nvmlDeviceGetUUID", h, buf, UUID_SIZE)
        return buf.value.decode(errors="replace")

    def bus_id(self, h: ctypes.c_void_p) -> str:
        info = PciInfo()
        self.call("nvmlDeviceGetPciInfo_v3", h, ctypes.byref(info))
        return bytes(info.busId).split(b"\0", 1)[0].decode(errors="replace")

    def figures(self, h: ctypes.c_void_p) -> GpuFigures:
        util: int | None = None
        used = total = None
        rates = Utilization()
        try:
            self.call("nvmlDeviceGetUtilizationRates", h, ctypes.byref(rates))
            util = int(rates.gpu)
        except NvmlError:
            pass
        mem = Memory()
        try:
            self.call("nvmlDeviceGetMemoryInfo", h, ctypes.byref(mem))
            used, total = int(mem.used), int(mem.total)
        except NvmlError:
            pass
        return GpuFigures(util, used, total)

    def processes(self, h: ctypes.c_void_p, name: str) -> list[tuple[int, int | None]]:
        """(pid, bytes of device memory or None) of each process in ``name``'s list.

        NVML's protocol: asked with room for none, it answers
        NVML_ERROR_INSUFFICIENT_SIZE and how many there are; asked again
        with that room (and some to spare: processes come and go), the list.
        """
        count = ctypes.c_uint(0)
        infos: Any = None  # NULL
        for _ in range(RETRIES):
            try:
                self.call(name, h, ctypes.byref(count), infos)
            except NvmlError as e:
                if e.code != INSUFFICIENT_SIZE:
                    raise
                count.value += 8
                infos = (ProcessInfo * count.value)()
                continue
            if infos is None:
                return []  # SUCCESS with room for none: there are none
            return [
                (int(p.pid), None if p.usedGpuMemory == NOT_AVAILABLE else int(p.usedGpuMemory))
                for p in infos[: count.value]
            ]
        raise NvmlError(name, INSUFFICIENT_SIZE)  # the list kept growing


def open_session() -> Session | None:
    """NVML started, or None (no library, or it will not start)."""
    try:
        s = Session(load())
        s.call("nvmlInit_v2")
    except (OSError, NvmlError):
        return None
    return s


def gpus() -> list[NvGpu] | None:
    """Every GPU NVML can read, in its index order; None without NVML.

    A GPU NVML may not open (a device cgroup's denial) is left out.
    """
    s = open_session()
    if s is None:
        return None
    try:
        out = []
        for h in s.handles():
            try:
                out.append(NvGpu(s.minor(h), s.uuid(h), s.bus_id(h)))
            except NvmlError:
                continue
        return out
    except NvmlError:
        return None
    finally:
        s.close()


def figures() -> dict[int, GpuFigures] | None:
    """Utilisation and memory of every GPU NVML can read, by minor number; None
    without NVML. One session, about 16 ms on an H200 machine."""
    s = open_session()
    if s is None:
        return None
    out: dict[int, GpuFigures] = {}
    try:
        for h in s.handles():
            try:
                out[s.minor(h)] = s.figures(h)
            except NvmlError:
                continue
    except NvmlError:
        pass  # the devices read so far stand
    finally:
        s.close()
    return out


def _process_lists(s: Session) -> Iterator[tuple[int, list[tuple[int, int | None]] | None]]:
    """Each GPU's minor with one of its process lists (compute, then graphics:
    pid and bytes used, None where NVML does not know); the list None where
    NVML could not give it. A GPU's minor NVML cannot read is its index."""
    for i, h in enumerate(s.handles()):
        try:
            minor = s.minor(h)
        except NvmlError:
            minor = i
        for name in PROCESS_CALLS:
            try:
                yield minor, s.processes(h, name)
            except NvmlError:
                yield minor, None


def used_memory() -> dict[tuple[int, int], int] | None:
    """Bytes of device memory per (pid, GPU minor), compute and graphics summed;
    None without NVML. A process whose use NVML does not know is left out."""
    s = open_session()
    if s is None:
        return None
    out: dict[tuple[int, int], int] = {}
    try:
        for minor, procs in _process_lists(s):
            for pid, used in procs or ():
                if used is not None:
                    out[(pid, minor)] = out.get((pid, minor), 0) + used
    except NvmlError:
        pass  # the devices read so far stand
    finally:
        s.close()
    return out


class Prefetch:
    """:func:`used_memory` in a thread, asked for before it is known to be needed.

    NVML's start and lists take about 16 ms on an H200 machine, about as long
    as the rest of ``hold audit`` after Python's start; ctypes lets go of the
    GIL in each call, so the two overlap. The figures are then read just
    before the scan rather than after it (a process that began to allocate
    meanwhile shows none yet, as it would a moment earlier).
    """

    def __init__(self) -> None:
        self._mem: dict[tuple[int, int], int] | None = None
        # Not a daemon thread: the interpreter waits for it rather than exit
        # while the driver's library is in a call.
        self._thread = threading.Thread(target=self._run, name="nvml")
        self._thread.start()

    def _run(self) -> None:
        self._mem = used_memory()

    def result(self) -> dict[tuple[int, int], int] | None:
        self._thread.join()
        return self._mem


def pids_by_minor() -> dict[int, set[int]] | None:
    """Every process NVML lists with a context on each GPU (by its minor), whoever
    runs it; None without NVML. A GPU one of whose lists NVML could not give is
    missing: no answer is taken for "nobody"."""
    s = open_session()
    if s is None:
        return None
    out: dict[int, set[int]] = {}
    unanswered: set[int] = set()
    try:
        for minor, procs in _process_lists(s):
            if procs is None:
                unanswered.add(minor)
            else:
                out.setdefault(minor, set()).update(pid for pid, _ in procs)
    except NvmlError:
        pass
    finally:
        s.close()
    return {minor: pids for minor, pids in out.items() if minor not in unanswered}
