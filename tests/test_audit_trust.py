"""``hold audit`` believes the arbiter, never a token file: a token forged in the
state directory does not make a process holding a device look covered."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import HOLD, PROGS, wait_for

from hold.daemon.tokens import render
from hold.leases import LeaseRecord

HOLDER = str(PROGS / "node_holder.py")


def test_a_forged_token_does_not_cover_a_stray(tmp_path: Path) -> None:
    node = tmp_path / "fakedev0"
    node.write_text("")
    Path(os.environ["HOLD_CONFIG"]).write_text(
        f'devices:\n  fake:\n    nodes: ["{tmp_path}/fakedev*"]\n'
    )
    state = Path(os.environ["HOLD_STATE_DIR"])
    assert subprocess.run([*HOLD, "status"], capture_output=True).returncode == 0  # serving
    out = tmp_path / "holder.out"
    stray = subprocess.Popen([sys.executable, HOLDER, str(out), "fd", str(node)])
    try:
        wait_for(lambda: out.exists() and "holder" in out.read_text(), 10, what="the stray")
        start = int(Path(f"/proc/{stray.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        forged = {
            "lease": "f0f0f0f0",
            "cls": "fake",
            "devices": [0],
            "label": "forged",
            "holder_pid": stray.pid,
            "holder_start": start,
            "uid": 0,
            "user": "root",
            "granted": 0.0,
            "expires": 4e9,
            "command_pid": stray.pid,
            "leaves": [],
            "trees": [],
        }
        (state / "fake-0.token").write_bytes(render("fake", LeaseRecord.from_json(forged)))
        res = subprocess.run(
            [*HOLD, "audit", "--json", "--device", "fake"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 1, res.stdout + res.stderr  # a stray was found
        rows = [r for r in json.loads(res.stdout)["holders"] if r["pid"] == stray.pid]
        assert rows and all(not r["covered"] for r in rows), rows
    finally:
        stray.kill()
        stray.wait()
