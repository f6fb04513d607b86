"""The device half of "the survivor check signals only members".

``hold_supervisor.proc.stop`` never signals a process for holding a tree's regular file
or port (tests/test_stop.py proves that). A process that started during a
lease and still holds one of the lease's *device* nodes at its end is another
matter: it used the device without the ticket, and the daemon stops it
(``hold.daemon.occupancy.stop_leftovers``) -- saying whose it was, since it may be
another user's. One that was there before the lease is left alone.

The devices are a class ``fake`` over temporary files, held by processes of
real unprivileged users.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import select
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import alive, as_user, unpriv_python, wait_for

from hold.daemon.occupancy import LeftoverStop, stop_leftovers
from hold.devices.classes import DeviceClass
from hold_supervisor.environ import minimal_env
from hold_supervisor.proc import scan
from hold_supervisor.proc.identity import NoSuchProcess
from hold_supervisor.spawn.child import Child, spawn

# Holds the node open, with a child that holds nothing, until killed.
_HOLDER = (
    "import os, sys, time\n"
    "f = open(sys.argv[1], 'rb')\n"
    "if os.fork() == 0:\n"
    "    f.close(); time.sleep(600); os._exit(0)\n"
    "print('holding', flush=True)\n"
    "time.sleep(600)\n"
)


@pytest.fixture
def started() -> Iterator[list[Child]]:
    made: list[Child] = []
    yield made
    for c in made:
        # Each holder leads its own session: the group takes its child too.
        with contextlib.suppress(OSError):
            os.killpg(c.pid, signal.SIGKILL)
        with contextlib.suppress(NoSuchProcess):
            if c.poll() is None:
                c.send_signal(signal.SIGKILL)
        c.collect(5.0)


def _holder(started: list[Child], user: str, runtime: Path, node: Path) -> Child:
    argv = as_user(user, [unpriv_python(), "-c", _HOLDER, str(node)], runtime, {})
    r, w = os.pipe()
    child = spawn(
        argv, env=minimal_env(os.environ, tree_id=f"not-a-tree-{uuid.uuid4().hex[:12]}"), stdout=w
    )
    started.append(child)
    try:
        os.close(w)
        w = -1
        line = os.read(r, 100) if select.select([r], [], [], 20)[0] else b""
        assert line == b"holding\n", f"{user}'s holder did not start: {line!r}"
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    return child


def test_a_device_holder_started_during_the_lease_is_stopped_and_named(
    tmp_path: Path, started: list[Child], unpriv_user: str, other_user: str, unpriv_runtime: Path
) -> None:
    node = tmp_path / "fakedev0"
    node.write_bytes(b"\0" * 16)
    for p in [tmp_path, *tmp_path.parents]:
        if p == Path("/"):
            break
        os.chmod(p, os.stat(p).st_mode | 0o055)
    os.chmod(node, 0o644)
    cls = DeviceClass("fake", (f"{tmp_path}/fakedev*",))

    # Before the lease: another user's process on the device (granted past
    # it with busy_devices: warn). Not the lease's to stop.
    before = _holder(started, other_user, unpriv_runtime, node)
    wait_for(
        lambda: scan.ticks_at(time.time()) > before.ident.starttime + 10,
        what="the clock to move past the first holder's start",
    )
    granted = time.time()
    wait_for(
        lambda: scan.ticks_at(time.time()) > scan.ticks_at(granted) + 10,
        what="the clock to move past the grant",
    )
    # During the lease: a user's process opens the leased device without a ticket.
    during = _holder(started, unpriv_user, unpriv_runtime, node)
    during_child = scan.descendants([during.pid], scan.snapshot())
    assert len(during_child) == 1

    reports, left = stop_leftovers(cls, [0], uid=None, grace=2.0, granted=granted)

    (r,) = reports
    assert isinstance(r, LeftoverStop), r
    h = r.holder
    assert (h["pid"], h["user"], h["uid"]) == (
        during.pid,
        unpriv_user,
        pwd.getpwnam(unpriv_user).pw_uid,
    ), h
    assert "time.sleep(600)" in h["command"] and h["node"] == str(node), h
    assert (h["class"], h["device"]) == ("fake", 0), h
    assert r.tree_id == f"left{during.pid}" and r.ok, r.summary()
    assert during.collect(5.0) == -signal.SIGTERM, r.summary()
    assert not any(alive(p) for p in during_child), r.summary()
    # The one from before the lease: untouched, still holding, and said so.
    assert before.poll() is None and before.ident.is_running()
    assert [x["pid"] for x in left.get(0, [])] == [before.pid], left
    assert left[0][0]["user"] == other_user
