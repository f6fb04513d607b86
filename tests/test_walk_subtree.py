"""A tree without a cgroup leaf is looked for below the subreaper that spawned it
(issue 45): ``hold run`` reads its own descendants, the daemon reads the
holder's at its end, and neither lists every process of the machine on the
way. What the tree asked *another* daemon to start is below neither: only its
marker names it, and the ticket daemon's machine-wide sweep (once every
``MARKER_SWEEP`` seconds, after the lease changed hands) stops it and says so.

"Another daemon" here is a spawner the test starts outside every tree: it
reads lines from a FIFO and starts each as its own child, with the
environment the line gives -- as ``at`` or ``systemd-run`` would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import HOLD, LOADED, alive, update_config, wait_for

from hold.daemon.sessions import MARKER_SWEEP

SPAWNER = r"""
import os, subprocess, sys
fifo, out = sys.argv[1], sys.argv[2]
while True:
    with open(fifo) as f:
        for line in f:
            marker, _, cmd = line.strip().partition(" ")
            name, _, value = marker.partition("=")
            p = subprocess.Popen(cmd.split(), env={name: value, "PATH": os.environ["PATH"]})
            with open(out, "a") as o:
                o.write(f"{p.pid}\n")
"""


@pytest.fixture
def spawner(isolated_hold: Path) -> Iterator[tuple[Path, Path]]:
    """(its FIFO, the file where it writes each child's pid); it and its children
    are killed afterwards."""
    fifo, out = isolated_hold / "spawn.fifo", isolated_hold / "spawned"
    os.mkfifo(fifo)
    out.touch()
    p = subprocess.Popen([sys.executable, "-c", SPAWNER, str(fifo), str(out)])
    yield fifo, out
    for line in out.read_text().split():
        if alive(int(line)):
            os.kill(int(line), 9)
    p.kill()
    p.wait(timeout=LOADED)


@pytest.mark.timeout(60 + MARKER_SWEEP + 2 * LOADED)
def test_what_another_daemon_started_for_a_leafless_tree_is_swept_by_its_marker(
    isolated_hold: Path, spawner: tuple[Path, Path]
) -> None:
    update_config(isolated_hold, cgroups="off")
    fifo, out = spawner
    # The command asks the spawner for a sleep carrying the command's own
    # marker, and ends: nothing of the tree is left below hold run.
    ask = f'echo "HOLD_TREE=$HOLD_TREE sleep 300" > {fifo}'
    script = f"{ask}; while [ ! -s {out} ]; do sleep 0.05; done"
    res = subprocess.run(
        [*HOLD, "run", "--device", "npu", "--", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    (pid,) = [int(x) for x in out.read_text().split()]
    assert alive(pid)
    log = isolated_hold / "state" / "daemon.log"

    def swept() -> list[dict[str, object]]:
        return [
            json.loads(ln)
            for ln in log.read_text().splitlines()
            if ln.startswith("{") and '"marker_survivors_stopped"' in ln
        ]

    # Its word comes after its stop: wait for the word, not for the death.
    (event,) = wait_for(swept, MARKER_SWEEP + LOADED, what="the daemon's sweep to stop it")
    assert event["pids"] == [pid] and event["survivors"] == [], event
    assert not alive(pid)
