"""Grants on classes with real nodes: ``--no-wait`` on a free device is
granted, a busy one names its holder, the lease is over when ``npu-hold``
returns, two paths to one node are one device, and the cgroup leaf is made
only once the lease is granted."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import HOLD, PROGS, wait_for

from hold.daemon import devlock
from hold.devices.classes import node_key

NPU_HOLD = str(Path(sys.executable).parent / "npu-hold")
GATED = str(PROGS / "gated.py")
HOLDER = str(PROGS / "node_holder.py")


def configure(tmp_path: Path, patterns: list[str], cgroups: str = "auto") -> None:
    Path(os.environ["HOLD_CONFIG"]).write_text(
        f"cgroups: {cgroups}\ndevices:\n  npu:\n    nodes: {json.dumps(patterns)}\n"
    )


def npu(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [NPU_HOLD, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def lock_of(node: Path) -> str:
    key = node_key(str(node))
    assert key is not None
    return devlock.lock_path(os.environ["HOLD_LOCK_DIR"], key)


def test_no_wait_on_a_free_device_is_granted_and_the_lease_is_over_on_return(
    tmp_path: Path,
) -> None:
    node = tmp_path / "accel0"
    node.write_text("")
    configure(tmp_path, [str(tmp_path / "accel*")])
    state = Path(os.environ["HOLD_STATE_DIR"])
    for _ in range(3):  # a script's loop: each one finds the device free
        res = npu("--no-wait", "-t", "1m", "--", "true")
        assert res.returncode == 0, res.stderr
        # On return: no token, the machine-wide lock free, the daemon says free.
        assert not (state / "npu-0.token").exists()
        assert not devlock.is_locked(lock_of(node))
        st = subprocess.run([*HOLD, "status", "--json"], capture_output=True, text=True)
        assert json.loads(st.stdout)["classes"]["npu"]["devices"][0]["holder"] is None


def test_no_wait_on_a_device_held_outside_any_lease_names_the_holder(tmp_path: Path) -> None:
    node = tmp_path / "accel0"
    node.write_text("")
    configure(tmp_path, [str(tmp_path / "accel*")])
    out = tmp_path / "holder.out"
    stray = subprocess.Popen([sys.executable, HOLDER, str(out), "fd", str(node)])
    try:
        wait_for(lambda: out.exists() and "holder" in out.read_text(), 10, what="the stray")
        res = npu("--no-wait", "-t", "1m", "--", "true")
        assert res.returncode == 75, res.stderr
        assert f"held OUTSIDE any lease by pid {stray.pid} (user root" in res.stderr
        assert "progs/node_holder.py" in res.stderr  # its command
    finally:
        stray.kill()
        stray.wait(10)
    # Gone: granted again (its exit wakes the daemon).
    wait_for(lambda: npu("--no-wait", "--", "true").returncode == 0, 20, 0.2, "a grant")


def test_two_paths_to_one_node_are_one_device(tmp_path: Path) -> None:
    first = tmp_path / "accel0"
    first.write_text("")
    os.link(first, tmp_path / "accel1")  # a hard link
    (tmp_path / "accel2").symlink_to(first)  # and a symlink
    patterns = [str(tmp_path / "accel*")]
    if os.geteuid() == 0:
        # Two character nodes with the same numbers (a local/experimental major).
        for name in ("chr0", "chr1"):
            os.mknod(tmp_path / name, stat.S_IFCHR | 0o666, os.makedev(240, 77))
        patterns.append(str(tmp_path / "chr*"))
    configure(tmp_path, patterns)
    expect = 2 if os.geteuid() == 0 else 1
    st = subprocess.run([*HOLD, "status", "--json"], capture_output=True, text=True)
    assert len(json.loads(st.stdout)["classes"]["npu"]["devices"]) == expect, st.stdout
    work = tmp_path / "work"
    work.mkdir()
    holder = subprocess.Popen(
        [
            NPU_HOLD,
            "-n",
            str(expect),
            "-t",
            "1m",
            "--",
            sys.executable,
            GATED,
            str(work),
            "A",
            "--wait",
        ],
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: (work / "A.ready").exists(), 20, what="the holder")
        res = npu("--no-wait", "-t", "1m", "--", "true")
        assert res.returncode == 75, res.stderr
    finally:
        (work / "A.go").write_text("")
        assert holder.wait(30) == 0


def test_the_leaf_is_made_when_the_lease_is_granted_not_before_the_wait(tmp_path: Path) -> None:
    from hold_supervisor.proc.cgroup import CgroupUnavailable, Hierarchy

    try:
        base = Hierarchy.find().base
    except CgroupUnavailable as e:
        pytest.skip(f"no writable cgroup v2 here: {e}")
    node = tmp_path / "accel0"
    node.write_text("")
    configure(tmp_path, [str(tmp_path / "accel*")], cgroups="required")
    work = tmp_path / "work"
    work.mkdir()

    def leaves() -> set[str]:
        return {e.name for e in os.scandir(base) if e.name.startswith("hold-")}

    a = subprocess.Popen(
        [NPU_HOLD, "-l", "A", "--", sys.executable, GATED, str(work), "A", "--wait"],
        stderr=subprocess.DEVNULL,
    )
    b: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: (work / "A.ready").exists(), 20, what="A")
        with_a = leaves()
        b_err = tmp_path / "b.err"
        with open(b_err, "w") as err:
            b = subprocess.Popen(
                [NPU_HOLD, "-l", "B", "--", sys.executable, GATED, str(work), "B"], stderr=err
            )
        wait_for(lambda: "waiting for npu" in b_err.read_text(), 20, what="B to wait")
        assert leaves() == with_a  # B waits without a leaf
        (work / "A.go").write_text("")
        assert a.wait(30) == 0
        wait_for(lambda: (work / "B.ready").exists(), 20, what="B")
        assert b.wait(30) == 0, b_err.read_text()
        env = json.loads((work / "B.env").read_text())
        assert env["HOLD_DEVICES"] == "npu:0"
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(10)


def _pid_as_scripts_read_it(first_line: str) -> int:
    """The reader in use: the first line's words, the one after the first ``pid``."""
    words = first_line.split()
    return int(words[words.index("pid") + 1])


@pytest.mark.parametrize("label", ["run pid 1 of 3", "pid", "a\tpid 1", "100% ünï", "x pid"])
def test_no_label_forges_the_token_line(tmp_path: Path, label: str) -> None:
    from hold.daemon.tokens import line_label, read_record

    node = tmp_path / "accel0"
    node.write_text("")
    configure(tmp_path, [str(tmp_path / "accel*")])
    work = tmp_path / "work"
    work.mkdir()
    if "\t" in label:  # a control character: refused before anything starts
        res = npu("-l", label, "--", "true")
        assert res.returncode == 2 and "control characters" in res.stderr, res.stderr
        return
    holder = subprocess.Popen(
        [NPU_HOLD, "-l", label, "--", sys.executable, GATED, str(work), "A", "--wait"],
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: (work / "A.ready").exists(), 20, what="the holder")
        token = Path(os.environ["HOLD_STATE_DIR"]) / "npu-0.token"
        first = token.read_text().split("\n", 1)[0]
        assert first.startswith(f"npu-hold {line_label(label)} pid {holder.pid} ")
        assert _pid_as_scripts_read_it(first) == holder.pid
        rec = read_record(str(token))
        assert rec is not None and rec["label"] == label  # the record keeps it whole
    finally:
        (work / "A.go").write_text("")
        assert holder.wait(30) == 0


def test_a_lock_file_that_cannot_be_used_keeps_the_device_and_costs_nothing(
    tmp_path: Path,
) -> None:
    """Something planted at a device's lock path (here a directory): the device
    is not granted (the client is told why), the daemon does not spin, and the
    device is granted again once the path is fixed."""
    node = tmp_path / "accel0"
    node.write_text("")
    configure(tmp_path, [str(tmp_path / "accel*")])
    planted = Path(lock_of(node))
    planted.mkdir()
    res = npu("--no-wait", "--", "true")
    assert res.returncode == 75, res.stderr
    assert "cannot be locked" in res.stderr and str(planted) in res.stderr
    state = Path(os.environ["HOLD_STATE_DIR"])
    pid = int((state / "daemon.lock").read_text())

    def cpu() -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    before = cpu()
    time.sleep(1.0)  # a measuring window, not a wait for an event
    assert cpu() - before < 0.2  # idle, not a busy loop
    planted.rmdir()
    res = npu("--no-wait", "--", "true")
    assert res.returncode == 0, res.stderr
