"""A holder that reaches the device through a node of its own, in a mount namespace
of its own: what a container runtime running as root does for ``--device``,
CDI or a Kubernetes device plugin (a tmpfs for the container's ``/dev``, a node
made there by ``mknod``: the same device number, another inode).

The kernel's count of opens watches inodes: the host's node hears nothing of
such a holder. Before issue 45 a grant by the count alone was made over it.
Each test first shows that the count answers grants (``check: count``), then
starts the "container" and asks again.

The device is ``/dev/full`` (1:7): a real character device anyone may open
and nobody here holds (checked at setup). Device numbers are machine-wide,
so the tests that use it take turns across every run of this suite on the
machine (a file lock), and a holder of someone else's is never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    FULL,
    HOLD,
    LOADED,
    alive,
    audit_clean,
    grant_checks,
    update_config,
    wait_for,
)

from hold_supervisor.proc import scan
from hold_supervisor.proc.cgroup import CgroupUnavailable, Hierarchy

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="a container's node is made by root (mknod)"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)"),
]


@pytest.fixture
def device(isolated_hold: Path, dev_full: None) -> Path:
    """Class ``ctr``: one device, /dev/full, through a node in the test's directory."""
    d = isolated_hold / "ctrdev"
    d.mkdir()
    node = d / "full0"
    os.mknod(node, stat.S_IFCHR | 0o666, FULL)
    update_config(isolated_hold, devices={"ctr": {"nodes": [f"{d}/full*"]}})
    return node


@pytest.fixture
def containers() -> Iterator[list[subprocess.Popen[str]]]:
    """The "containers" a test started: killed and reaped afterwards."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=LOADED)


HOLDER = (
    "import os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_RDWR)\n"
    "print(os.getpid(), flush=True)\n"
    "time.sleep(600)\n"
)


def unshared(script: str, started: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    """``sh -c SCRIPT`` in a mount namespace of its own (``$0``: this Python, ``$1``:
    the holder's program), its output piped; added to ``started``."""
    p = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, sys.executable, HOLDER],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    started.append(p)
    return p


def container(how: str, node: Path, base: Path, started: list[subprocess.Popen[str]]) -> int:
    """Start a holder in a mount namespace of its own that opens /dev/full through a
    node it made there (``how``): ``bind`` -- made on a tmpfs and bind-mounted
    over the configured node's path (the issue's reproduction); ``dev`` -- a
    tmpfs mounted on /dev, the node made in it (a container's own /dev). The
    holder's pid once it has the node open."""
    if how == "bind":
        cdev = base / f"cdev{len(started)}"
        cdev.mkdir()
        setup = (
            f"mount -t tmpfs none {cdev} && mknod {cdev}/npu0 c 1 7 && "
            f"mount --bind {cdev}/npu0 {node}"
        )
        path = str(node)
    else:
        setup = "mount -t tmpfs none /dev && mknod /dev/accel0 c 1 7"
        path = "/dev/accel0"
    p = unshared(f'{setup} && exec "$0" -c "$1" {path}', started)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.strip().isdigit(), (line, p.stderr.read() if p.poll() is not None else "")
    pid = int(line)
    # Another inode: the host's node is not what it holds.
    held = os.stat(f"/proc/{pid}/fd/3")
    assert held.st_rdev == FULL and held.st_ino != os.stat(node).st_ino
    return pid


def hold_run(*args: str, cmd: tuple[str, ...] = ("true",)) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*HOLD, "run", "--device", "ctr:0", *args, "--", *cmd],
        capture_output=True,
        text=True,
        timeout=60 + LOADED,
    )


def counted(state: Path) -> None:
    """Two grants: the first scans (the count's start), the second is the count's."""
    assert hold_run().returncode == 0
    assert hold_run().returncode == 0
    assert grant_checks(state)[-1] == "count", grant_checks(state)


def device_status() -> dict[str, object]:
    res = subprocess.run(
        [*HOLD, "status", "--json"], capture_output=True, text=True, timeout=30 + LOADED
    )
    assert res.returncode == 0, res.stderr
    dev: dict[str, object] = json.loads(res.stdout)["classes"]["ctr"]["devices"][0]
    return dev


@pytest.mark.parametrize("how", ["bind", "dev"])
def test_a_container_holder_from_before_the_grant_is_not_granted_over(
    how: str, device: Path, isolated_hold: Path, containers: list[subprocess.Popen[str]]
) -> None:
    state = isolated_hold / "state"
    counted(state)
    pid = container(how, device, isolated_hold, containers)
    res = hold_run("--no-wait")
    assert res.returncode == 75, (res.returncode, res.stderr, grant_checks(state))
    assert str(pid) in res.stderr, res.stderr
    # Gone, and the device is granted again (by a scan, then by the count).
    containers[-1].kill()
    containers[-1].wait(timeout=LOADED)
    res = hold_run("--wait-timeout", "20s")
    assert res.returncode == 0, res.stderr
    assert hold_run().returncode == 0
    assert grant_checks(state)[-1] == "count", grant_checks(state)


def test_a_node_made_in_a_containers_dev_after_it_was_looked_into_is_counted(
    device: Path, isolated_hold: Path, containers: list[subprocess.Popen[str]]
) -> None:
    """A namespace looked into before its node was made (a runtime between its
    tmpfs and its mknod, or a privileged container's own mknod later): the
    directory's watch sees the new entry, the node is watched, and the grant
    after it scans."""
    state = isolated_hold / "state"
    counted(state)
    go = isolated_hold / "go"
    script = (
        "mount -t tmpfs none /dev && echo up && "
        f"while [ ! -e {go} ]; do sleep 0.05; done && mknod /dev/accel0 c 1 7 && "
        'exec "$0" -c "$1" /dev/accel0'
    )
    p = unshared(script, containers)
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "up"
    # Granted (no node of the device there yet: the count still stands).
    assert hold_run("--no-wait").returncode == 0
    assert grant_checks(state)[-1] == "count", grant_checks(state)
    go.touch()
    pid = int(p.stdout.readline())
    refused = hold_run("--no-wait")
    assert refused.returncode == 75 and str(pid) in refused.stderr, refused.stderr


def test_a_container_holder_that_opens_during_a_lease_is_stopped_at_its_end(
    device: Path, isolated_hold: Path, containers: list[subprocess.Popen[str]]
) -> None:
    """Started while a lease holds the device: it used the device without the
    ticket, so the lease's end stops it (and logs whose it was) before anyone
    else gets the device."""
    state = isolated_hold / "state"
    counted(state)
    go = isolated_hold / "go"
    wait = f"while [ ! -e {go} ]; do sleep 0.05; done"
    lease = subprocess.Popen(
        [*HOLD, "run", "--device", "ctr:0", "--", "sh", "-c", wait],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: device_status().get("holder") is not None, LOADED, what="the lease")
        pid = container("dev", device, isolated_hold, containers)
        go.touch()
        assert lease.wait(timeout=60) == 0, lease.stderr.read() if lease.stderr else ""
    finally:
        if lease.poll() is None:
            lease.kill()
            lease.wait()
    wait_for(lambda: not alive(pid), LOADED, what="the container's holder to be stopped")
    log = (state / "daemon.log").read_text()
    stopped = [
        json.loads(line)
        for line in log.splitlines()
        if line.startswith("{") and '"leftover_stopped"' in line
    ]
    assert [e["holder_pid"] for e in stopped] == [pid], log
    assert hold_run("--no-wait").returncode == 0


def test_status_says_in_use_for_a_node_the_count_saw_opened(
    device: Path, isolated_hold: Path, containers: list[subprocess.Popen[str]]
) -> None:
    state = isolated_hold / "state"
    counted(state)
    before = device_status()
    assert before.get("holder") is None and before.get("known") == "free", before
    pid = container("dev", device, isolated_hold, containers)
    dev = wait_for(
        lambda: (d := device_status()).get("holder") is not None and d,
        LOADED,
        what="status to see the holder",
    )
    holder = dev["holder"]
    assert isinstance(holder, dict)
    assert holder["state"] in ("in use", "blocked"), dev
    os.kill(pid, signal.SIGKILL)


def test_a_container_holder_is_named_with_its_container_and_audit_kill_ends_it(
    device: Path, isolated_hold: Path, containers: list[subprocess.Popen[str]]
) -> None:
    """What a person sees of a holder in a container: the runtime's id (from the
    cgroup it runs in, named as Docker's systemd driver names it) and its pid
    inside its own pid namespace; and ``hold audit --kill`` ends it as any
    stray, with the survivor check."""
    try:
        base = Hierarchy.find().base
    except CgroupUnavailable as e:
        pytest.skip(f"no cgroup v2 leaf can be made here: {e}")
    cid = uuid.uuid4().hex * 2
    leaf = Path(base) / f"docker-{cid}.scope"
    leaf.mkdir()
    try:
        inner = (
            'mount -t tmpfs none /dev && mknod /dev/accel0 c 1 7 && exec "$0" -c "$1" /dev/accel0'
        )
        script = (
            f"echo $$ > {leaf}/cgroup.procs && exec unshare -m -p -f --propagation private "
            f'sh -c \'{inner}\' "$0" "$1"'
        )
        p = subprocess.Popen(
            ["sh", "-c", script, sys.executable, HOLDER],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        containers.append(p)
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "1"  # pid 1 of its own pid namespace
        (pid,) = scan.children_of(p.pid) or [None]
        assert pid is not None
        res = subprocess.run(
            [*HOLD, "audit", "--device", "ctr", "--json"],
            capture_output=True,
            text=True,
            timeout=60 + LOADED,
        )
        assert res.returncode == 1, (res.stdout, res.stderr)
        (row,) = [r for r in json.loads(res.stdout)["holders"] if r["pid"] == pid]
        assert row["origin"] == {"container": cid[:12], "runtime": "docker", "nspid": 1}, row
        table = subprocess.run(
            [*HOLD, "audit", "--device", "ctr"], capture_output=True, text=True, timeout=60
        )
        assert f"[docker {cid[:12]}, pid 1 inside]" in table.stdout, table.stdout
        refused = hold_run("--no-wait")
        assert refused.returncode == 75 and f"docker {cid[:12]}" in refused.stderr, refused.stderr
        killed = subprocess.run(
            [*HOLD, "audit", "--device", "ctr", "--kill", "--yes", "--grace", "2s", "--json"],
            capture_output=True,
            text=True,
            timeout=60 + LOADED,
        )
        assert killed.returncode == audit_clean(killed.stdout), (killed.stdout, killed.stderr)
        (k,) = json.loads(killed.stdout)["killed"]
        assert (k["pid"], k["stopped"], k["survivors"]) == (pid, True, []), k
        wait_for(lambda: not alive(pid), LOADED, what="the container's holder to end")
        p.wait(timeout=LOADED)
    finally:
        with contextlib.suppress(OSError):
            (leaf / "cgroup.kill").write_text("1")
        wait_for(lambda: not (leaf / "cgroup.procs").read_text().strip(), LOADED, what="leaf empty")
        leaf.rmdir()
