"""The holder scan spread over forked workers (``scan(forks=True)``, what ``hold audit``
runs), against real processes holding real nodes.

A machine needs hundreds of processes before a scan forks at all
(``PER_FORK``); here it is lowered to 1 and the cores are said to be 8, so
that every test's scan really runs in several processes (``os.fork`` is
counted to prove it). What the forked scan finds must be what one process
finds: holders by descriptor and by mapping only, and processes it may not
read counted as not inspected, never as empty -- also when a worker cannot
be started or dies.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import as_user, wait_for
from test_audit import Procs, fake_nodes, open_to_others, user_holder, user_python

from hold.devices import holders
from hold.devices.classes import DeviceClass
from hold_supervisor.proc import scan as procscan
from hold_supervisor.proc.identity import Stat


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def forks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every scan forks (8 "cores", one pid a worker); the pids of the workers forked."""
    monkeypatch.setattr(holders, "PER_FORK", 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(8)))
    forked: list[int] = []
    real_fork = os.fork

    def fork() -> int:
        pid = real_fork()
        if pid:
            forked.append(pid)
        return pid

    monkeypatch.setattr(os, "fork", fork)
    return forked


def targets_of(nodes: list[Path]) -> dict[holders.Key, holders.Target]:
    return holders.targets({"fake": DeviceClass("fake", tuple(map(str, nodes)))})


def found(scan: holders.Scan) -> set[tuple[int, int | None, str]]:
    return {(h.pid, h.unit, h.how) for h in scan.holders}


def test_forked_scan_finds_descriptors_and_mappings(
    tmp_path: Path, procs: Procs, forks: list[int]
) -> None:
    nodes = fake_nodes(tmp_path)
    by_fd = procs.holder("fd", nodes[0])["holder"]
    by_map = procs.holder("mmap", nodes[1])["holder"]
    tgts = targets_of(nodes)
    spread = holders.scan(tgts, forks=True)
    # 8 shares: this process and up to 7 workers (a fork the machine refuses
    # at that moment leaves its share to this process: see the next test).
    assert 1 <= len(forks) <= 7, forks
    assert {(by_fd, 0, "fd"), (by_map, 1, "mmap")} <= found(spread)
    one = holders.scan(tgts)
    assert found(spread) == found(one)
    assert spread.not_inspected == one.not_inspected
    for pid in forks:  # every worker was reaped
        assert procscan.stat_of(pid) is None


@pytest.mark.parametrize("failure", ["fork", "worker"])
def test_batches_whose_worker_failed_are_read_here(
    tmp_path: Path, procs: Procs, forks: list[int], monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    nodes = fake_nodes(tmp_path)
    by_fd = procs.holder("fd", nodes[0])["holder"]
    by_map = procs.holder("mmap", nodes[1])["holder"]
    tgts = targets_of(nodes)
    want = found(holders.scan(tgts))
    stolen = tmp_path / "stolen"
    if failure == "fork":

        def no_fork() -> int:
            raise BlockingIOError(11, "Resource temporarily unavailable")  # the process limit

        monkeypatch.setattr(os, "fork", no_fork)
    else:

        def dies(_m: object, _b: object, queue: int, _pipe: object, _mask: object) -> None:
            # Takes every batch it can from the queue, then dies without an
            # answer (as if killed): what it took must be read again.
            n = 0
            while os.read(queue, 4):
                n += 1
            with open(stolen, "a") as f:
                f.write(f"{n}\n")
            os._exit(9)

        monkeypatch.setattr(holders, "_worker", dies)
    spread = holders.scan(tgts, forks=True)
    assert {(by_fd, 0, "fd"), (by_map, 1, "mmap")} <= found(spread) == want
    if failure == "worker":
        assert 1 <= len(forks) <= 7
        assert sum(map(int, stolen.read_text().split())) > 0


def test_forked_scans_from_several_threads_at_once(
    tmp_path: Path, procs: Procs, forks: list[int]
) -> None:
    """``hold web`` serves from threads: scans forked at the same time each get
    their own answer, and none waits on a pipe another one's workers inherited."""
    nodes = fake_nodes(tmp_path)
    by_fd = procs.holder("fd", nodes[0])["holder"]
    by_map = procs.holder("mmap", nodes[1])["holder"]
    tgts = targets_of(nodes)
    got: list[set[tuple[int, int | None, str]]] = []
    # The holders among a few hundred of the machine's processes, not all of
    # them: what is tested is the threads, not the machine's size. Fifteen
    # scans of a machine other runs fill with thousands of processes cost that
    # many times more (with six suites at once on 16 cores every copy failed
    # this test, its message lost with the cut-off logs; alone it passed).
    some = sorted({by_fd, by_map, *procscan.pids()[:300]})

    def scans() -> None:
        for _ in range(5):
            got.append(found(holders.scan(tgts, some, forks=True)))

    threads = [threading.Thread(target=scans) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a scan hangs"
    assert len(got) == 15 and 15 <= len(forks) <= 15 * 7
    assert all({(by_fd, 0, "fd"), (by_map, 1, "mmap")} <= g for g in got), got


REFUSED_FORK = """
import json, os, sys
from hold.devices import holders
from hold.devices.classes import DeviceClass
holders.PER_FORK = 1
os.sched_getaffinity = lambda _pid: set(range(8))
def refuse(event, _args):
    # As filelock 4.3's hook does while another thread is inside a fork.
    if event == "os.fork":
        raise RuntimeError("os.fork is unsafe while filelock is changing descriptor ownership")
sys.addaudithook(refuse)
tgts = holders.targets({"fake": DeviceClass("fake", tuple(sys.argv[1:]))})
print(json.dumps(sorted(h.pid for h in holders.scan(tgts, forks=True).holders)))
"""


def test_a_fork_refused_by_an_audit_hook_is_read_in_process(tmp_path: Path, procs: Procs) -> None:
    """A library's audit hook that refuses ``os.fork`` (a RuntimeError) costs the
    scan its workers, not its answer. In a child: an audit hook cannot be removed."""
    nodes = fake_nodes(tmp_path)
    by_fd = procs.holder("fd", nodes[0])["holder"]
    by_map = procs.holder("mmap", nodes[1])["holder"]
    res = subprocess.run(
        [sys.executable, "-c", REFUSED_FORK, *map(str, nodes)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert {by_fd, by_map} <= set(json.loads(res.stdout)), res.stdout


SCAN_AS = """
import json, os, sys
from hold.devices import holders
from hold.devices.classes import DeviceClass
holders.PER_FORK = 1
os.sched_getaffinity = lambda _pid: set(range(8))
tgts = holders.targets({"fake": DeviceClass("fake", tuple(sys.argv[1:]))})
spread, one = holders.scan(tgts, forks=True), holders.scan(tgts)
print(json.dumps({name: {"holders": sorted(h.pid for h in s.holders),
                         "not_inspected": s.not_inspected}
                  for name, s in (("spread", spread), ("one", one))}))
"""


def test_forked_workers_count_what_they_may_not_read(
    tmp_path: Path, procs: Procs, unpriv_user: str, unpriv_runtime: Path
) -> None:
    """Run as an unprivileged user, the workers find that user's holder, and
    root's holder is not found but counted as not inspected."""
    nodes = fake_nodes(tmp_path)
    open_to_others(tmp_path)
    roots = procs.holder("fd", nodes[0])["holder"]
    theirs = user_holder(procs, unpriv_user, nodes[1])
    py = user_python(unpriv_user, unpriv_runtime)
    argv = as_user(unpriv_user, [py, "-c", SCAN_AS, *map(str, nodes)], unpriv_runtime, {})
    res = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    for name in ("spread", "one"):
        assert theirs in doc[name]["holders"], doc
        assert roots not in doc[name]["holders"], doc
        assert doc[name]["not_inspected"] > 0, doc
    assert doc["spread"]["holders"] == doc["one"]["holders"]


INTERRUPTED = """
import os, signal, sys
# As at a terminal: a suite started in the background (nohup, `&` in a script)
# has SIGINT ignored, inherited, and Python then installs no ^C of its own.
signal.signal(signal.SIGINT, signal.default_int_handler)
from hold.devices import holders
from hold.devices.classes import DeviceClass
holders.PER_FORK = 1
os.sched_getaffinity = lambda _pid: set(range(8))
tgts = holders.targets({"fake": DeviceClass("fake", (sys.argv[1],))})
print("scanning", flush=True)
try:
    while True:
        holders.scan(tgts, forks=True)
except KeyboardInterrupt:
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    print("interrupted", os.getpid(), sorted(blocked), flush=True)
"""


def test_a_ctrl_c_ends_the_workers_and_reaches_only_the_caller(tmp_path: Path) -> None:
    """^C at a terminal goes to the whole group, workers too: each must end (never
    unwind into its parent's code, as a second caller), and the caller gets it,
    with no signal left blocked (where it lands as a worker is forked)."""
    node = fake_nodes(tmp_path, 1)[0]
    proc = subprocess.Popen(
        [sys.executable, "-c", INTERRUPTED, str(node)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "scanning\n"
        for _ in range(20):  # land some of them while workers run
            time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGINT)
            if proc.poll() is not None:
                break
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the scan did not end on ^C: {_where(proc.pid)}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert out.splitlines() == [f"interrupted {proc.pid} []"]
    wait_for(lambda: not _group(proc.pid), 10, 0.05, "the workers' end")


def _where(pgid: int) -> str:
    """Where each process of the group ``pgid`` is (state, kernel wait, signals
    blocked and ignored, kernel stack where root may read it): for a failure."""
    out = []
    for pid in _group(pgid):
        try:
            status = dict(
                line.split(":\t", 1)
                for line in procscan.read_raw(pid, "status").decode().splitlines()
                if ":\t" in line
            )
            wchan = procscan.read_raw(pid, "wchan").decode()
            stack = procscan.read_raw(pid, "stack").decode().replace("\n", " | ")
        except OSError as e:
            out.append(f"{pid}: {e}")
            continue
        sig = {k: status.get(k, "?").strip() for k in ("State", "SigBlk", "SigIgn", "SigPnd")}
        out.append(f"{pid}: {sig} wchan={wchan} stack={stack}")
    return "; ".join(out) or "no process of its group left"


def _group(pgid: int) -> list[int]:
    """The live processes of the process group ``pgid``."""
    out = []
    for pid in procscan.pids():
        st = procscan.stat_of(pid)
        if st is not None and st.pgrp == pgid and not st.is_dead:
            out.append(pid)
    return out


def test_stats_reads_only_what_is_asked() -> None:
    stats = procscan.Stats()

    # The same processes (pid and start time); their state may change between
    # the two reads (pytest-xdist's controller runs while this worker reads).
    def chain(ancestors: list[Stat]) -> list[tuple[int, int]]:
        return [(a.pid, a.starttime) for a in ancestors]

    assert chain(procscan.ancestors(os.getpid(), stats)) == chain(procscan.ancestors(os.getpid()))
    assert set(stats) == {os.getpid()} | {a.pid for a in procscan.ancestors(os.getpid())}
    child = subprocess.Popen(["true"])
    child.wait()
    assert stats.get(child.pid) is None and child.pid not in set(stats)
