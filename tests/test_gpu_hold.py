"""``gpu-hold`` against real NVIDIA GPUs: skipped where there is none (CI).

- Inside ``gpu-hold``, ``CUDA_VISIBLE_DEVICES`` is the leased node's UUID
  (from NVML, by the node's minor number) and torch's device 0 is that GPU.
- A CUDA process outside any lease keeps ``gpu-hold`` off its GPU and is named.
- ``--no-wait`` on a free GPU is granted.
- A CUDA process that opens a GPU after a grant the count answered keeps
  the next grant off.

The class is the GPU nodes alone (``/dev/nvidia[0-9]*``), so that the leased
device is an NVIDIA node whatever else (``/dev/dri``) the machine has.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import HOLD, PROGS, grant_checks

pytestmark = [
    pytest.mark.skipif(not glob.glob("/dev/nvidia0"), reason="no NVIDIA GPU on this machine"),
    pytest.mark.real_devices,
]

CONFIG = """\
cgroups: auto
devices:
  gpu:
    nodes: ["/dev/nvidia[0-9]*"]
    shared_nodes: ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    visible_env: [CUDA_VISIBLE_DEVICES, HIP_VISIBLE_DEVICES, ROCR_VISIBLE_DEVICES]
"""
PASS = ["--pass-env", "LD_LIBRARY_PATH", "--pass-env", "CUDA_HOME"]
INSIDE = """\
import json, os, torch
env = {k: os.environ.get(k) for k in
       ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "HOLD_DEVICES", "HOLD_LEASE")}
p = torch.cuda.get_device_properties(0)
print(json.dumps({"env": env, "count": torch.cuda.device_count(),
                  "uuid0": "GPU-" + str(p.uuid), "name0": p.name}))
"""


@pytest.fixture
def gpu_class(isolated_hold: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """This test's configuration: ``gpu`` over the machine's GPU nodes; those nodes."""
    path = isolated_hold / "gpu-config.yaml"
    path.write_text(CONFIG)
    monkeypatch.setenv("HOLD_CONFIG", str(path))
    from hold.devices.classes import DeviceClass

    return DeviceClass("gpu", ("/dev/nvidia[0-9]*",)).device_nodes()


def torch_python() -> str:
    for cand in (sys.executable, "/opt/torch/.venv/bin/python3", "python3"):
        ok = subprocess.run(
            [cand, "-c", "import torch; assert torch.cuda.is_available()"], capture_output=True
        )
        if ok.returncode == 0:
            return cand
    pytest.skip("no Python with a CUDA-enabled torch here")


def uuid_by_minor() -> dict[int, str]:
    """Minor number -> UUID, straight from NVML."""
    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    try:
        out = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            dev = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(dev)
            out[int(pynvml.nvmlDeviceGetMinorNumber(dev))] = (
                uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            )
        return out
    finally:
        pynvml.nvmlShutdown()


def first_free_gpu(gpu_class: list[str]) -> int:
    """The index of the first GPU no process holds, or skip: the tests need one."""
    from hold.daemon.occupancy import holders_of
    from hold.devices.classes import DeviceClass

    cls = DeviceClass("gpu", ("/dev/nvidia[0-9]*",))
    for i in range(len(gpu_class)):
        if not holders_of(cls, [i]).get(i):
            return i
    pytest.skip("every GPU here is held by someone")


def hold_run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HOLD, "run", *args], capture_output=True, text=True, timeout=timeout)


def start_hog(py: str, uuid: str) -> tuple[subprocess.Popen[str], int]:
    """A CUDA process outside any lease holding 256 MiB on the GPU ``uuid``."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": uuid, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    p = subprocess.Popen(
        [py, str(PROGS / "cuda_hog.py"), "256"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert p.stdout is not None
    line = p.stdout.readline()  # bounded by the test timeout; CUDA start-up takes seconds
    if not line.startswith("ready "):
        p.kill()
        p.wait()
        raise AssertionError(f"the CUDA holder did not start: {line!r}")
    return p, int(line.split()[1])


def stop(p: subprocess.Popen[str]) -> None:
    assert p.stdin is not None
    p.stdin.close()
    try:
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


@pytest.mark.timeout(300)
def test_cuda_visible_devices_is_the_leased_gpus_uuid(
    gpu_class: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from hold.devices.gpuids import nvidia_minor

    py = torch_python()
    uuids = uuid_by_minor()
    # The last GPU: on a machine of several, not the one CUDA counts first anyway.
    index = len(gpu_class) - 1
    res = hold_run("--device", f"gpu:{index}", "-l", "uuid-test", *PASS, "--", py, "-c", INSIDE)
    assert res.returncode == 0, res.stderr
    got: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    with capsys.disabled():
        print(f"\n{gpu_class[index]} -> {got}")
    minor = nvidia_minor(gpu_class[index])
    assert minor is not None
    assert got["env"]["HOLD_DEVICES"] == f"gpu:{index}"
    assert got["env"]["CUDA_VISIBLE_DEVICES"] == uuids[minor]
    assert got["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert got["count"] == 1
    assert got["uuid0"] == uuids[minor]


@pytest.mark.timeout(300)
def test_cuda_holder_outside_any_lease_blocks_and_is_named(
    gpu_class: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from hold.devices.gpuids import nvidia_minor

    py = torch_python()
    minor = nvidia_minor(gpu_class[0])
    assert minor is not None
    hog, pid = start_hog(py, uuid_by_minor()[minor])
    try:
        waited = hold_run("--device", "gpu:0", "--wait-timeout", "3", "--", "true")
        no_wait = hold_run("--device", "gpu:0", "--no-wait", "--", "true")
    finally:
        stop(hog)
    with capsys.disabled():
        print(f"\n--wait-timeout 3: exit {waited.returncode}: {waited.stderr.strip()}")
        print(f"--no-wait: exit {no_wait.returncode}: {no_wait.stderr.strip()}")
    for res in (waited, no_wait):
        assert res.returncode == 75, res.stderr
        assert f"pid {pid}" in res.stderr and "OUTSIDE any lease" in res.stderr, res.stderr


@pytest.mark.timeout(300)
def test_no_wait_on_a_free_gpu_is_granted(
    gpu_class: list[str], capsys: pytest.CaptureFixture[str]
) -> None:

    uuid_by_minor()  # NVML there, or skip: the UUID is what is checked
    index = first_free_gpu(gpu_class)
    res = hold_run(
        "--device",
        f"gpu:{index}",
        "--no-wait",
        "--",
        "sh",
        "-c",
        'echo "$HOLD_DEVICES $CUDA_VISIBLE_DEVICES"',
    )
    with capsys.disabled():
        print(
            f"\n--no-wait on gpu:{index}: exit {res.returncode}: "
            f"{res.stdout.strip()} {res.stderr.strip()}"
        )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"gpu:{index} GPU-")


@pytest.mark.timeout(300)
def test_a_users_own_daemon_takes_nvml_as_its_witness(
    gpu_class: list[str], unpriv_user: str, unpriv_runtime: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A user's own daemon cannot read root's processes, so its scan proves no
    GPU free; NVML's list of the processes with a context on it is its witness
    (issue 24): a free GPU is granted, one that root's CUDA process holds is not
    (exit 75), with no ``unreadable_processes: ignore`` anywhere."""
    import tempfile

    from conftest import as_user, stop_daemon, unpriv_python

    from hold.devices.gpuids import nvidia_minor

    py = torch_python()
    index = first_free_gpu(gpu_class)
    base = Path(tempfile.mkdtemp(prefix="hold-nvml-witness-", dir="/tmp"))
    base.chmod(0o755)
    (base / "locks").mkdir(mode=0o1777)
    (base / "locks").chmod(0o1777)
    (base / "config.yaml").write_text(CONFIG)
    (base / "config.yaml").chmod(0o644)
    env = {
        "HOLD_STATE_DIR": str(base / "state"),
        "HOLD_CONFIG": str(base / "config.yaml"),
        "HOLD_LOCK_DIR": str(base / "locks"),
    }
    user_py = unpriv_python()

    def as_them(*args: str) -> subprocess.CompletedProcess[str]:
        argv = as_user(unpriv_user, [user_py, "-m", "hold", *args], unpriv_runtime, env)
        return subprocess.run(argv, capture_output=True, text=True, timeout=120)

    (base / "state").mkdir()
    os.chown(base / "state", *_ids(unpriv_user))
    try:
        granted = as_them("run", "--device", f"gpu:{index}", "--no-wait", "--", "true")
        minor = nvidia_minor(gpu_class[index])
        assert minor is not None
        hog, pid = start_hog(py, uuid_by_minor()[minor])
        try:
            refused = as_them("run", "--device", f"gpu:{index}", "--no-wait", "--", "true")
        finally:
            stop(hog)
        with capsys.disabled():
            print(
                f"\nfree gpu:{index}, a user's daemon: exit {granted.returncode} {granted.stderr}"
            )
            print(f"root's CUDA pid {pid} on it: exit {refused.returncode} {refused.stderr}")
        assert granted.returncode == 0, granted.stderr
        assert refused.returncode == 75, refused.stderr
    finally:
        stop_daemon(base / "state", timeout=10)
        subprocess.run(["rm", "-rf", str(base)], check=False)


def _ids(user: str) -> tuple[int, int]:
    import pwd

    pw = pwd.getpwnam(user)
    return pw.pw_uid, pw.pw_gid


@pytest.mark.timeout(300)
def test_a_cuda_process_that_opens_the_gpu_after_a_counted_grant_is_seen(
    gpu_class: list[str], isolated_hold: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The count on a real GPU node: once a scan has seen the GPU empty, the
    next grant needs only the kernel's count of its open files (the daemon's
    log says ``check: count``); a CUDA process that opens the node after that
    must keep the next grant off (exit 75, named), and once it ends the GPU
    is granted again. Where inotify does not see the driver's opens, the
    count would say empty: this is the test that would show it."""
    from hold.devices.gpuids import nvidia_minor

    py = torch_python()
    index = first_free_gpu(gpu_class)

    def grant() -> subprocess.CompletedProcess[str]:
        return hold_run("--device", f"gpu:{index}", "--no-wait", "--", "true")

    assert grant().returncode == 0  # the scan that starts the count
    second = grant()
    assert second.returncode == 0, second.stderr
    state = isolated_hold / "state"
    assert grant_checks(state)[-1] == "count", grant_checks(state)
    minor = nvidia_minor(gpu_class[index])
    assert minor is not None
    hog, pid = start_hog(py, uuid_by_minor()[minor])
    try:
        refused = grant()
    finally:
        stop(hog)
    again = grant()
    with capsys.disabled():
        checks = grant_checks(state)
        print(f"\ngpu:{index} checks {checks}; CUDA pid {pid}: exit {refused.returncode}")
        print(f"  {refused.stderr.strip()}")
    assert refused.returncode == 75, refused.stderr
    assert f"pid {pid}" in refused.stderr, refused.stderr
    assert again.returncode == 0, again.stderr


# What a container runtime running as root gives a container for --device: its
# own /dev on a tmpfs, every node made again there (cp -a makes each one with
# mknod: the same device numbers, other inodes), bind-mounted over /dev in a
# mount namespace of its own.
CONTAINER_DEV = (
    'mkdir -p "$0" && mount -t tmpfs none "$0" && cp -a /dev/. "$0"/ && '
    'mount --bind "$0" /dev && exec "$@"'
)


@pytest.mark.timeout(300)
def test_a_cuda_process_in_a_containers_own_dev_is_not_granted_over(
    gpu_class: list[str], isolated_hold: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 45 on a real GPU: after a grant the count answered, a CUDA process in
    a mount namespace of its own, through its own node of the GPU, keeps the
    next ``--no-wait`` off (exit 75, named), and ``hold audit`` shows its
    device memory as NVML does."""
    from test_audit_gpu import _nvml_used

    from hold.devices.gpuids import nvidia_minor

    py = torch_python()
    index = first_free_gpu(gpu_class)

    def grant() -> subprocess.CompletedProcess[str]:
        return hold_run("--device", f"gpu:{index}", "--no-wait", "--", "true")

    assert grant().returncode == 0
    assert grant().returncode == 0
    state = isolated_hold / "state"
    assert grant_checks(state)[-1] == "count", grant_checks(state)
    minor = nvidia_minor(gpu_class[index])
    assert minor is not None
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": uuid_by_minor()[minor],
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", CONTAINER_DEV]
    argv += [str(isolated_hold / "ctrdev"), py, str(PROGS / "cuda_hog.py"), "256"]
    hog = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert hog.stdout is not None
        line = hog.stdout.readline()
        assert line.startswith("ready "), line
        pid = int(line.split()[1])
        theirs = os.stat(f"/proc/{pid}/root/dev/nvidia{minor}")
        assert theirs.st_rdev == os.stat(gpu_class[index]).st_rdev
        assert theirs.st_ino != os.stat(gpu_class[index]).st_ino  # another inode
        refused = grant()
        nvml = _nvml_used().get(pid, {})
        audit = subprocess.run(
            [*HOLD, "audit", "--device", "gpu", "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        rows = [r for r in json.loads(audit.stdout)["holders"] if r["pid"] == pid]
    finally:
        stop(hog)
    again = grant()
    with capsys.disabled():
        print(
            f"\ngpu:{index} checks {grant_checks(state)}; CUDA pid {pid}: exit {refused.returncode}"
        )
        print(f"  {refused.stderr.strip()}")
        print(f"  NVML {nvml}; audit {[(r['device'], r['device_memory_bytes']) for r in rows]}")
    assert refused.returncode == 75, refused.stderr
    assert f"pid {pid}" in refused.stderr, refused.stderr
    assert audit.returncode == 1, audit.stderr
    per_device = [r for r in rows if r["index"] is not None]
    assert per_device and all(r["device_memory_bytes"] == nvml.get(minor) for r in per_device)
    assert again.returncode == 0, again.stderr
