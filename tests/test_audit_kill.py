"""``hold audit --kill`` says what it did to every stray, also one that another
stray's stop ended (issue 10: such a stray was reported "already gone").

The device is a class ``fake`` over a temporary regular file; the strays are
real processes that hold it open. Every wait is bounded, every process ended
(the leak check proves it).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import HOLD, alive, audit_clean, holds_node, wait_for

from hold_supervisor.proc import scan


def _fake_node(tmp_path: Path) -> Path:
    """A class ``fake`` of one node, added to the test's configuration."""
    d = tmp_path / "nodes"
    d.mkdir()
    node = d / "fakedev0"
    node.write_bytes(b"\0" * 4096)
    config = tmp_path / "config.yaml"
    doc = yaml.safe_load(config.read_text()) or {}
    doc["devices"] = {**(doc.get("devices") or {}), "fake": {"nodes": [f"{d}/fakedev*"]}}
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    return node


class Pair:
    """A stray (``parent``) and its child (``child``), both holding ``node``:
    a shell opens it, starts ``sleep`` in the background (which inherits the
    descriptor) and execs ``sleep`` itself. ``stubborn``: both ignore SIGTERM
    (an ignored signal stays ignored across exec)."""

    def __init__(self, node: Path, stubborn: bool = False) -> None:
        script = f"exec 3<{shlex.quote(str(node))}; sleep 120 & exec sleep 120"
        if stubborn:
            script = "trap '' TERM; " + script
        self.proc = subprocess.Popen(["sh", "-c", script], stdin=subprocess.DEVNULL)
        self.parent = self.proc.pid

        def child() -> int | None:
            for st in scan.snapshot().values():
                if st.ppid == self.parent and not st.is_dead and holds_node(st.pid, node):
                    return st.pid
            return None

        def parent() -> bool:
            st = scan.stat_of(self.parent)
            return st is not None and st.comm == "sleep" and holds_node(self.parent, node)

        self.child: int = wait_for(child, 10, 0.02, "the child stray")
        wait_for(parent, 10, 0.02, "the parent stray")

    def end(self) -> None:
        for pid in (self.child, self.parent):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def pairs() -> Iterator[list[Pair]]:
    made: list[Pair] = []
    try:
        yield made
    finally:
        for p in made:
            p.end()


@pytest.mark.parametrize(
    ("stubborn", "grace", "outcome", "done"),
    [(False, "5s", "exited", "ended on SIGTERM"), (True, "0.2s", "killed", "killed")],
    ids=["polite", "stubborn"],
)
def test_kill_reports_a_stray_ended_with_another_strays_tree(
    tmp_path: Path, pairs: list[Pair], stubborn: bool, grace: str, outcome: str, done: str
) -> None:
    """Two strays, one the other's child: the parent's stop ends both. The
    child's entry says what was done to it and with whose tree."""
    node = _fake_node(tmp_path)
    # The audit handles strays in pid order; the child must come second
    # (pids wrap: a child may draw a lower pid than its parent -- then again).
    for _ in range(3):
        pair = Pair(node, stubborn)
        pairs.append(pair)
        if pair.child > pair.parent:
            break
        pair.end()
    else:
        pytest.skip("the child kept getting a lower pid than its parent")

    res = subprocess.run(
        [*HOLD, "audit", "--json", "--device", "fake", "--kill", "--yes", "--grace", grace],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == audit_clean(res.stdout), (res.stdout, res.stderr)  # all stopped
    doc = json.loads(res.stdout)
    assert sorted(r["pid"] for r in doc["holders"] if not r["covered"]) == [
        pair.parent,
        pair.child,
    ], doc["holders"]
    first, second = doc["killed"]
    assert first["pid"] == pair.parent and first["stopped"] is True, first
    assert sorted(first["members"]) == [pair.parent, pair.child], first
    assert first["outcome"] == outcome and first["survivors"] == [], first
    # The child: ended by the parent's stop, and said so -- not "already gone".
    assert second["pid"] == pair.child and second["stopped"] is True, second
    assert second["with"] == pair.parent and second["outcome"] == done, second
    assert second["why"] == f"{done} with the tree of stray pid {pair.parent}", second
    assert not alive(pair.parent) and not alive(pair.child)

    # The table says it too.
    pair2 = Pair(node, stubborn)
    pairs.append(pair2)
    if pair2.child < pair2.parent:
        return
    res = subprocess.run(
        [*HOLD, "audit", "--device", "fake", "--kill", "--yes", "--grace", grace],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == audit_clean(res.stdout), (res.stdout, res.stderr)  # all stopped
    assert f"pid {pair2.parent}: stopped {outcome}" in res.stdout, res.stdout
    assert f"pid {pair2.child}: stopped {done} with the tree of stray pid {pair2.parent}" in (
        res.stdout
    ), res.stdout
    assert "already gone" not in res.stdout


def test_a_daemon_that_does_not_answer_makes_the_audit_stop_nothing(tmp_path: Path) -> None:
    """Its leases' holders would all look stray: the audit says it cannot tell, and
    ``--kill`` stops nobody (exit 125), within a few seconds."""
    from conftest import daemon_pid

    node = _fake_node(tmp_path)
    lease = subprocess.Popen(
        [*HOLD, "run", "--device", "fake:0", "--", "sh", "-c", f'exec sleep 120 3<"{node}"'],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        holder = wait_for(
            lambda: next((p for p in scan.pids() if holds_node(p, node)), None),
            20,
            what="the lease's command to hold the node",
        )
        covered = subprocess.run(
            [*HOLD, "audit", "--json", "--device", "fake"], capture_output=True, text=True
        )
        assert covered.returncode == audit_clean(covered.stdout), (covered.stdout, covered.stderr)
        daemon = daemon_pid(tmp_path / "state")
        assert daemon is not None
        os.kill(daemon, signal.SIGSTOP)
        try:
            res = subprocess.run(
                [*HOLD, "audit", "--device", "fake", "--kill", "--yes"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=30,
            )
        finally:
            os.kill(daemon, signal.SIGCONT)
        assert res.returncode == 125, (res.stdout, res.stderr)
        assert "cannot tell which holders a lease covers" in res.stderr, res.stderr
        assert "did not" in res.stderr and "Traceback" not in res.stderr, res.stderr
        assert alive(holder)
    finally:
        lease.terminate()
        lease.wait(timeout=30)
