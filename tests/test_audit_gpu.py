"""``hold audit`` against a real NVIDIA GPU: skipped where there is none (CI).

A CUDA process holding memory must appear with the same pid and the same
device memory that NVML reports for it; one started under ``gpu-hold`` is
covered by its lease, one started outside is STRAY. NVML's own answers come
from nvidia-ml-py (where installed), not from hold.devices.nvml, which they check.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HOLD, PROGS, wait_for

pytestmark = [
    pytest.mark.skipif(not glob.glob("/dev/nvidia[0-9]*"), reason="no NVIDIA GPU on this machine"),
    pytest.mark.real_devices,  # the built-in gpu class: the machine's own GPUs
]

HOG_MIB = 1024


def _torch_python() -> str:
    for cand in (sys.executable, "/opt/torch/.venv/bin/python3", "python3"):
        ok = subprocess.run(
            [cand, "-c", "import torch; assert torch.cuda.is_available()"], capture_output=True
        )
        if ok.returncode == 0:
            return cand
    pytest.skip("no Python with a CUDA-enabled torch here")


def _nvml_used() -> dict[int, dict[int, int]]:
    """pid -> {device minor: bytes}, straight from NVML."""
    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    try:
        out: dict[int, dict[int, int]] = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            dev = pynvml.nvmlDeviceGetHandleByIndex(i)
            minor = int(pynvml.nvmlDeviceGetMinorNumber(dev))
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(dev):
                if p.usedGpuMemory is not None:
                    out.setdefault(int(p.pid), {})[minor] = int(p.usedGpuMemory)
        return out
    finally:
        pynvml.nvmlShutdown()


def _audit() -> tuple[int, dict[str, object]]:
    res = subprocess.run(
        [*HOLD, "audit", "--device", "gpu", "--json"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode in (0, 1), res.stderr
    return res.returncode, json.loads(res.stdout)


def _start(argv: list[str]) -> tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()  # bounded by the test timeout; CUDA start-up takes seconds
    assert line.startswith("ready "), line
    return p, int(line.split()[1])


def _stop(p: subprocess.Popen[str]) -> None:
    assert p.stdin is not None
    p.stdin.close()
    p.wait(timeout=60)


@pytest.mark.timeout(300)
def test_stray_cuda_process_matches_nvml(capsys: pytest.CaptureFixture[str]) -> None:
    py = _torch_python()
    p, pid = _start([py, str(PROGS / "cuda_hog.py"), str(HOG_MIB)])
    try:
        nvml = wait_for(lambda: _nvml_used().get(pid), timeout=30, what="NVML to list the hog")
        code, doc = _audit()
        rows = [r for r in doc["holders"] if r["pid"] == pid]  # type: ignore[index,union-attr]
        with capsys.disabled():
            print(f"\nNVML: pid {pid} uses {nvml}")
            for r in rows:
                print(
                    f"audit: {r['device']} {r['node']} how={r['how']} "
                    f"devmem={r['device_memory_bytes']} covered={r['covered']} why={r['why']}"
                )
        assert code == 1, doc
        assert rows, f"pid {pid} not found by the audit"
        per_device = [r for r in rows if r["index"] is not None]
        assert per_device, rows
        for r in per_device:
            assert r["covered"] is False and "no live lease" in r["why"]
            assert r["device_memory_bytes"] == nvml.get(r["index"]), (r, nvml)
        assert sum(nvml.values()) >= HOG_MIB * 1024 * 1024
    finally:
        _stop(p)


@pytest.mark.timeout(300)
def test_gpu_hold_covers_and_outside_is_stray(tmp_path: Path) -> None:
    py = _torch_python()
    hold_run = [
        *HOLD,
        "run",
        "--device",
        "gpu",
        "-l",
        "gpu-test",
        "--grace",
        "5s",
        "--pass-env",
        "LD_LIBRARY_PATH",
        "--pass-env",
        "CUDA_HOME",
        "--",
    ]
    inside, inside_pid = _start([*hold_run, py, str(PROGS / "cuda_hog.py"), str(HOG_MIB)])
    outside, outside_pid = _start([py, str(PROGS / "cuda_hog.py"), "256"])
    try:
        code, doc = _audit()
        by_pid: dict[int, list[dict[str, object]]] = {}
        for r in doc["holders"]:  # type: ignore[union-attr]
            by_pid.setdefault(int(r["pid"]), []).append(r)
        assert code == 1, doc
        assert by_pid.get(inside_pid) and all(r["covered"] for r in by_pid[inside_pid])
        assert all(r["label"] == "gpu-test" for r in by_pid[inside_pid])
        assert by_pid.get(outside_pid) and not any(r["covered"] for r in by_pid[outside_pid])
        env = Path(f"/proc/{inside_pid}/environ").read_bytes().split(b"\0")
        assert any(e.startswith(b"CUDA_VISIBLE_DEVICES=") for e in env)
    finally:
        _stop(outside)
        _stop(inside)
    assert not os.path.exists(f"/proc/{inside_pid}/status") or (
        "Z" in Path(f"/proc/{inside_pid}/status").read_text().split("State:")[1][:5]
    )


def test_nvml_module_matches_nvidia_ml_py() -> None:
    """hold.devices.nvml (ctypes) tells what nvidia-ml-py tells: minor, UUID, PCI bus id."""
    from hold.devices import nvml

    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    try:
        want = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            dev = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid, bus = pynvml.nvmlDeviceGetUUID(dev), pynvml.nvmlDeviceGetPciInfo(dev).busId
            want.append(
                nvml.NvGpu(
                    int(pynvml.nvmlDeviceGetMinorNumber(dev)),
                    uuid.decode() if isinstance(uuid, bytes) else uuid,
                    bus.decode() if isinstance(bus, bytes) else bus,
                )
            )
    finally:
        pynvml.nvmlShutdown()
    assert nvml.gpus() == want
