"""The two questions "who holds these nodes" get one answer: the audit's scan
(:func:`hold.devices.holders.scan`, also the daemon's) and the survivor check's
(:func:`hold_supervisor.proc.scan.holders_of`, also ``hold down``'s) both ask
:class:`~hold_supervisor.proc.scan.NodeMatcher`. Real processes hold real
nodes: by descriptor, by memory mapping only, through another node file of the
same device; and a process we may not read is never taken for one holding
nothing by the audit, nor named by the survivor check.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import as_user
from test_audit import (
    Procs,
    open_to_others,
    procs,  # noqa: F401 (a fixture: holders ended at teardown)
    user_holder,
    user_python,
)

from hold.devices import holders
from hold.devices.classes import DeviceClass
from hold_supervisor.proc import scan as procscan

# A character device number no driver here registers (major 4000 lies in the
# 12-bit range the kernel accepts, far above the ones it hands out): its node
# files can be held only by an O_PATH descriptor, which still names the device.
FAKE_RDEV = os.makedev(4000, 7)


def wanted(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A file standing in for a device; a device node; another node of that device."""
    file = tmp_path / "fakedev0"
    file.write_bytes(b"\0" * 4096)
    node, twin = tmp_path / "fakechr", tmp_path / "fakechr-twin"
    try:
        for n in (node, twin):
            os.mknod(n, 0o600 | stat.S_IFCHR, FAKE_RDEV)
    except PermissionError:
        pytest.skip("mknod needs CAP_MKNOD")
    return file, node, twin


def targets_of(*nodes: Path) -> dict[holders.Key, holders.Target]:
    """The audit's targets for a class ``fake`` of these nodes."""
    return holders.targets({"fake": DeviceClass("fake", tuple(map(str, nodes)))})


def test_survivor_check_and_audit_scan_find_the_same_holders(
    tmp_path: Path,
    procs: Procs,  # noqa: F811
) -> None:
    file, node, twin = wanted(tmp_path)
    by_fd = procs.holder("fd", file)["holder"]
    by_map = procs.holder("mmap", file)["holder"]
    by_twin = procs.holder("path", twin)["holder"]
    other = tmp_path / "unrelated"
    other.write_bytes(b"\0" * 4096)
    bystander = procs.holder("fd", other)["holder"]
    ours = {by_fd, by_map, by_twin, bystander}

    found = holders.scan(targets_of(file, node))
    rows = {(h.pid, h.node, h.how) for h in found.holders if h.pid in ours}
    want = {(by_fd, str(file), "fd"), (by_map, str(file), "mmap"), (by_twin, str(node), "fd")}
    assert rows == want, found

    nodes = [procscan.node_of_stat(os.stat(p), str(p)) for p in (file, node)]
    held = procscan.holders_of(nodes, procscan.pids())
    assert {pid: n.path for pid, n in held.items() if pid in ours} == {
        by_fd: str(file),
        by_map: str(file),
        by_twin: str(node),
    }

    # Each process alone, as the matcher answers for it.
    matcher = procscan.NodeMatcher.of_nodes(nodes)
    assert matcher.inspect(by_fd) == ({nodes[0]: "fd"}, False)
    assert matcher.inspect(by_map) == ({nodes[0]: "mmap"}, False)
    assert matcher.inspect(by_twin) == ({nodes[1]: "fd"}, False)
    assert matcher.inspect(bystander) == ({}, False)


# Run as the user who may not read the holder: the audit's scan, the survivor
# check's look and the matcher's answer for one process, as JSON.
_LOOK = """
import json, os, sys
from hold.devices import holders
from hold.devices.classes import DeviceClass
from hold_supervisor.proc import scan
pid, path = int(sys.argv[1]), sys.argv[2]
node = scan.node_of_stat(os.stat(path), path)
found = holders.scan(holders.targets({"fake": DeviceClass("fake", (path,))}), pids=[pid])
held, denied = scan.NodeMatcher.of_nodes([node]).inspect(pid)
print(json.dumps({
    "audit": [h.pid for h in found.holders],
    "not_inspected": found.not_inspected,
    "survivors": sorted(scan.holders_of([node], [pid])),
    "matcher": [len(held), denied],
}))
"""


def look_as(argv: list[str]) -> dict[str, object]:
    res = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    doc: dict[str, object] = json.loads(res.stdout)
    return doc


NOT_READ = {"audit": [], "not_inspected": 1, "survivors": [], "matcher": [0, True]}


def test_a_process_an_unprivileged_user_may_not_read_is_not_inspected(
    tmp_path: Path,
    procs: Procs,  # noqa: F811
    unpriv_user: str,
    unpriv_runtime: Path,
) -> None:
    """Root's holder, looked at by another user: its ``fd/`` may not even be
    listed. The audit counts it as not inspected; the survivor check names
    nobody; neither says it holds nothing."""
    file = tmp_path / "fakedev0"
    file.write_bytes(b"\0" * 4096)
    open_to_others(tmp_path)
    pid = procs.holder("fd", file)["holder"]
    py = user_python(unpriv_user, unpriv_runtime)
    doc = look_as(as_user(unpriv_user, [py, "-c", _LOOK, str(pid), str(file)], unpriv_runtime, {}))
    assert doc == NOT_READ
    # Root sees it: the same look can find it.
    assert look_as([sys.executable, "-c", _LOOK, str(pid), str(file)]) == {
        "audit": [pid],
        "not_inspected": 0,
        "survivors": [pid],
        "matcher": [1, False],
    }


def test_a_process_whose_descriptors_may_be_listed_but_not_followed_is_not_inspected(
    tmp_path: Path,
    procs: Procs,  # noqa: F811
    unpriv_user: str,
) -> None:
    """Root without CAP_SYS_PTRACE may list another user's ``fd/`` but not follow
    its links: the per-descriptor refusal, counted the same way."""
    file = tmp_path / "fakedev0"
    file.write_bytes(b"\0" * 4096)
    open_to_others(tmp_path)
    pid = user_holder(procs, unpriv_user, file)
    assert os.listdir(f"/proc/{pid}/fd")
    no_ptrace = ["setpriv", "--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace", "--"]
    doc = look_as([*no_ptrace, sys.executable, "-c", _LOOK, str(pid), str(file)])
    assert doc == NOT_READ
