"""hold.devices.nvml without a GPU: the ctypes calls against a fake driver library that
answers as NVML does (return codes, the count-then-list protocol of the process
lists), and the structures' sizes against ``nvml.h``. Against the real driver:
tests/test_audit_gpu.py (beside nvidia-ml-py's answers)."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from hold.devices import nvml
from hold.devices.nvml import NOT_AVAILABLE, NvGpu

NO_PERMISSION = 4
DRIVER_NOT_LOADED = 9

# minor -> (uuid, PCI bus id)
GPUS = {
    0: ("GPU-aaaa1111-0000-0000-0000-000000000000", "00000000:3B:00.0"),
    3: ("GPU-bbbb2222-0000-0000-0000-000000000000", "00000000:18:00.0"),
}


class FakeLib:
    """NVML as the driver's library answers, through ctypes' arguments."""

    def __init__(self, procs: dict[int, list[tuple[int, int]]] | None = None) -> None:
        self.order = sorted(GPUS, reverse=True)  # NVML's index order
        self.procs = procs or {}  # minor -> compute processes (pid, bytes)
        self.init_rc = 0
        self.fail: dict[tuple[str, int], int] = {}  # (call, minor) -> return code
        self.grow: dict[int, int] = {}  # minor -> processes started between count and list
        # (-1: always one more than there is room for)
        self.shutdowns = 0

    def nvmlInit_v2(self) -> int:
        return self.init_rc

    def nvmlShutdown(self) -> int:
        self.shutdowns += 1
        return 0

    def nvmlDeviceGetCount_v2(self, count: Any) -> int:
        count._obj.value = len(self.order)
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, i: int, handle: Any) -> int:
        handle._obj.value = 0x1000 + self.order[i]
        return 0

    def _minor(self, name: str, h: ctypes.c_void_p) -> tuple[int, int]:
        minor = int(h.value or 0) - 0x1000
        return minor, self.fail.get((name, minor), 0)

    def nvmlDeviceGetMinorNumber(self, h: ctypes.c_void_p, out: Any) -> int:
        minor, rc = self._minor("minor", h)
        out._obj.value = minor
        return rc

    def nvmlDeviceGetUUID(self, h: ctypes.c_void_p, buf: Any, size: int) -> int:
        minor, rc = self._minor("uuid", h)
        assert size == len(buf) == 96
        buf.value = GPUS[minor][0].encode()
        return rc

    def nvmlDeviceGetPciInfo_v3(self, h: ctypes.c_void_p, info: Any) -> int:
        minor, rc = self._minor("pci", h)
        info._obj.busId = GPUS[minor][1].encode()
        return rc

    def nvmlDeviceGetComputeRunningProcesses_v3(
        self, h: ctypes.c_void_p, count: Any, infos: Any
    ) -> int:
        minor, rc = self._minor("compute", h)
        procs = self.procs.get(minor, [])
        if rc:
            return rc
        room = count._obj.value if infos is not None else 0
        grow = self.grow.get(minor, 0)
        if grow < 0:  # one more each time than there is room for
            procs = procs + [(90000 + i, 1) for i in range(room + 1 - len(procs))]
        elif grow and infos is not None:
            procs = procs + [(90000 + i, 1) for i in range(grow)]
            self.grow[minor] = max(0, grow - 8)
        count._obj.value = len(procs)
        if len(procs) > room:
            return nvml.INSUFFICIENT_SIZE
        for i, (pid, used) in enumerate(procs):
            infos[i].pid = pid
            infos[i].usedGpuMemory = used
        return 0

    def nvmlDeviceGetUtilizationRates(self, h: ctypes.c_void_p, util: Any) -> int:
        minor, rc = self._minor("util", h)
        util._obj.gpu, util._obj.memory = 30 + minor, 7
        return rc

    def nvmlDeviceGetMemoryInfo(self, h: ctypes.c_void_p, mem: Any) -> int:
        minor, rc = self._minor("memory", h)
        mem._obj.total, mem._obj.free, mem._obj.used = (
            80 << 30,
            (80 << 30) - (minor << 20),
            minor << 20,
        )
        return rc

    def nvmlDeviceGetGraphicsRunningProcesses_v3(
        self, h: ctypes.c_void_p, count: Any, infos: Any
    ) -> int:
        count._obj.value = 0  # none drawing
        return 0


@pytest.fixture
def lib(monkeypatch: pytest.MonkeyPatch) -> FakeLib:
    fake = FakeLib({0: [(100, 5 << 20), (101, NOT_AVAILABLE)], 3: [(100, 7 << 20), (102, 1)]})
    monkeypatch.setattr(nvml, "load", lambda: fake)
    return fake


def test_structures_are_nvml_h() -> None:
    assert ctypes.sizeof(nvml.ProcessInfo) == 24  # nvmlProcessInfo_v2_t
    assert ctypes.sizeof(nvml.PciInfo) == 68  # nvmlPciInfo_t


def test_figures(lib: FakeLib) -> None:
    """Utilisation and memory by minor; a call that fails leaves its figure None."""
    assert ctypes.sizeof(nvml.Utilization) == 8 and ctypes.sizeof(nvml.Memory) == 24
    got = nvml.figures()
    assert got == {
        3: nvml.GpuFigures(33, 3 << 20, 80 << 30),
        0: nvml.GpuFigures(30, 0, 80 << 30),
    }
    assert got[3].doc() == {
        "util_percent": 33,
        "memory_used_bytes": 3 << 20,
        "memory_total_bytes": 80 << 30,
    }
    assert lib.shutdowns == 1
    lib.fail[("util", 3)] = NO_PERMISSION
    lib.fail[("minor", 0)] = NO_PERMISSION  # no minor: the GPU cannot be named, left out
    assert nvml.figures() == {3: nvml.GpuFigures(None, 3 << 20, 80 << 30)}
    lib.init_rc = DRIVER_NOT_LOADED
    assert nvml.figures() is None


def test_gpus(lib: FakeLib) -> None:
    assert nvml.gpus() == [NvGpu(3, *GPUS[3]), NvGpu(0, *GPUS[0])]
    assert lib.shutdowns == 1


def test_used_memory(lib: FakeLib) -> None:
    # Per (pid, minor); a process whose use NVML does not know is left out.
    assert nvml.used_memory() == {(100, 0): 5 << 20, (100, 3): 7 << 20, (102, 3): 1}
    assert lib.shutdowns == 1


def test_a_list_that_grows_is_asked_again(lib: FakeLib) -> None:
    lib.grow[0] = 12  # 12 start after the count, 4 of them after the next
    mem = nvml.used_memory()
    assert mem is not None and (90003, 0) in mem and (100, 0) in mem


def test_a_list_that_keeps_growing_is_left_out(lib: FakeLib) -> None:
    lib.grow[0] = -1
    mem = nvml.used_memory()
    assert mem is not None and (102, 3) in mem and (100, 0) not in mem


def test_failing_calls_leave_out_what_they_would_tell(lib: FakeLib) -> None:
    lib.fail[("uuid", 3)] = NO_PERMISSION  # a GPU the device cgroup denies
    assert nvml.gpus() == [NvGpu(0, *GPUS[0])]
    lib.fail[("compute", 3)] = NO_PERMISSION
    lib.fail[("minor", 0)] = NO_PERMISSION  # then its NVML index stands in (1)
    assert nvml.used_memory() == {(100, 1): 5 << 20}


def test_an_older_driver_without_a_call(lib: FakeLib, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(FakeLib, "nvmlDeviceGetPciInfo_v3")
    monkeypatch.delattr(FakeLib, "nvmlDeviceGetComputeRunningProcesses_v3")
    assert nvml.gpus() == []
    assert nvml.used_memory() == {}


def test_no_nvml(lib: FakeLib, monkeypatch: pytest.MonkeyPatch) -> None:
    lib.init_rc = DRIVER_NOT_LOADED
    assert nvml.gpus() is None and nvml.used_memory() is None
    assert lib.shutdowns == 0  # never started

    def no_library() -> None:
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setattr(nvml, "load", no_library)
    assert nvml.gpus() is None and nvml.used_memory() is None


def test_pids_by_minor_takes_no_unanswered_list_for_nobody(lib: FakeLib) -> None:
    """Every listed process per GPU, its use known or not (101's is not: it is
    no figure of used_memory, but a holder all the same); a GPU one of whose
    lists failed is missing, never shown empty."""
    assert nvml.pids_by_minor() == {0: {100, 101}, 3: {100, 102}}
    assert (101, 0) not in (nvml.used_memory() or {})
    lib.fail[("compute", 3)] = NO_PERMISSION
    assert nvml.pids_by_minor() == {0: {100, 101}}
    lib.init_rc = DRIVER_NOT_LOADED
    assert nvml.pids_by_minor() is None
