"""The ticket daemon with real clients: ``npu-hold``, ``gpu-hold``, ``hold run``,
``hold status``, ``hold check``, ``hold release`` and ``hold daemon``.

Every test has its own state directory and configuration (conftest); the
first client autostarts the daemon, conftest stops it afterwards, and the
leak check proves that nothing a test started is left running.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import (
    HOLD,
    LOADED,
    PROGS,
    alive,
    as_user,
    daemon_pid,
    launcher_of,
    unpriv_python,
    wait_for,
    write_config,
)

from hold.daemon.tokens import read_record
from hold_supervisor.proc import scan

PY = sys.executable
BIN = Path(sys.executable).parent
NPU_HOLD = str(BIN / "npu-hold")
GPU_HOLD = str(BIN / "gpu-hold")
GATED = str(PROGS / "gated.py")
CRITICAL = str(PROGS / "critical.py")
NASTY = str(PROGS / "nasty_tree.py")


# --------------------------------------------------------------------------
# Helpers.


class Clients:
    """Clients started by one test; any still running at the end are stopped politely
    (so that they stop their own trees), then killed."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.procs: list[subprocess.Popen[str]] = []
        self.names: dict[int, str] = {}

    def start(self, argv: list[str], name: str, **kw: Any) -> subprocess.Popen[str]:
        err = open(self.base / f"{name}.stderr", "w")  # noqa: SIM115
        try:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err, text=True, **kw
            )
        finally:
            err.close()
        self.procs.append(proc)
        self.names[proc.pid] = name
        return proc

    def stderr(self, proc_or_name: subprocess.Popen[str] | str) -> str:
        name = proc_or_name if isinstance(proc_or_name, str) else self.names[proc_or_name.pid]
        return (self.base / f"{name}.stderr").read_text()

    def wait(self, proc: subprocess.Popen[str], timeout: float = 30) -> int:
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.names[proc.pid]} did not end within {timeout}s: {self.stderr(proc)}"
            ) from None

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGTERM):
                    try:
                        proc.send_signal(sig)
                    except ProcessLookupError:
                        pass
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def clients(tmp_path: Path) -> Iterator[Clients]:
    c = Clients(tmp_path)
    yield c
    c.stop_all()


def state_dir() -> Path:
    return Path(os.environ["HOLD_STATE_DIR"])


def configure(tmp_path: Path, devices: str = "", cgroups: str = "auto") -> None:
    """Rewrite this test's configuration (``devices``: YAML under ``devices:``, beside
    the test's own ``npu`` and ``gpu``)."""
    write_config(tmp_path, cgroups=cgroups, devices=yaml.safe_load(devices) if devices else None)


def fake_class(tmp_path: Path, name: str, count: int, cgroups: str = "auto") -> list[Path]:
    """A device class ``name`` of ``count`` temporary files."""
    d = tmp_path / f"{name}-nodes"
    d.mkdir()
    nodes = [d / f"{name}dev{i}" for i in range(count)]
    for n in nodes:
        n.write_text("")
    configure(tmp_path, f'{name}: {{nodes: ["{d}/{name}dev*"]}}', cgroups)
    return nodes


def hold(*args: str, timeout: float = 30, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*HOLD, *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def status() -> dict[str, Any]:
    res = hold("status", "--json")
    assert res.returncode == 0, res.stderr
    out: dict[str, Any] = json.loads(res.stdout)["classes"]
    return out


def queue_len(cls: str) -> int:
    return len(status()[cls]["queue"])


def holder(cls: str, index: int = 0) -> dict[str, Any] | None:
    h: dict[str, Any] | None = status()[cls]["devices"][index]["holder"]
    return h


def token(cls: str, index: int = 0) -> dict[str, Any] | None:
    return read_record(str(state_dir() / f"{cls}-{index}.token"))


def wait_queued(cls: str, n: int, timeout: float = 20) -> None:
    wait_for(lambda: queue_len(cls) == n, timeout, 0.05, f"{n} waiting for {cls}")


def wait_file(path: Path, timeout: float = 20) -> str:
    return wait_for(lambda: path.exists() and path.read_text(), timeout, what=str(path))


def nasty(tmp_path: Path, tag: str = "") -> tuple[list[str], Path, Path, Path]:
    """The argv of a TERM-ignoring tree with a setsid escapee holding a "device" file."""
    device = tmp_path / f"device{tag}"
    device.write_text("")
    port, ready = tmp_path / f"port{tag}", tmp_path / f"ready{tag}"
    argv = [PY, NASTY, str(device), str(port), str(ready), "--forkers", "1", "--sleepers", "1"]
    return argv, device, port, ready


def wait_nasty_ready(ready: Path, timeout: float = 20) -> list[int]:
    roles = {"main", "child", "escapee", "forker", "sleeper"}

    def done() -> list[int] | None:
        if not ready.exists():
            return None
        lines = ready.read_text().splitlines()
        if {ln.split()[0] for ln in lines} != roles:
            return None
        return [int(ln.split()[1]) for ln in lines]

    pids: list[int] = wait_for(done, timeout, what="the nasty tree to be in place")
    return pids


def holders_of_file(path: Path) -> dict[int, Any]:
    return scan.holders_of([scan.node_of_stat(os.stat(path), str(path))], scan.pids())


def assert_tree_gone(pids: list[int], device: Path) -> None:
    living = [p for p in pids if alive(p)]
    assert not living, f"still alive: {living}"
    assert holders_of_file(device) == {}, "someone still holds the device file"


def wait_tree_gone(pids: list[int], device: Path, timeout: float) -> float:
    """Wait until none of ``pids`` lives and nobody holds ``device``; returns the time taken."""
    t0 = time.monotonic()
    wait_for(
        lambda: not any(alive(p) for p in pids) and not holders_of_file(device),
        timeout,
        0.02,
        "the tree to be stopped",
    )
    return time.monotonic() - t0


def daemon_events() -> list[dict[str, Any]]:
    """The daemon's log, each event with its time as ``t`` (seconds since the epoch)."""
    out = []
    for line in (state_dir() / "daemon.log").read_text().splitlines():
        if not line.startswith("{"):
            continue
        e = json.loads(line)
        e["t"] = datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
        out.append(e)
    return out


def order(tmp_path: Path) -> list[str]:
    f = tmp_path / "order"
    return f.read_text().split() if f.exists() else []


def gated(tmp_path: Path, name: str, wait: bool = False) -> list[str]:
    return [PY, GATED, str(tmp_path), name, *(["--wait"] if wait else [])]


def go(tmp_path: Path, name: str) -> None:
    (tmp_path / f"{name}.go").write_text("")


# --------------------------------------------------------------------------
# Mutual exclusion, arrival order, multi-device requests.


def test_mutual_exclusion_under_contention(tmp_path: Path, clients: Clients) -> None:
    marker, log = tmp_path / "inside", tmp_path / "log"
    n = 30
    t0 = time.monotonic()
    argv = [
        [NPU_HOLD, "-l", f"c{i}", "--", PY, CRITICAL, str(marker), str(log), f"c{i}"]
        for i in range(n)
    ]
    procs = [clients.start(a, f"c{i}") for i, a in enumerate(argv)]
    codes = [clients.wait(p, 90) for p in procs]
    took = time.monotonic() - t0
    assert codes == [0] * n, [clients.stderr(p) for p, c in zip(procs, codes, strict=True) if c]
    lines = log.read_text().splitlines()
    assert not [ln for ln in lines if ln.startswith("overlap")], lines
    assert sorted(lines) == sorted(f"ok c{i}" for i in range(n))
    assert not marker.exists()
    assert took < 60, took


def test_arrival_order(tmp_path: Path, clients: Clients) -> None:
    h = clients.start([NPU_HOLD, "-l", "holder", "--", *gated(tmp_path, "H", wait=True)], "H")
    wait_file(tmp_path / "H.ready")
    waiters = []
    for i, name in enumerate("ABC", 1):
        waiters.append(clients.start([NPU_HOLD, "-l", name, "--", *gated(tmp_path, name)], name))
        wait_queued("npu", i)
    q = status()["npu"]["queue"]
    assert [w["label"] for w in q] == ["A", "B", "C"]
    assert [w["pid"] for w in q] == [p.pid for p in waiters]
    go(tmp_path, "H")
    assert clients.wait(h) == 0
    for p in waiters:
        assert clients.wait(p) == 0, clients.stderr(p)
    assert order(tmp_path) == ["H", "A", "B", "C"]


def test_two_devices_wait_in_line_and_are_not_starved(tmp_path: Path, clients: Clients) -> None:
    fake_class(tmp_path, "fake", 2)
    run = [*HOLD, "run", "--device"]
    h = clients.start([*run, "fake:0", "-l", "H", "--", *gated(tmp_path, "H", wait=True)], "H")
    wait_file(tmp_path / "H.ready")
    # W wants both devices; one is free, the other held by H: W waits.
    w = clients.start(
        [*run, "fake", "-n", "2", "-l", "W", "--", *gated(tmp_path, "W", wait=True)], "W"
    )
    wait_queued("fake", 1)
    # Later single requests do not take the free device W is waiting for.
    singles = []
    for i, name in enumerate(["S1", "S2"], 2):
        singles.append(
            clients.start([*run, "fake", "-l", name, "--", *gated(tmp_path, name)], name)
        )
        wait_queued("fake", i)
    st = status()["fake"]
    assert st["devices"][1]["holder"] is None  # free, but reserved for W
    assert [q["label"] for q in st["queue"]] == ["W", "S1", "S2"]
    assert st["queue"][0]["count"] == 2
    assert order(tmp_path) == ["H"]
    # H ends: W gets both devices, the singles still wait.
    go(tmp_path, "H")
    assert clients.wait(h) == 0
    wait_file(tmp_path / "W.ready")
    env = json.loads((tmp_path / "W.env").read_text())
    assert env["HOLD_DEVICES"] == "fake:0,fake:1"
    st = status()["fake"]
    assert [d["holder"]["label"] for d in st["devices"]] == ["W", "W"]
    assert [q["label"] for q in st["queue"]] == ["S1", "S2"]
    go(tmp_path, "W")
    assert clients.wait(w) == 0
    for p in singles:
        assert clients.wait(p) == 0, clients.stderr(p)
    assert order(tmp_path)[:2] == ["H", "W"]
    assert sorted(order(tmp_path)[2:]) == ["S1", "S2"]


# --------------------------------------------------------------------------
# The lifeline and expiry.


def test_holder_sigkilled_tree_stopped_and_next_granted_within_1s(
    tmp_path: Path, clients: Clients, cgroup_mode: str
) -> None:
    argv, device, _port, ready = nasty(tmp_path)
    h = clients.start([NPU_HOLD, "-l", "nasty", "--grace", "0.5s", "--", *argv], "H")
    pids = wait_nasty_ready(ready)
    lease = wait_for(
        lambda: (tok := token("npu")) and tok["command_pid"] and tok["lease"],
        what="the holder's token",
    )
    assert holders_of_file(device), "the escapee holds the device file"
    w = clients.start([NPU_HOLD, "-l", "next", "--", *gated(tmp_path, "W")], "W")
    wait_queued("npu", 1)

    killed_at = time.time()
    os.kill(launcher_of(h.pid), signal.SIGKILL)  # the one holding the lifeline
    # The waiter is granted once the tree is stopped (the whole 0.5 s grace:
    # everything ignores TERM), and its token names its own lease.
    wait_for(
        lambda: (tok := token("npu")) is not None and tok["lease"] != lease,
        10,
        0.005,
        "the next waiter's grant",
    )
    # The tree was stopped before the grant.
    assert_tree_gone(pids, device)
    assert clients.wait(w) == 0, clients.stderr(w)
    # Walk mode: its keeper outlived it, and says how it ended (128+9).
    assert clients.wait(h) == (-signal.SIGKILL if cgroup_mode == "cgroup" else 128 + 9)
    assert order(tmp_path) == ["W"]
    # The handoff, by the daemon's own clock (not this test's polling).
    events = daemon_events()
    ending = next(e for e in events if e["event"] == "session_ending" and e["lease"] == lease)
    assert ending["reason"] == "lifeline"
    stopped = next(e for e in events if e["event"] == "tree_stopped" and e["lease"] == lease)
    granted = next(e for e in events if e["event"] == "granted" and e["label"] == "next")
    handoff = granted["t"] - killed_at
    assert handoff < 1.0, (
        f"granted {handoff:.3f}s after the holder was killed: lifeline noticed after "
        f"{ending['t'] - killed_at:.3f}s, stop took {stopped['duration_ms']} ms (grace 500), "
        f"granted {granted['t'] - stopped['t']:.3f}s after; load {os.getloadavg()}"
    )


def test_expiry_exits_124_and_tree_gone(tmp_path: Path, clients: Clients) -> None:
    argv, device, _port, ready = nasty(tmp_path)
    t0 = time.monotonic()
    # 8 s: the lease must outlast the tree's start-up on a loaded machine.
    h = clients.start([NPU_HOLD, "-t", "8s", "--grace", "0.5s", "--", *argv], "H")
    pids = wait_nasty_ready(ready)
    assert clients.wait(h, 40) == 124, clients.stderr(h)
    took = time.monotonic() - t0
    assert "lease expired" in clients.stderr(h)
    assert_tree_gone(pids, device)
    assert 8.5 <= took < 8.5 + LOADED, took
    wait_for(lambda: token("npu") is None, 10, what="the token to be removed")
    assert holder("npu") is None


# --------------------------------------------------------------------------
# Crash safety: the daemon is SIGKILLed and started again.


def kill_daemon() -> int:
    pid = daemon_pid(state_dir())
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not alive(pid), 20, what="the daemon to die")
    return pid


def test_daemon_sigkilled_holder_reattaches_nobody_else_granted(
    tmp_path: Path, clients: Clients, cgroup_mode: str
) -> None:
    h = clients.start([NPU_HOLD, "-l", "holder", "--", *gated(tmp_path, "H", wait=True)], "H")
    wait_file(tmp_path / "H.ready")
    lease = wait_for(
        lambda: (tok := token("npu")) and tok["command_pid"] and tok["lease"],
        what="the holder's token",
    )
    w = clients.start([NPU_HOLD, "-l", "W", "--", *gated(tmp_path, "W")], "W")
    wait_queued("npu", 1)

    old = kill_daemon()
    # A client that starts during the outage: it starts a daemon or finds the
    # one the holder started, and waits in line.
    c = clients.start([NPU_HOLD, "-l", "C", "--", *gated(tmp_path, "C")], "C")
    wait_for(lambda: "re-attached" in clients.stderr(h), 20, 0.05, "the holder to re-attach")
    new = daemon_pid(state_dir())
    assert new is not None and new != old
    # The waiter lost its place with its connection, and asked the new daemon
    # again: it waits in line (in some order with C), never granted meanwhile.
    wait_for(lambda: "asking a new one" in clients.stderr(w), 20, 0.05, "the waiter to re-ask")
    try:
        wait_queued("npu", 2)
    except AssertionError as e:
        raise AssertionError(f"{e}\nW: {clients.stderr(w)}\nC: {clients.stderr(c)}") from None
    st = status()["npu"]
    assert st["devices"][0]["holder"]["lease"] == lease
    assert st["devices"][0]["holder"]["pid"] == h.pid
    assert sorted(q["label"] for q in st["queue"]) == ["C", "W"]
    assert h.poll() is None and w.poll() is None
    assert order(tmp_path) == ["H"]
    tok = token("npu")
    assert tok is not None and tok["lease"] == lease
    # The holder ends normally: the others are granted, one after the other,
    # through the new daemon.
    go(tmp_path, "H")
    assert clients.wait(h) == 0, clients.stderr(h)
    assert clients.wait(c) == 0, clients.stderr(c)
    assert clients.wait(w) == 0, clients.stderr(w)
    assert order(tmp_path)[0] == "H" and sorted(order(tmp_path)[1:]) == ["C", "W"]
    assert daemon_pid(state_dir()) == new


def test_daemon_restarted_after_holder_died_stops_the_orphaned_tree(
    tmp_path: Path, clients: Clients, cgroup_mode: str
) -> None:
    argv, device, _port, ready = nasty(tmp_path)
    h = clients.start([NPU_HOLD, "-l", "orphaned", "--grace", "0.5s", "--", *argv], "H")
    pids = wait_nasty_ready(ready)
    lease = wait_for(
        lambda: (tok := token("npu")) and tok["command_pid"] and tok["lease"],
        what="the holder's token",
    )
    # Stopped first, so that it cannot re-attach between the two kills.
    h.send_signal(signal.SIGSTOP)
    kill_daemon()
    h.kill()
    assert clients.wait(h) == -signal.SIGKILL
    assert any(alive(p) for p in pids) and holders_of_file(device)
    # A new client starts a daemon, which ends the dead holder's lease
    # (stopping its tree) before granting the device again.
    n = clients.start([NPU_HOLD, "-l", "next", "--", *gated(tmp_path, "N")], "N")
    assert clients.wait(n) == 0, clients.stderr(n)
    assert_tree_gone(pids, device)
    assert order(tmp_path) == ["N"]
    log = (state_dir() / "daemon.log").read_text()
    assert re.search(rf'"event": "recovered_dead_owner".*"lease": "{lease}"', log), log
    ended = log.index('"event": "session_ended"', log.index("recovered_dead_owner"))
    granted = log.index('"label": "next"', log.index("recovered_dead_owner"))
    assert ended < granted
    wait_for(lambda: token("npu") is None, 10, what="the token to be removed")


# --------------------------------------------------------------------------
# The guard: `hold check`.

CHECK_NPU = [PY, "-m", "hold", "check", "--device", "npu"]


def start_gated_holder(
    clients: Clients, tmp_path: Path, prog: str = NPU_HOLD
) -> tuple[subprocess.Popen[str], str]:
    h = clients.start([prog, "-l", "holder", "--", *gated(tmp_path, "H", wait=True)], "H")
    wait_file(tmp_path / "H.ready")
    cls = "gpu" if prog == GPU_HOLD else "npu"
    lease: str = wait_for(
        lambda: (tok := token(cls)) and tok["command_pid"] and tok["lease"],
        what="the holder's token",
    )
    return h, lease


def test_check_inside_a_lease(clients: Clients) -> None:
    p = clients.start([NPU_HOLD, "--", *CHECK_NPU], "inside")
    assert clients.wait(p) == 0, clients.stderr(p)


def test_check_outside_a_lease(tmp_path: Path, clients: Clients) -> None:
    res = hold("check", "--device", "npu")
    assert res.returncode == 1 and "no npu lease covers this process" in res.stderr, res.stderr
    h, _ = start_gated_holder(clients, tmp_path)
    res = hold("check", "--device", "npu")
    assert res.returncode == 1, res.stderr
    assert len(res.stderr.splitlines()) == 1
    go(tmp_path, "H")
    assert clients.wait(h) == 0


def test_gpu_lease_does_not_satisfy_an_npu_check(clients: Clients) -> None:
    p = clients.start([GPU_HOLD, "--", *CHECK_NPU], "gpu")
    assert clients.wait(p) == 1
    assert "no npu lease covers this process; only gpu lease" in clients.stderr(p)
    p = clients.start([GPU_HOLD, "--", PY, "-m", "hold", "check", "--device", "gpu"], "gpu2")
    assert clients.wait(p) == 0, clients.stderr(p)


def test_check_does_not_trust_token_files(tmp_path: Path, clients: Clients) -> None:
    """Tokens are for people and old scripts: a forged one passes nothing, and
    tampering with a real one changes nothing (the arbiter answers)."""
    # A state directory of our own, with a token naming the asker itself as holder.
    forged_dir = tmp_path / "forged"
    forged_dir.mkdir(mode=0o700)
    forger = tmp_path / "forger.py"
    forger.write_text(
        "import json, os, sys\n"
        "start = int(open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19])\n"
        "rec = {'lease': 'ffff', 'cls': 'npu', 'label': 'x', 'holder_pid': os.getpid(),\n"
        "       'holder_start': start, 'leaves': []}\n"
        f"with open({str(forged_dir / 'npu-0.token')!r}, 'w') as f:\n"
        "    f.write(f'npu-hold x pid {os.getpid()} now\\n' + json.dumps(rec) + '\\n')\n"
        "import subprocess\n"  # the asker is the parent of `hold check`, as in a script
        "sys.exit(subprocess.call([sys.executable, '-m', 'hold', 'check', '--device', 'npu']))\n"
    )
    env = {**os.environ, "HOLD_STATE_DIR": str(forged_dir)}
    p = clients.start([PY, str(forger)], "forged", env=env)
    assert clients.wait(p) == 1, clients.stderr(p)
    assert "no npu lease covers this process" in clients.stderr(p)
    assert json.loads((forged_dir / "npu-0.token").read_text().split("\n")[1])["holder_pid"]

    # Inside a real lease, a token rewritten to name someone else changes nothing.
    check, q = shlex.join(CHECK_NPU), shlex.quote
    gate = tmp_path / "gate"
    h = clients.start(
        [
            NPU_HOLD,
            "-l",
            "holder",
            "--",
            "sh",
            "-c",
            f"while [ ! -e {q(str(gate))} ]; do sleep 0.02; done; exec {check}",
        ],
        "H",
    )
    path = state_dir() / "npu-0.token"
    wait_for(lambda: (tok := token("npu")) and tok["command_pid"], what="the holder's token")
    line, rec = path.read_text().split("\n", 1)
    record = json.loads(rec)
    record["holder_pid"], record["holder_start"] = 1, 1
    forged = state_dir() / "forged.tmp"
    forged.write_text(line + "\n" + json.dumps(record) + "\n")
    forged.rename(path)
    gate.write_text("")
    assert clients.wait(h) == 0, clients.stderr(h)
    assert "inside npu lease" in clients.stderr(h)


def test_forged_command_line_and_environment_do_not_pass(tmp_path: Path, clients: Clients) -> None:
    h, lease = start_gated_holder(clients, tmp_path)
    tok = token("npu")
    assert tok is not None
    line = (state_dir() / "npu-0.token").read_text().splitlines()[0]
    # A parent whose command line names npu-hold, the lease and the token line.
    forger = f"import subprocess, sys; sys.exit(subprocess.call({CHECK_NPU!r}))"
    res = subprocess.run(
        [PY, "-c", forger, "npu-hold", lease, line],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 1, res.stderr
    # An environment that claims the lease (and even the holder's tree marker).
    env_h = json.loads((tmp_path / "H.env").read_text())
    forged_env = {
        **os.environ,
        "HOLD_LEASE": lease,
        "HOLD_DEVICES": "npu:0",
        "HOLD_TREE": env_h["HOLD_TREE"],
    }
    res = subprocess.run(CHECK_NPU, capture_output=True, text=True, timeout=30, env=forged_env)
    assert res.returncode == 1, res.stderr
    go(tmp_path, "H")
    assert clients.wait(h) == 0


def test_daemonised_descendant_passes_by_cgroup(tmp_path: Path, clients: Clients) -> None:
    from hold_supervisor.proc.cgroup import CgroupUnavailable, Hierarchy

    try:
        Hierarchy.find()
    except CgroupUnavailable as e:
        pytest.skip(f"no writable cgroup v2 here: {e}")
    configure(tmp_path, cgroups="required")
    out = tmp_path / "out"
    h = clients.start(
        [NPU_HOLD, "--", PY, str(PROGS / "daemonized_check.py"), str(out), "npu"], "H"
    )
    assert clients.wait(h) == 0, clients.stderr(h)
    rc, chain, message = out.read_text().split("\n", 2)
    # Its parent gone, it was re-parented to the holder (a subreaper with a leaf
    # too, issue 24), not to init: found either way.
    assert chain.split()[0] == str(h.pid), chain
    assert rc == "0", message
    assert "inside npu lease" in message, message


# --------------------------------------------------------------------------
# Release: only the lease's user (or root).


@functools.cache
def user_python(user: str, runtime: Path) -> str:
    """A Python that ``user`` may run through ``as_user`` (``env -i`` execs it, so a
    path under a 0700 directory does not do, though setpriv alone could exec it)."""
    for cand in (unpriv_python(), "/usr/bin/python3"):
        ok = subprocess.run(
            as_user(user, [cand, "-c", "import hold.cli.run, hold.cli.group"], runtime, {}),
            capture_output=True,
            timeout=30,
        )
        if ok.returncode == 0:
            return cand
    pytest.skip(f"no Python here that {user} may run with the copied runtime")


def test_another_user_cannot_release_a_lease(
    clients: Clients, unpriv_user: str, other_user: str, unpriv_runtime: Path
) -> None:
    py = user_python(unpriv_user, unpriv_runtime)
    # A root daemon in a state directory both users may reach (not under
    # pytest's 0700 temporary directory), with a shared socket.
    base = Path(tempfile.mkdtemp(prefix="hold-shared-", dir="/tmp"))
    daemon: subprocess.Popen[str] | None = None
    try:
        base.chmod(0o755)
        state, config, work = base / "state", base / "config.yaml", base / "work"
        state.mkdir()
        state.chmod(0o755)
        work.mkdir()
        work.chmod(0o777)
        write_config(base, state={"shared": True})  # npu over nodes in base/dev
        config.chmod(0o644)
        env = {"HOLD_STATE_DIR": str(state), "HOLD_CONFIG": str(config)}
        daemon = clients.start([*HOLD, "daemon"], "daemon", env={**os.environ, **env})
        wait_for(lambda: (state / "daemon.sock").exists(), 20, what="the shared daemon")
        assert (state / "daemon.sock").stat().st_mode & 0o777 == 0o666

        def as_(user: str, *argv: str) -> list[str]:
            return as_user(user, [py, "-m", "hold", *argv], unpriv_runtime, env)

        gated_a = [py, str(unpriv_runtime / "progs" / "gated.py"), str(work), "A", "--wait"]
        a = clients.start(
            as_(
                unpriv_user, "run", "--device", "npu", "-l", "A", "--grace", "0.5s", "--", *gated_a
            ),
            "A",
        )
        command_pid = int(wait_file(work / "A.ready"))
        rec = wait_for(
            lambda: (r := read_record(str(state / "npu-0.token"))) and r, what="A's token"
        )
        lease = rec["lease"]
        assert rec["user"] == unpriv_user and rec["holder_pid"] == a.pid

        def release(user: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                as_(user, "release", lease), capture_output=True, text=True, timeout=30
            )

        res = release(other_user)
        assert res.returncode == 2, res.stderr
        assert f"belongs to {unpriv_user}" in res.stderr
        assert a.poll() is None and alive(command_pid)
        rec2 = read_record(str(state / "npu-0.token"))
        assert rec2 is not None and rec2["lease"] == lease
        # A's own release ends it: the tree is stopped.
        res = release(unpriv_user)
        assert res.returncode == 0, res.stderr
        assert f"lease {lease} released" in res.stdout
        assert clients.wait(a) == 6, clients.stderr(a)  # RELEASED
        assert f"lease released by {unpriv_user}" in clients.stderr(a)
        assert not alive(command_pid)
        assert not (state / "npu-0.token").exists()
    finally:
        if daemon is not None and daemon.poll() is None:
            daemon.terminate()
            daemon.wait(15)
        shutil.rmtree(base, ignore_errors=True)


# --------------------------------------------------------------------------
# Token files and what the command is told.

TOKEN_DATE = r"\w{3} \w{3} \d{2} \d{2}:\d{2}:\d{2} \S+ \d{4}"


@pytest.mark.parametrize("prog", ["npu-hold", "gpu-hold"])
def test_token_file_and_the_commands_environment(
    tmp_path: Path, clients: Clients, prog: str
) -> None:
    cls = prog.split("-")[0]
    h, lease = start_gated_holder(clients, tmp_path, str(BIN / prog))
    path = state_dir() / f"{cls}-0.token"
    assert not path.is_symlink() and path.stat().st_mode & 0o777 == 0o644
    line, rec_text = path.read_text().split("\n", 1)
    assert re.fullmatch(rf"{prog} holder pid {h.pid} {TOKEN_DATE}", line), line
    rec = json.loads(rec_text)
    command_pid = int((tmp_path / "H.ready").read_text())
    assert rec["lease"] == lease and rec["cls"] == cls and rec["devices"] == [0]
    assert rec["holder_pid"] == h.pid
    assert rec["holder_start"] == scan.stat_of(h.pid).starttime  # type: ignore[union-attr]
    assert rec["uid"] == os.getuid() and rec["command_pid"] == command_pid
    assert rec["granted"] <= time.time() < rec["expires"]
    env = json.loads((tmp_path / "H.env").read_text())
    assert env["HOLD_LEASE"] == lease and env["HOLD_DEVICES"] == f"{cls}:0"
    visible = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
    if cls == "gpu":
        assert [env[v] for v in visible] == ["0", "0", "0"]
    else:
        assert not set(visible) & set(env)
    go(tmp_path, "H")
    assert clients.wait(h) == 0
    # The daemon ends the lease when the connection drops, after its own
    # survivor check: moments after the client has exited.
    wait_for(lambda: not path.exists(), 10, what="the token to be removed")
    assert holder(cls) is None


def test_symlinked_token_path_is_refused(tmp_path: Path, clients: Clients) -> None:
    state = state_dir()
    state.mkdir(mode=0o700)
    outside = tmp_path / "outside"
    outside.write_text("precious\n")
    (state / "npu-0.token").symlink_to(outside)
    p = clients.start([NPU_HOLD, "--", "touch", str(tmp_path / "ran")], "P")
    assert clients.wait(p) == 125
    assert "cannot record the lease" in clients.stderr(p) and "symlink" in clients.stderr(p)
    assert outside.read_text() == "precious\n"
    assert (state / "npu-0.token").is_symlink()
    assert not (tmp_path / "ran").exists()
    assert holder("npu") is None
    assert '"event": "grant_refused"' in (state / "daemon.log").read_text()


# --------------------------------------------------------------------------
# Bad input, and not waiting (long).


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["-l", "two\nlines"], "'two\\nlines'"),
        (["-l", "bell\x07"], "'bell\\x07'"),
        (["-l", "x" * 201], "at most 200"),
        (["-t", "5x"], "'5x'"),
        (["--wait-timeout", "abc"], "'abc'"),
    ],
    ids=["newline", "control-char", "201-chars", "time-5x", "wait-timeout-abc"],
)
def test_bad_labels_and_durations_exit_2_and_start_nothing(
    tmp_path: Path, clients: Clients, args: list[str], named: str
) -> None:
    p = clients.start([NPU_HOLD, *args, "--", "touch", str(tmp_path / "ran")], "P")
    assert clients.wait(p) == 2
    err = clients.stderr(p)
    assert named in err, err
    assert not (tmp_path / "ran").exists()
    assert daemon_pid(state_dir()) is None and not (state_dir() / "daemon.sock").exists()


def test_label_of_200_characters_is_accepted(tmp_path: Path, clients: Clients) -> None:
    p = clients.start([NPU_HOLD, "-l", "x" * 200, "--", "true"], "P")
    assert clients.wait(p) == 0, clients.stderr(p)


def test_busy_no_wait_wait_timeout_and_the_waiting_message(
    tmp_path: Path, clients: Clients
) -> None:
    h, lease = start_gated_holder(clients, tmp_path)
    who = f"npu:0 held by 'holder' (lease {lease}, pid {h.pid}, user root)"
    ran = str(tmp_path / "ran")
    t0 = time.monotonic()
    nowait = clients.start([NPU_HOLD, "--no-wait", "--", "touch", ran], "nowait")
    one = clients.start([NPU_HOLD, "--wait-timeout", "1s", "--", "touch", ran], "one")
    longer = clients.start([NPU_HOLD, "--wait-timeout", "2.5s", "--", "touch", ran], "longer")
    assert clients.wait(nowait) == 75
    t_nowait = time.monotonic() - t0
    assert clients.wait(one) == 75
    t_one = time.monotonic() - t0
    assert clients.wait(longer) == 75
    t_longer = time.monotonic() - t0
    assert f"npu is taken: {who}" in clients.stderr(nowait)
    assert "not granted within 1s" in clients.stderr(one)
    assert f"waiting for npu, number 1 in line: {who}" in clients.stderr(longer)
    assert not os.path.exists(ran)
    # Start-up of three clients on a busy machine included: tolerant bounds.
    assert t_nowait < 5, t_nowait
    assert 1.0 <= t_one < 6, t_one
    assert 2.5 <= t_longer < 8, t_longer
    go(tmp_path, "H")
    assert clients.wait(h) == 0


# --------------------------------------------------------------------------
# One daemon per state directory; hold run's tree is guarded too.


def test_second_daemon_refuses_and_the_first_keeps_serving(clients: Clients) -> None:
    first = clients.start([*HOLD, "daemon"], "first")
    wait_for(
        lambda: daemon_pid(state_dir()) == first.pid and (state_dir() / "daemon.sock").exists(),
        20,
        what="the first daemon",
    )
    res = hold("daemon")
    assert res.returncode == 2
    assert f"another daemon (pid {first.pid}) already serves" in res.stderr
    assert first.poll() is None and daemon_pid(state_dir()) == first.pid
    p = clients.start([NPU_HOLD, "--", "true"], "P")
    assert clients.wait(p) == 0, clients.stderr(p)
    # Served by the first: the only daemon that ever started here.
    events = daemon_events()
    assert [e["pid"] for e in events if e["event"] == "daemon_started"] == [first.pid]
    assert [e["pid"] for e in events if e["event"] == "granted"] == [p.pid]
    assert first.poll() is None


def test_hold_run_sigkilled_daemon_stops_its_tree(
    tmp_path: Path, clients: Clients, cgroup_mode: str
) -> None:
    argv, device, port, ready = nasty(tmp_path)
    r = clients.start([*HOLD, "run", "--grace", "0.5s", "--", *argv], "R")
    pids = wait_nasty_ready(ready)
    assert holders_of_file(device)
    os.kill(launcher_of(r.pid), signal.SIGKILL)  # the one holding the lifeline
    # The grace the user gave (0.5 s; everything ignores TERM), then the kill.
    took = wait_tree_gone(pids, device, 30)
    assert clients.wait(r) == (-signal.SIGKILL if cgroup_mode == "cgroup" else 128 + 9)
    assert took < LOADED, took
    # The daemon reports the stop once its survivor check is done.
    stopped = wait_for(
        lambda: [e for e in daemon_events() if e["event"] == "tree_stopped"],
        10,
        what="the daemon's stop report",
    )
    assert [e["reason"] for e in daemon_events() if e["event"] == "session_ending"] == ["lifeline"]
    # Walk mode: the keeper ends the tree too (TERM, the grace, KILL), and may be
    # first, or end it while the daemon waits out its own grace.
    outcomes = ("killed",) if cgroup_mode == "cgroup" else ("killed", "empty", "exited")
    assert len(stopped) == 1 and stopped[0]["outcome"] in outcomes, stopped
    assert stopped[0]["survivors"] == []
    assert int(port.read_text()) not in {ln.port for ln in scan.listeners().values()}


def test_an_idle_daemon_leaves_and_the_next_client_starts_another(tmp_path: Path) -> None:
    """An autostarted daemon exits after its idle time with nothing to do (no
    periodic wake-up before that: the idle deadline is its only timer); the
    next client simply starts a new one."""
    # Not captured: the daemon keeps what it inherited open until it leaves.
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    res = subprocess.run(
        [PY, "-m", "hold", "daemon", "--detach", "--idle-exit", "1s"], timeout=30, **quiet
    )
    assert res.returncode == 0
    first = daemon_pid(state_dir())
    assert first is not None
    wait_for(lambda: not alive(first), 10, 0.05, "the idle daemon to leave")
    log = (state_dir() / "daemon.log").read_text()
    assert '"event": "idle_exit"' in log
    res = subprocess.run([NPU_HOLD, "--", "true"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    second = daemon_pid(state_dir())
    assert second is not None and second != first
