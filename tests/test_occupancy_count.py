"""Grants without a scan: the kernel's count of a device's open files, and what tries
to slip past it.

A grant believes the count (``hold.daemon.occupancy``) once a scan has seen the
device empty; each test first shows that the count is what answered (the
daemon's log says ``check: count``), then slips a holder in the way a
stray could -- two opens read as one, a fork, a mapping, a descriptor
passed over a socket, a queue overflow, a stray between two grants -- and
asks for the device with ``--no-wait``: it must be refused (exit 75) and
the holder named, then granted once the holder is gone.

The devices are regular files in the test's directory (class ``fake``):
opened and mapped like any node, and nothing else on the machine holds them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    HOLD,
    PROGS,
    alive,
    daemon_pid,
    grant_checks,
    holds_node,
    update_config,
    wait_for,
)

PY = sys.executable
SLIPPER = str(PROGS / "slipper.py")


@pytest.fixture
def node(isolated_hold: Path) -> Path:
    path = isolated_hold / "fakedev0"
    path.write_bytes(b"\0" * 4096)
    update_config(isolated_hold, devices={"fake": {"nodes": [f"{isolated_hold}/fakedev*"]}})
    return path


@pytest.fixture
def holders() -> Iterator[list[int]]:
    """Pids of the holders a test made (orphans too: pytest is their subreaper)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        wait_for(lambda p=pid: not alive(p), 10, what=f"holder {pid} to end")  # type: ignore[misc]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*HOLD, "run", "--device", "fake:0", *args, "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def counted_grant(state: Path) -> None:
    """Two grants: the first scans (the count's start), the second needs only the count."""
    assert run().returncode == 0
    assert run().returncode == 0
    assert grant_checks(state)[-1] == "count", grant_checks(state)


def slip(how: str, node: Path, holders: list[int]) -> int:
    """Run slipper.py ``how``; the pid that holds ``node`` once it says so."""
    p = subprocess.run([PY, SLIPPER, how, str(node)], capture_output=True, text=True, timeout=30)
    line = p.stdout.splitlines()[0] if p.stdout else ""
    assert line.startswith("holding "), (p.stdout, p.stderr)
    pid = int(line.split()[1])
    holders.append(pid)
    wait_for(lambda: holds_node(pid, node) or _maps(pid, node), 10, what="the node held")
    return pid


def slip_in_background(how: str, node: Path, holders: list[int]) -> int:
    """As :func:`slip`, for the ways whose holder is slipper.py itself (it stays)."""
    p = subprocess.Popen([PY, SLIPPER, how, str(node)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.startswith("holding "), line
    holders.append(p.pid)
    return p.pid


def _maps(pid: int, node: Path) -> bool:
    st = os.stat(node)
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False
    return f" {st.st_ino} " in text and str(node) in text


@contextlib.contextmanager
def daemon_stopped(state: Path) -> Iterator[None]:
    """The daemon SIGSTOPped meanwhile: nothing reads its event queue."""
    daemon = daemon_pid(state)
    assert daemon is not None
    os.kill(daemon, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(daemon, signal.SIGCONT)


def refused_for(pid: int) -> None:
    res = run("--no-wait")
    assert res.returncode == 75, (res.returncode, res.stderr)
    assert str(pid) in res.stderr, res.stderr


def granted_after(pid: int, state: Path) -> None:
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not alive(pid), 10, what="the holder to end")
    res = run("--wait-timeout", "20s")
    assert res.returncode == 0, res.stderr


@pytest.fixture
def state(isolated_hold: Path) -> Path:
    return isolated_hold / "state"


def test_a_lease_that_opened_the_node_ends_with_a_scan(node: Path, state: Path) -> None:
    """A count back at zero is no proof once the node was opened: inotify can
    merge two opens on two CPUs into one event, and the first close then
    brings the count to zero while the other file is open (a soak granted a
    device a stray held for a second). So the end of a lease whose command
    opened the node scans it -- that scan starts the count again -- and the
    grants after it need no scan, as after a lease that never opened it."""
    counted_grant(state)
    # The lease's own command opens the node (twice, and a child inherits it).
    script = f"exec 3<{node} 4<{node}; (sleep 0.1) & wait"
    res = subprocess.run(
        [*HOLD, "run", "--device", "fake:0", "--", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    log = (state / "daemon.log").read_text()
    assert '"at": "lease end"' in log, log
    assert run().returncode == 0
    assert run().returncode == 0
    assert grant_checks(state)[-2:] == ["count", "count"], grant_checks(state)


def test_two_opens_read_as_one_event_still_block(
    node: Path, state: Path, holders: list[int]
) -> None:
    counted_grant(state)
    # With the daemon stopped, nothing reads the queue: two opens in a row
    # are two identical events, which inotify merges unless something lies
    # between them. Then one close: a count of opens would be back at zero.
    with daemon_stopped(state):
        pid = slip_in_background("twice", node, holders)
    refused_for(pid)
    granted_after(pid, state)


@pytest.mark.parametrize("how", ["fork", "mmap", "pass"])
def test_a_holder_hidden_from_the_count_still_blocks(
    how: str, node: Path, state: Path, holders: list[int]
) -> None:
    counted_grant(state)
    if how == "mmap":
        pid = slip_in_background(how, node, holders)
        wait_for(lambda: _maps(pid, node) and not holds_node(pid, node), 10, what="a mapping only")
    else:
        pid = slip(how, node, holders)
    refused_for(pid)
    granted_after(pid, state)


def test_a_stray_between_two_grants_is_seen(node: Path, state: Path, holders: list[int]) -> None:
    counted_grant(state)
    stray = subprocess.Popen(["sh", "-c", f'exec sleep 120 3<"{node}"'])
    holders.append(stray.pid)
    wait_for(lambda: holds_node(stray.pid, node), 10, what="the stray to hold the node")
    refused_for(stray.pid)
    granted_after(stray.pid, state)
    stray.wait(timeout=10)


def test_a_queue_overflow_loses_the_count(node: Path, state: Path, holders: list[int]) -> None:
    counted_grant(state)
    limit = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    sibling = node.parent / "sibling"
    sibling.touch()
    with daemon_stopped(state):
        # Fill the daemon's queue (the node's directory is watched too), then
        # open the node: that open's events are dropped, and only the
        # overflow says the count is gone.
        for _ in range(limit // 2 + 10):
            os.close(os.open(sibling, os.O_RDONLY))
        pid = slip_in_background("twice", node, holders)
    refused_for(pid)
    granted_after(pid, state)


def test_the_count_is_started_again_by_a_scan(node: Path, state: Path, holders: list[int]) -> None:
    counted_grant(state)
    pid = slip_in_background("twice", node, holders)
    refused_for(pid)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not alive(pid), 10, what="the holder to end")
    # Its close brings the count back to zero; the count was believed before
    # the open, so the next grant needs no scan again.
    assert run().returncode == 0
    assert run().returncode == 0
    assert grant_checks(state)[-1] == "count", grant_checks(state)


def test_opens_through_another_path_are_not_counted_on(
    node: Path, state: Path, holders: list[int]
) -> None:
    # A hard link in another directory reaches the same inode: the node's
    # watch sees these opens, but without the directory's events between
    # them two opens may merge into one (as a bind mount's would).
    other = node.parent / "elsewhere"
    other.mkdir()
    link = other / "alias"
    os.link(node, link)
    counted_grant(state)
    with daemon_stopped(state):
        pid = slip_in_background("twice", link, holders)
    refused_for(pid)
    granted_after(pid, state)


def test_a_node_made_again_is_not_counted_on(node: Path) -> None:
    from hold.daemon.occupancy import Occupancy, checked_look
    from hold.devices.classes import DeviceClass

    cls = DeviceClass("fake", (str(node),))
    occ = Occupancy()
    keys = cls.device_keys()
    occ.track({"fake": cls}, {"fake": keys})
    assert checked_look(occ, cls, [0], keys).found == {}
    assert occ.known_empty(keys)
    # Another inode at the node's path (a driver reload, udev): the watch
    # follows the old inode and would never see an open of the new one.
    fresh = node.parent / "fresh"
    fresh.write_bytes(b"\0" * 16)
    fresh.rename(node)
    assert not occ.known_empty(keys)
    assert str(node) in occ.why_not(keys[0])
    assert occ.watch is not None
    occ.watch.close()
