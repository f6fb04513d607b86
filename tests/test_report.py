"""``hold report``: figures that match a scripted sequence of leases on a real daemon
(a wait in line, an expiry, a release by ``hold release``, a stray seen), the
history's size bound, and who sees whose labels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import HOLD, PROGS, daemon_pid, wait_for, wait_in_line

from hold.daemon import history
from hold.daemon.report import build
from hold.documents import HistoryLease, LeaseEnd

NPU_HOLD = str(Path(sys.executable).parent / "npu-hold")
HOLDER = str(PROGS / "node_holder.py")
SAMPLE = 0.2  # the held-time scan's period in these tests
SLACK = 1.0  # seconds of tolerance on times measured around process starts and stops


def configure(tmp_path: Path) -> Path:
    node = tmp_path / "accel0"
    node.write_text("")
    Path(os.environ["HOLD_CONFIG"]).write_text(
        f"devices:\n  npu:\n    nodes: [{json.dumps(str(tmp_path / 'accel*'))}]\n"
        f"report:\n  sample: {SAMPLE}s\n"
    )
    return node


def npu(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [NPU_HOLD, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )


def holder_of_npu() -> dict[str, Any] | None:
    out = subprocess.run([*HOLD, "status", "--json"], capture_output=True, text=True, check=True)
    h: dict[str, Any] | None = json.loads(out.stdout)["classes"]["npu"]["devices"][0]["holder"]
    return h


def report(*args: str) -> dict[str, Any]:
    out = subprocess.run([*HOLD, "report", "--json", *args], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def test_report_matches_a_scripted_sequence(tmp_path: Path) -> None:
    node = configure(tmp_path)
    go = tmp_path / "go"
    using = (
        f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
        f"f = open({str(node)!r}); time.sleep(2.0)"
    )
    # 1. alpha holds the node for 2 s once beta waits behind it; beta then sleeps 1 s.
    # (Started at once, alpha's 2 s could be half over before beta, started by a
    # loaded machine, asked: it waited 0.96 s once beside two busy loops.)
    t0 = time.time()
    alpha = npu("-t", "1m", "-l", "alpha", "--", sys.executable, "-c", using)
    wait_for(lambda: holder_of_npu() is not None, 10, what="alpha's grant")
    beta_asked = time.time()  # at the latest
    beta = npu("-t", "1m", "-l", "beta", "--", "sleep", "1")
    wait_in_line("npu", 1)
    go.write_text("")
    # Alpha held the lease (not yet the node) while beta started: on a loaded
    # host that took seconds once (alpha leased 11.1 s in all, not about 6).
    before_go = time.time() - t0
    assert alpha.wait(30) == 0 and beta.wait(30) == 0, (alpha.stderr, beta.stderr)
    # Beta's wait lies inside its life less the 1 s it ran once granted: a bound
    # no load can break (a fixed one could: the wait for alpha's go alone took
    # seconds of hold status start-ups on a loaded machine).
    beta_waited_at_most = time.time() - beta_asked - 1.0
    # 2. gamma expires after 2 s (exit 124, as timeout(1)).
    gamma = npu("-t", "2s", "-l", "gamma", "--", "sleep", "30")
    assert gamma.wait(30) == 124
    # 3. delta is released by hold release.
    delta = npu("-t", "1m", "-l", "delta", "--", "sleep", "30")
    wait_for(lambda: holder_of_npu() is not None, 10, what="delta's grant")
    lease = holder_of_npu()
    assert lease is not None
    time.sleep(1.0)
    rel = subprocess.run([*HOLD, "release", lease["lease"]], capture_output=True, text=True)
    assert rel.returncode == 0, rel.stderr
    delta.wait(30)
    # 4. a stray holds the node outside any lease: a ticket finds it busy.
    out = tmp_path / "stray.out"
    stray = subprocess.Popen([sys.executable, HOLDER, str(out), "fd", str(node)])
    try:
        wait_for(lambda: out.exists() and "holder" in out.read_text(), 10, what="the stray")
        busy = npu("--no-wait", "-t", "1m", "-l", "epsilon", "--", "true")
        assert busy.wait(30) == 75
    finally:
        stray.kill()
        stray.wait(10)
    elapsed = time.time() - t0

    doc = report()
    assert doc["version"] == 1
    (me,) = doc["users"]
    (dev,) = doc["devices"]
    assert me["user"] == "root" and dev["device"] == "npu:0"
    for a in (me, dev):  # one device: the user's figures are the device's
        assert a["leases"] == 4  # epsilon was never granted
        assert a["ends"] == {"ended": 2, "expired": 1, "released": 1}
        assert a["expiries"] == 1 and a["releases"] == 1 and a["strays"] == 1
        # alpha ~2 s (+ beta's start) + beta ~1 s + gamma 2 s (+ its stop) + delta ~1 s
        assert 6.0 - SLACK <= a["leased_s"] <= min(elapsed, 6.0 + 4 * SLACK + before_go)
        # Held: only alpha opened the node (seen by the scans, within a period).
        assert 2.0 - 3 * SAMPLE - SLACK / 2 <= a["held_s"] <= 2.0 + SLACK
        assert a["unmeasured_s"] == 0
        # Waits: beta waited for alpha (2 s and more); the others not at all.
        assert a["waits"] == 4
        assert 2.0 <= a["wait_max_s"] <= beta_waited_at_most, beta_waited_at_most
        assert a["wait_median_s"] < 0.5
    assert set(me["labels"]) == {"alpha", "beta", "gamma", "delta"}
    (s,) = doc["strays"]
    assert s["pid"] == stray.pid and s["device"] == "npu:0" and "node_holder" in s["command"]
    # Each lease is one history line, with how it ended and who released it.
    lines = [
        json.loads(x)
        for x in (Path(os.environ["HOLD_STATE_DIR"]) / "history.jsonl").read_text().splitlines()
    ]
    ends = {e["label"]: (e["end"], e["by"]) for e in lines if e["kind"] == "lease"}
    assert ends == {
        "alpha": ("ended", None),
        "beta": ("ended", None),
        "gamma": ("expired", None),
        "delta": ("released", "root"),
    }
    # --since: a date after all of it leaves nothing; the text form says the same.
    assert report("--since", "2999-01-01")["users"] == []
    text = subprocess.run([*HOLD, "report"], capture_output=True, text=True, check=True).stdout
    assert "USER" in text and "npu:0" in text and f"pid {stray.pid}" in text


# A real-time busy loop on one CPU from wall time argv[2] to argv[3]: what a
# loaded machine does to a process it does not run for a while. Exit 77 if
# this user may not take a real-time priority.
_STARVE = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
start, until = float(sys.argv[2]), float(sys.argv[3])
time.sleep(max(0.0, start - time.time()))
try:
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
except PermissionError:
    sys.exit(77)
while time.time() < until:
    pass
"""


def test_a_lease_ended_at_its_limit_while_the_daemon_ran_late_is_an_expiry(
    tmp_path: Path,
) -> None:
    """The client stops its command at the limit by its own clock and says it is
    done. A daemon the machine did not run meanwhile (here: a real-time busy
    loop on its CPU from just before the limit, the client on another) finds
    both the limit passed and that word waiting: the lease expired, and the
    history says so. It read the word first and wrote "ended" (the scripted
    sequence above, 1 run in 8 beside busy loops on a 16-core host). A SIGSTOP
    cannot show it: a stopped daemon's select returns nothing once resumed past
    its timeout, and its timers run first."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs: one for the daemon, one for the client")
    configure(tmp_path)
    first = subprocess.run([NPU_HOLD, "--", "true"], capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    pid = daemon_pid(Path(os.environ["HOLD_STATE_DIR"]))
    assert pid is not None
    os.sched_setaffinity(pid, {cpus[0]})  # its loop's thread; the client elsewhere
    gamma = subprocess.Popen(
        ["taskset", "-c", str(cpus[1]), NPU_HOLD, "-t", "3s", "-l", "gamma", "--", "sleep", "30"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    starve: subprocess.Popen[bytes] | None = None
    try:
        holder = wait_for(holder_of_npu, 10, what="gamma's grant")
        expires = float(holder["expires"])
        starve = subprocess.Popen(
            [sys.executable, "-c", _STARVE, str(cpus[0]), str(expires - 0.2), str(expires + 0.8)]
        )
        if starve.wait(30) == 77:
            pytest.skip("this user may not take a real-time priority")
        assert gamma.wait(30) == 124, gamma.stderr
    finally:
        for p in (gamma, starve):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
        gamma.communicate(timeout=10)
    doc = wait_for(lambda: (d := report())["users"] and d, 10, what="gamma in the history")
    (me,) = doc["users"]
    assert me["leases"] == 2 and me["ends"] == {"ended": 1, "expired": 1}, me


def test_bad_since_is_refused(tmp_path: Path) -> None:
    res = subprocess.run(
        [*HOLD, "report", "--since", "last tuesday"], capture_output=True, text=True
    )
    assert res.returncode == 2 and "--since" in res.stderr and "2025-05-01" in res.stderr


def test_history_is_bounded_and_rotated(tmp_path: Path) -> None:
    tmp_path = tmp_path / "h"
    tmp_path.mkdir()
    h = history.History(str(tmp_path), max_bytes=2000)
    for n in range(200):
        h.append(
            HistoryLease(
                str(n),
                "u",
                1,
                "npu",
                (0,),
                "l",
                False,
                None,
                999.0,
                1000.0 + n,
                LeaseEnd.ENDED,
                None,
                None,
            )
        )
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["history.jsonl", "history.jsonl.1"]  # one old file kept, no more
    assert all((tmp_path / f).stat().st_size <= 2000 for f in files)
    kept = [int(e["lease"]) for e in history.read(str(tmp_path))]
    assert kept == list(range(kept[0], 200)) and len(kept) < 200  # the newest, in order
    since = history.read(str(tmp_path), since=1195.0)
    assert [int(e["lease"]) for e in since] == [195, 196, 197, 198, 199]
    assert oct((tmp_path / "history.jsonl").stat().st_mode & 0o777) == "0o600"


def _lease(uid: int, user: str, label: str, private: bool = False) -> dict[str, Any]:
    return {
        "kind": "lease",
        "lease": label,
        "user": user,
        "uid": uid,
        "cls": "gpu",
        "devices": [0, 1],
        "label": label,
        "private": private,
        "requested": 90.0,
        "granted": 100.0,
        "ended": 160.0,
        "end": "ended",
        "by": None,
        "held": 30.0,
    }


@pytest.mark.parametrize("show", [False, True])
def test_labels_of_other_users(show: bool) -> None:
    entries = [
        _lease(1000, "ann", "train"),
        _lease(1000, "ann", "secret", private=True),
        _lease(1001, "bob", "eval"),
    ]
    doc = build(entries, 1001, show_labels=show, since=0.0, now=200.0)
    users = {u["user"]: u for u in doc["users"]}
    assert users["bob"]["labels"] == {"eval": 120.0}  # own: always (2 devices x 60 s)
    assert users["ann"]["labels"] == ({"train": 120.0} if show else None)  # never "secret"
    assert users["ann"]["leased_s"] == 240.0 and users["ann"]["held_s"] == 120.0
    assert users["ann"]["wait_max_s"] == 10.0
    root = build(entries, 0, show_labels=False, since=0.0, now=200.0)
    assert {u["user"]: u for u in root["users"]}["ann"]["labels"] == {
        "train": 120.0,
        "secret": 120.0,
    }
    # --since cuts a lease at the report's start; the wait is not its.
    half = build(entries, 0, show_labels=False, since=130.0, now=200.0)
    assert {u["user"]: u for u in half["users"]}["bob"]["leased_s"] == 60.0
    assert {u["user"]: u for u in half["users"]}["bob"]["waits"] == 0


@pytest.mark.parametrize("width", [80, 60])
def test_at_a_narrow_terminal_nothing_is_cut_mid_word(tmp_path: Path, width: int) -> None:
    """At 80 (and 60) columns: every line fits; the sentence is wrapped at words,
    the tables leave columns out whole (each header a whole name), labels last."""
    import re

    from hold.views.report import DEVICE_HEAD, USER_HEAD, text_lines
    from hold_supervisor.width import room

    configure(tmp_path)
    for label in ("a long label for the training run", "eval"):
        p = npu("-l", label, "--", "true")
        assert p.wait(30) == 0, p.stderr.read() if p.stderr else ""
    doc = report()
    lines = text_lines(doc, width)
    assert all(len(line) <= room(width) for line in lines), lines
    whole = text_lines(doc, None)
    heads = [ln for ln in lines if ln.startswith(("USER ", "DEVICE "))]
    assert len(heads) == 2, lines
    names = {*USER_HEAD, "DEVICE", *DEVICE_HEAD}
    for h in heads:
        cells = re.split(r"\s{2,}", h.strip())
        assert all(c in names for c in cells), (h, cells)
        assert {"LEASES", "LEASED", "HELD", "STRAYS"} <= set(cells), h
    # The labels (the last, free column) give way: cut with "...", not left out.
    assert any(ln.startswith("root ") and ln.endswith("...") and " a " in ln for ln in lines), lines
    # The sentence, wrapped: the same words in the same order.
    n = next(i for i, ln in enumerate(lines) if ln.startswith("USER "))
    assert " ".join(lines[:n]).split() == whole[0].split()
