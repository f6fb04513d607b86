"""Nobody is handed a device that is not empty: the daemon's scans around grants.

The devices are a class ``fake`` over temporary files; a "stray" is a plain
process holding one open outside any lease (someone bypassing the tickets,
or an orphan from before the daemon started).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
from conftest import HOLD, alive, audit_clean, update_config, wait_for

PY = sys.executable
# Holds the file open (descriptor 3) until killed, and says so.
HOLDER = "import sys,time; f=open(sys.argv[1]); print('holding', flush=True); time.sleep(600)"


@pytest.fixture
def fake(isolated_hold: Path) -> list[Path]:
    nodes = [isolated_hold / f"fakedev{i}" for i in range(2)]
    for n in nodes:
        n.write_bytes(b"\0" * 16)
    update_config(isolated_hold, devices={"fake": {"nodes": [f"{isolated_hold}/fakedev*"]}})
    return nodes


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.terminate()
    for p in started:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


def _stray(procs: list[subprocess.Popen[str]], node: Path) -> subprocess.Popen[str]:
    p = subprocess.Popen([PY, "-c", HOLDER, str(node)], stdout=subprocess.PIPE, text=True)
    procs.append(p)
    assert p.stdout is not None and p.stdout.readline().strip() == "holding"
    return p


def _hold(procs: list[subprocess.Popen[str]], *args: str) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [*HOLD, "run", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    procs.append(p)
    return p


class Said:
    """What a process writes to stderr, read by a thread as it comes."""

    def __init__(self, p: subprocess.Popen[str]) -> None:
        assert p.stderr is not None
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(p.stderr,), daemon=True)
        self.thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = 20) -> None:
        wait_for(lambda: text in self.text(), timeout, what=f"{text!r} on stderr")

    def all(self) -> str:
        """Everything, once the process has closed its stderr."""
        self.thread.join(timeout=10)
        return self.text()


def test_device_held_outside_any_lease_is_not_granted_until_empty(
    fake: list[Path], procs: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    stray = _stray(procs, fake[0])
    marker = tmp_path / "ran"
    client = _hold(procs, "--device", "fake:0", "-l", "waiter", "--", "touch", str(marker))
    said = Said(client)
    # It waits, and says who holds the device (after its first second).
    said.wait_for(f"held OUTSIDE any lease by pid {stray.pid}")
    assert client.poll() is None and not marker.exists()
    stray.terminate()
    stray.wait(timeout=10)
    # The stray's exit wakes the daemon (its pidfd), which scans again and grants.
    assert client.wait(timeout=20) == 0
    assert marker.exists()
    err = said.all()
    assert "granted fake:0" in err, err


def test_busy_devices_warn_grants_and_names_the_holder(
    fake: list[Path], procs: list[subprocess.Popen[str]], isolated_hold: Path
) -> None:
    config = isolated_hold / "config.yaml"
    config.write_text(config.read_text() + "busy_devices: warn\n")
    stray = _stray(procs, fake[1])
    client = _hold(procs, "--device", "fake:1", "--", "true")
    assert client.wait(timeout=20) == 0
    assert client.stderr is not None
    err = client.stderr.read()
    assert "warning: granted although" in err and str(stray.pid) in err, err
    assert alive(stray.pid)  # a warning only: nothing of the stray's is touched


def test_a_holder_left_on_the_device_is_stopped_before_the_next_grant(
    fake: list[Path], procs: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    go = tmp_path / "go"
    # The lease holder's command waits for `go`; meanwhile a process outside
    # its tree opens the leased device (it slipped in during the lease).
    first = _hold(
        procs,
        "--device",
        "fake:0",
        "-l",
        "first",
        "--grace",
        "1s",
        "--",
        PY,
        "-c",
        f"import os,time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.02)",
    )
    wait_for(
        lambda: (fake[0].parent / "state" / "fake-0.token").exists(), 20, what="the first lease"
    )
    intruder = _stray(procs, fake[0])
    second = _hold(procs, "--device", "fake:0", "-l", "second", "--", "true")
    # Waiting behind the first lease, and saying so (after its first second).
    Said(second).wait_for("waiting for fake, number 1 in line: fake:0 held by 'first'")
    assert second.poll() is None
    go.touch()
    assert first.wait(timeout=20) == 0
    # The intruder is a survivor of the first lease: stopped, then the device
    # goes to the next in line.
    assert second.wait(timeout=30) == 0
    assert intruder.wait(timeout=5) is not None
    log = (fake[0].parent / "state" / "daemon.log").read_text()
    assert f'"tree": "left{intruder.pid}"' in log, log  # stopped as the lease's leftover


def test_an_allowed_holder_neither_blocks_a_grant_nor_is_stray(
    fake: list[Path], procs: list[subprocess.Popen[str]], isolated_hold: Path
) -> None:
    # A root process of a configured executable (a persistence daemon, say)
    # keeps the node open; another executable doing the same is still stray.
    sleep = os.path.realpath(shutil.which("sleep") or "/bin/sleep")
    update_config(
        isolated_hold,
        devices={
            "fake": {"nodes": [f"{isolated_hold}/fakedev*"], "allowed_holders": [sleep]},
        },
    )
    daemonish = subprocess.Popen(["sh", "-c", f'exec {sleep} 600 3<"{fake[0]}"'])
    procs.append(daemonish)  # type: ignore[arg-type]
    wait_for(lambda: os.path.realpath(f"/proc/{daemonish.pid}/exe") == sleep, 10)
    client = _hold(procs, "--device", "fake:0", "--", "true")
    assert client.wait(timeout=20) == 0  # granted without waiting on the allowed holder
    res = subprocess.run(
        [*HOLD, "audit", "--device", "fake", "--json"], capture_output=True, text=True, timeout=60
    )
    rows = [r for r in json.loads(res.stdout)["holders"] if r["pid"] == daemonish.pid]
    assert rows and all(r["covered"] and r["lease"] is None for r in rows), rows
    assert res.returncode == audit_clean(res.stdout), res.stdout
    stray = _stray(procs, fake[0])
    res = subprocess.run(
        [*HOLD, "audit", "--device", "fake", "--json"], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 1
    assert any(
        r["pid"] == stray.pid and not r["covered"] for r in json.loads(res.stdout)["holders"]
    )


def test_status_shows_what_blocks_a_device_no_lease_holds(
    fake: list[Path], procs: list[subprocess.Popen[str]]
) -> None:
    """Not "free" (issue 25): a device a stray holds is shown blocked, by whom."""
    stray = _stray(procs, fake[0])
    refused = subprocess.run(
        [*HOLD, "run", "--device", "fake:0", "--no-wait", "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 75, refused.stderr
    res = subprocess.run([*HOLD, "status"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("fake:0"))
    assert "blocked" in line and f"held outside any lease by pid {stray.pid}" in line, line
    doc = json.loads(
        subprocess.run(
            [*HOLD, "status", "--json"], capture_output=True, text=True, timeout=60
        ).stdout
    )
    holder = doc["classes"]["fake"]["devices"][0]["holder"]
    assert holder["state"] == "blocked" and holder["pid"] == stray.pid, holder
    free = doc["classes"]["fake"]["devices"][1]["holder"]
    assert free is None  # the other device is free, and said so


def test_status_names_a_stray_no_grant_has_scanned_for(
    fake: list[Path], procs: list[subprocess.Popen[str]]
) -> None:
    """Not "free" before any grant has looked (issue 45): a device whose count has
    no scan behind it yet is "unknown", and status starts the scan (saying so)
    that names the stray; the device nobody holds is then "free" by the count."""

    def devices() -> list[dict[str, object]]:
        res = subprocess.run(
            [*HOLD, "status", "--json"], capture_output=True, text=True, timeout=60
        )
        assert res.returncode == 0, res.stderr
        out: list[dict[str, object]] = json.loads(res.stdout)["classes"]["fake"]["devices"]
        return out

    stray = _stray(procs, fake[0])
    first = devices()
    for dev in first:
        assert dev["holder"] is None and dev["known"] == "unknown", first
        assert "a scan is running" in str(dev["proof"]), first
    later = wait_for(
        lambda: (d := devices())[0]["holder"] is not None and d[1].get("known") == "free" and d,
        20,
        what="status to show what its scan found",
    )
    holder = later[0]["holder"]
    assert isinstance(holder, dict) and holder["state"] == "blocked", later
    assert holder["pid"] == stray.pid, later
    assert str(later[1]["proof"]).startswith("count"), later
