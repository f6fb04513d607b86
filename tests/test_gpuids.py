"""hold.devices.gpuids without a GPU: CUDA_VISIBLE_DEVICES as CUDA reads it, the UUIDs a
command is given (NVML stood in for by a fake ``hold.devices.nvml.gpus``), and which devices a
caller inside an allocation may lease (nodes it may not open, a restricting
variable).

NVIDIA nodes are made with mknod (major 195) in the test's directory, where
that is allowed (root); the machine's own /dev/nvidia* are kept out of it.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import as_user, unpriv_python

import hold.devices.nvml
from hold.devices import gpuids
from hold.devices.classes import DeviceClass
from hold.devices.gpuids import nvidia_minor, parse_visible, usable_indices, visible_env
from hold.devices.nvml import NvGpu

CUDA_ENV = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")

# minor -> (uuid, PCI bus id); the bus order (1, 0, 2) differs from the minors'.
GPUS = {
    0: ("GPU-aaaa1111-0000-0000-0000-000000000000", "00000000:3B:00.0"),
    1: ("GPU-bbbb2222-0000-0000-0000-000000000000", "00000000:18:00.0"),
    2: ("GPU-bbbc3333-0000-0000-0000-000000000000", "00000000:86:00.0"),
}


def fake_gpus(gpus: dict[int, tuple[str, str]]) -> Callable[[], list[NvGpu]]:
    """``hold.devices.nvml.gpus`` on a machine with these GPUs."""
    order = sorted(gpus, reverse=True)  # NVML's index order: neither minors' nor the bus's
    return lambda: [NvGpu(m, *gpus[m]) for m in order]


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hold.devices.nvml, "gpus", fake_gpus(GPUS))


@pytest.fixture
def no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_library() -> None:
        raise OSError(f"{hold.devices.nvml.LIBRARY}: cannot open shared object file")

    monkeypatch.setattr(
        hold.devices.nvml, "load", no_library
    )  # no driver: hold.devices.nvml.gpus() is None


@pytest.fixture
def nv_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """/dev/nvidia0..2 stand-ins: character nodes 195:0..2 in the test's directory."""
    d = tmp_path / "nvdev"
    d.mkdir()
    paths = []
    for minor in range(3):
        p = d / f"nvidia{minor}"
        try:
            os.mknod(p, stat.S_IFCHR | 0o600, os.makedev(gpuids.NVIDIA_MAJOR, minor))
        except OSError as e:
            pytest.skip(f"cannot make a character node here: {e}")
        paths.append(str(p))
    monkeypatch.setattr(gpuids, "NVIDIA_NODES", f"{d}/nvidia[0-9]*")
    return paths


def nv_class(nodes: list[str], visible: tuple[str, ...] = CUDA_ENV) -> DeviceClass:
    return DeviceClass("gpu", (f"{os.path.dirname(nodes[0])}/nvidia[0-9]*",), (), visible)


def file_class(tmp_path: Path, n: int = 3, visible: tuple[str, ...] = CUDA_ENV) -> DeviceClass:
    for i in range(n):
        (tmp_path / f"fakedev{i}").write_bytes(b"")
    return DeviceClass("fake", (f"{tmp_path}/fakedev*",), (), visible)


# --------------------------------------------------------------------------
# Reading CUDA_VISIBLE_DEVICES and node numbers.


@pytest.mark.parametrize(
    ("value", "entries"),
    [
        ("", []),
        ("0", [0]),
        ("2,0", [2, 0]),
        (" 1 , 3", [1, 3]),
        ("GPU-abc,1", ["GPU-abc", 1]),
        ("MIG-xyz", ["MIG-xyz"]),
        ("0,-1,2", [0]),  # CUDA ignores everything from an invalid entry on
        ("1,,2", [1]),
        ("GPU-", []),
        ("abc,0", []),
        ("٣", []),  # a non-ASCII digit is no ordinal
    ],
)
def test_parse_visible(value: str, entries: list[int | str]) -> None:
    assert parse_visible(value) == entries


def test_nvidia_minor(tmp_path: Path, nv_nodes: list[str]) -> None:
    assert [nvidia_minor(p) for p in nv_nodes] == [0, 1, 2]
    ctl = tmp_path / "nvidiactl"
    os.mknod(ctl, stat.S_IFCHR | 0o600, os.makedev(gpuids.NVIDIA_MAJOR, 255))
    assert nvidia_minor(str(ctl)) is None  # a control node, not a GPU
    other = tmp_path / "accel0"
    os.mknod(other, stat.S_IFCHR | 0o600, os.makedev(261, 0))
    assert nvidia_minor(str(other)) is None
    (tmp_path / "file").write_bytes(b"")
    assert nvidia_minor(str(tmp_path / "file")) is None
    assert nvidia_minor(str(tmp_path / "missing")) is None


# --------------------------------------------------------------------------
# What the command is told.


def test_visible_env_other_classes_keep_indices(tmp_path: Path, nvml: None) -> None:
    cls = file_class(tmp_path)
    assert visible_env(cls, [0, 2]) == dict.fromkeys(CUDA_ENV, "0,2")
    assert visible_env(cls._replace(visible_env=()), [1]) == {}
    logical = DeviceClass("none", (f"{tmp_path}/nothing*",), (), ("CUDA_VISIBLE_DEVICES",))
    assert visible_env(logical, [0]) == {"CUDA_VISIBLE_DEVICES": "0"}


def test_visible_env_names_nvidia_gpus_by_uuid(nv_nodes: list[str], nvml: None) -> None:
    env = visible_env(nv_class(nv_nodes), [2, 0])
    assert env == {
        "CUDA_VISIBLE_DEVICES": f"{GPUS[2][0]},{GPUS[0][0]}",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "HIP_VISIBLE_DEVICES": "2,0",
        "ROCR_VISIBLE_DEVICES": "2,0",
    }
    env = visible_env(nv_class(nv_nodes, ("NVIDIA_VISIBLE_DEVICES",)), [1])
    assert env == {"NVIDIA_VISIBLE_DEVICES": GPUS[1][0]}  # no CUDA variable, no order


def test_visible_env_without_nvml_gives_cuda_ordinals(nv_nodes: list[str], no_nvml: None) -> None:
    env = visible_env(nv_class(nv_nodes), [2])
    assert env["CUDA_VISIBLE_DEVICES"] == "2"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_visible_env_nvml_missing_a_gpu_falls_back_to_bus_order(
    nv_nodes: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # NVML reads minors 0 and 1 only: minor 2 has no UUID, so ordinals, in bus
    # order (minor 1 is on bus 0x18, minor 0 on 0x3b). A GPU NVML cannot read
    # is one CUDA cannot use either: left out.
    monkeypatch.setattr(hold.devices.nvml, "gpus", fake_gpus({m: GPUS[m] for m in (0, 1)}))
    cls = nv_class(nv_nodes)
    assert visible_env(cls, [0])["CUDA_VISIBLE_DEVICES"] == GPUS[0][0]
    assert visible_env(cls, [2, 0])["CUDA_VISIBLE_DEVICES"] == "1"


def test_visible_env_only_counts_nodes_the_caller_can_open(
    nv_nodes: list[str], no_nvml: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A Slurm job whose cgroup allows only /dev/nvidia2: CUDA there sees one GPU, ordinal 0.
    monkeypatch.setattr(gpuids, "can_use", lambda p: p.endswith("nvidia2"))
    assert visible_env(nv_class(nv_nodes), [2])["CUDA_VISIBLE_DEVICES"] == "0"


def test_visible_env_hides_nvidia_gpus_that_were_not_granted(
    tmp_path: Path, nv_nodes: list[str], nvml: None
) -> None:
    # One class over NVIDIA nodes and another kind of node: granting the other
    # one must not let CUDA see any NVIDIA GPU.
    (tmp_path / "nvdev" / "nvidiaz").write_bytes(b"")  # sorts after nvidia2: index 3
    cls = DeviceClass("gpu", (f"{tmp_path}/nvdev/nvidia*",), (), CUDA_ENV)
    assert len(cls.device_nodes()) == 4
    env = visible_env(cls, [3])
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["HIP_VISIBLE_DEVICES"] == "3"


# --------------------------------------------------------------------------
# What a caller may lease.


def test_usable_without_restriction(tmp_path: Path, nvml: None) -> None:
    assert usable_indices(file_class(tmp_path), {}) is None
    logical = DeviceClass("none", (f"{tmp_path}/nothing*",), (), CUDA_ENV)
    assert usable_indices(logical, {"CUDA_VISIBLE_DEVICES": ""}) is None


@pytest.mark.parametrize(
    ("value", "usable"),
    [("", []), ("1", [1]), ("2,0", [0, 2]), ("0,9,1", [0]), ("GPU-x,1", []), ("7", [])],
)
def test_usable_other_classes_by_ordinal(tmp_path: Path, value: str, usable: list[int]) -> None:
    assert usable_indices(file_class(tmp_path), {"CUDA_VISIBLE_DEVICES": value}) == usable


def test_usable_other_classes_first_variable(tmp_path: Path) -> None:
    cls = file_class(tmp_path, visible=("ASCEND_RT_VISIBLE_DEVICES", "OTHER"))
    assert usable_indices(cls, {"CUDA_VISIBLE_DEVICES": ""}) is None
    assert usable_indices(cls, {"OTHER": "0"}) is None
    assert usable_indices(cls, {"ASCEND_RT_VISIBLE_DEVICES": "2"}) == [2]


def test_usable_node_that_cannot_be_opened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cls = file_class(tmp_path)
    monkeypatch.setattr(gpuids, "can_use", lambda p: not p.endswith("fakedev1"))
    assert usable_indices(cls, {}) == [0, 2]
    # Ordinals count the usable nodes only (CUDA counts what it can open).
    assert usable_indices(cls, {"CUDA_VISIBLE_DEVICES": "1"}) == [2]
    assert usable_indices(cls, {"CUDA_VISIBLE_DEVICES": "2"}) == []


@pytest.mark.parametrize(
    ("value", "usable"),
    [
        ("", []),
        (GPUS[1][0], [1]),
        ("GPU-aaaa", [0]),  # a unique prefix is enough
        (f"{GPUS[2][0]},{GPUS[0][0]}", [0, 2]),
        ("GPU-bbb", []),  # ambiguous: CUDA stops there
        ("GPU-ffff", []),  # no such GPU
        ("MIG-aaaa1111", []),  # a lease is for a whole GPU
        ("0", [1]),  # ordinal 0 in bus order is minor 1
        ("1,2", [0, 2]),
        ("2,3,0", [2]),  # no ordinal 3: the list ends there
        (f"0,{GPUS[2][0]}", [1, 2]),
    ],
)
def test_usable_nvidia_with_nvml(
    nv_nodes: list[str], nvml: None, value: str, usable: list[int]
) -> None:
    assert usable_indices(nv_class(nv_nodes), {"CUDA_VISIBLE_DEVICES": value}) == usable


@pytest.mark.parametrize(
    ("value", "usable"),
    [("0", [0]), ("2,1", [1, 2]), (GPUS[1][0], []), ("1,GPU-aaaa,2", [1])],
)
def test_usable_nvidia_without_nvml(
    nv_nodes: list[str], no_nvml: None, value: str, usable: list[int]
) -> None:
    assert usable_indices(nv_class(nv_nodes), {"CUDA_VISIBLE_DEVICES": value}) == usable


def test_usable_nvidia_inside_a_cgroup(
    nv_nodes: list[str], nvml: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Slurm with ConstrainDevices: only /dev/nvidia0 and /dev/nvidia2 may be
    # opened, and CUDA_VISIBLE_DEVICES counts from 0 within them (bus order:
    # minor 0 at 0x3b, then minor 2 at 0x86).
    monkeypatch.setattr(gpuids, "can_use", lambda p: not p.endswith("nvidia1"))
    cls = nv_class(nv_nodes)
    assert usable_indices(cls, {}) == [0, 2]
    assert usable_indices(cls, {"CUDA_VISIBLE_DEVICES": "1"}) == [2]
    assert usable_indices(cls, {"CUDA_VISIBLE_DEVICES": "0,1"}) == [0, 2]
    assert usable_indices(cls, {"CUDA_VISIBLE_DEVICES": GPUS[1][0]}) == []
    # And the command is told the one it got in the same terms.
    assert visible_env(cls, [2])["CUDA_VISIBLE_DEVICES"] == GPUS[2][0]


def test_usable_as_a_user_who_may_not_open_a_node(
    tmp_path: Path, unpriv_user: str, unpriv_runtime: Path
) -> None:
    """The real access(2) check: root's node (0600) is not usable by another user."""
    cls = file_class(tmp_path)
    os.chmod(tmp_path, 0o755)
    for i in range(3):
        os.chmod(tmp_path / f"fakedev{i}", 0o600 if i == 1 else 0o666)
    code = (
        "import json, sys; from hold.devices.classes import DeviceClass; "
        "from hold.devices.gpuids import usable_indices; "
        f"c = DeviceClass('fake', ({cls.nodes[0]!r},), (), ('CUDA_VISIBLE_DEVICES',)); "
        "print(json.dumps([usable_indices(c, {}), usable_indices(c, {'CUDA_VISIBLE_DEVICES': '1'}),"
        " len(c.device_nodes())]))"
    )
    res = subprocess.run(
        as_user(unpriv_user, [unpriv_python(), "-c", code], unpriv_runtime, {}),
        capture_output=True,
        text=True,
        timeout=30,
    )
    if res.returncode != 0 and "ModuleNotFoundError" in res.stderr:
        pytest.skip(f"the unprivileged user cannot import the runtime: {res.stderr[-200:]}")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == [[0, 2], [2], 3]
    # As root, every node is usable.
    assert usable_indices(cls, {}) is None
