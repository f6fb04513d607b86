"""Output that fits an 80-column terminal (issue 14): ``hold status`` and
``hold audit`` at a terminal (a pty as stdout, ``COLUMNS=80``) stay within the
width; piped, nothing is cut. And ``hold audit`` shows one row per process and
device, as ``nvidia-smi`` does: a process's shared nodes go with its device
row; alone, they make a row that says "shared nodes only".

Real processes holding real files (a class ``fake`` with a shared node, as
``gpu`` has ``/dev/nvidiactl``), real clients and the test's own daemon.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import HOLD, PROGS, ROOT, update_config, wait_for

from hold_supervisor.width import cut, fit, table

PY = sys.executable
HOLDER = str(PROGS / "node_holder.py")
GATED = str(PROGS / "gated.py")
NPU_HOLD = str(Path(sys.executable).parent / "npu-hold")
LONG = "an-argument-long-enough-to-make-the-command-column-wider-than-any-terminal-" * 2
LABEL = "a-label-long-enough-that-the-status-row-cannot-hold-it-at-eighty-columns"


def at_terminal(argv: list[str], cols: int = 80, timeout: float = 30) -> tuple[int, str]:
    """Run ``argv`` with a pty ``cols`` wide as stdout and stderr (``COLUMNS`` set too)."""
    env = {**os.environ, "COLUMNS": str(cols)}
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, cols, 0, 0))
    buf = bytearray()
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env)
        os.close(slave)
        slave = -1
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"{argv} did not finish: {bytes(buf)!r}"
            if not select.select([master], [], [], left)[0]:
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the program has closed the terminal
                break
            if not chunk:
                break
            buf += chunk
        code = proc.wait(timeout)
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    return code, buf.decode().replace("\r\n", "\n")


def piped(argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    return subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, env=env
    )


def assert_fits(text: str, cols: int) -> None:
    wide = [ln for ln in text.splitlines() if len(ln) > cols - 1]
    assert not wide, "\n".join(wide)


# --------------------------------------------------------------------------
# The rule itself.


def test_the_width_rule() -> None:
    assert fit("x" * 100, None) == "x" * 100  # piped: never cut
    assert fit("x" * 100, 80) == "x" * 79  # one column short: the terminal never wraps
    assert cut("abcdefgh", 6) == "abc..." and cut("abc", 6) == "abc"
    rows = [["npu:0", "x" * 50, "y" * 50]]
    lines = table(["DEV", "A", "B"], rows, 40, flex=(1, 2))
    assert all(len(ln) <= 39 for ln in lines), lines
    assert lines[1].startswith("npu:0  ") and "..." in lines[1]
    assert table(["DEV", "A", "B"], rows, None, flex=(1, 2))[1].endswith("y" * 50)
    # Columns that give way whole, in order, only while the rest cannot fit.
    head = ["DEV", "CPU", "SINCE", "UNTIL", "LABEL"]
    rows = [["npu:0", "12%", "12:00:00", "13:00:00", "a label"]]
    wide = table(head, rows, 80, flex=(4,), drop=(2, 3))
    assert wide[0].split() == head and wide[1].endswith("a label")
    narrow = table(head, rows, 30, flex=(4,), drop=(2, 3))
    assert narrow[0].split() == ["DEV", "CPU", "UNTIL", "LABEL"], narrow
    assert narrow[1].split()[:3] == ["npu:0", "12%", "13:00:00"] and len(narrow[1]) <= 29
    assert table(head, rows, 20, flex=(4,), drop=(2, 3))[0].split() == ["DEV", "CPU", "LABEL"]
    assert table(head, rows, None, flex=(4,), drop=(2, 3))[0].split() == head  # piped: all


# --------------------------------------------------------------------------
# hold status


@pytest.fixture
def queue(tmp_path: Path) -> Iterator[tuple[int, str]]:
    """npu:0 held (a long label), and one waiter in line; (holder pid, lease)."""
    procs = []
    err = open(tmp_path / "clients.stderr", "w")  # noqa: SIM115
    try:
        holder = subprocess.Popen(
            [NPU_HOLD, "-t", "2h", "-l", LABEL, "--", PY, GATED, str(tmp_path), "H", "--wait"],
            stdin=subprocess.DEVNULL,
            stdout=err,
            stderr=err,
        )
        procs.append(holder)
        wait_for(lambda: (tmp_path / "H.ready").exists(), 20, what="the holder")
        waiter = subprocess.Popen(
            [NPU_HOLD, "-l", "waiter", "--", "true"],
            stdin=subprocess.DEVNULL,
            stdout=err,
            stderr=err,
        )
        procs.append(waiter)

        def queued() -> str | None:
            st = json.loads(piped([*HOLD, "status", "--json"]).stdout)
            npu = st["classes"]["npu"]
            h = npu["devices"][0]["holder"]
            return h["lease"] if h and npu["queue"] else None

        lease = wait_for(queued, 20, 0.1, "the waiter in line")
        yield holder.pid, lease
    finally:
        (tmp_path / "H.go").write_text("")
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        err.close()


def test_status_fits_80_columns_at_a_terminal(queue: tuple[int, str]) -> None:
    pid, lease = queue
    code, text = at_terminal([*HOLD, "status"])
    assert code == 0, text
    assert_fits(text, 80)
    lines = text.splitlines()
    assert lines[0].startswith("arbiter: ")
    assert lines[1].startswith("limits per user (not root): ")
    # The resource figures stay; the clock times gave way whole (hold status --json has them).
    head = ["DEVICE", "STATE", "LEASE", "USER", "PID", "CPU%", "CPU", "MEM", "PROCS", "LEFT"]
    assert lines[2].split() == [*head, "LABEL"]
    row = next(ln for ln in lines if ln.startswith("npu:0"))
    cells = row.split()
    assert cells[:5] == ["npu:0", "active", lease, "root", str(pid)]
    assert cells[5].endswith("%") and cells[8] == "1", row  # the gated holder: one process
    assert re.fullmatch(r"[12]h\d\dm", cells[9]), row  # the time left of a 2h lease
    assert "'a" in row and LABEL not in row  # the label gave way
    # Wider, every column.
    code, text = at_terminal([*HOLD, "status"], cols=160)
    assert code == 0 and text.splitlines()[2].split() == [*head, "UNTIL", "SINCE", "LABEL"]
    assert any(ln.strip().startswith("queue 1: 'waiter'") for ln in lines), text
    assert any(ln.startswith("gpu:0") and "free" in ln for ln in lines), text


def test_status_piped_is_never_cut(queue: tuple[int, str]) -> None:
    pid, lease = queue
    res = piped([*HOLD, "status"])
    assert res.returncode == 0, res.stderr
    row = next(ln for ln in res.stdout.splitlines() if ln.startswith("npu:0"))
    assert f"lease {lease}" in row and f"{LABEL!r}" in row and f"pid {pid}" in row
    assert "until " in row and len(row) > 120


# --------------------------------------------------------------------------
# hold audit


@pytest.fixture
def fake_with_shared(tmp_path: Path) -> Iterator[tuple[Path, Path, Path]]:
    """A class ``fake``: two device files and a shared one; (dev0, dev1, shared)."""
    d = tmp_path / "nodes"
    d.mkdir()
    nodes = [d / "fakedev0", d / "fakedev1", d / "fakectl"]
    for n in nodes:
        n.write_bytes(b"\0" * 4096)
    update_config(
        tmp_path, devices={"fake": {"nodes": [f"{d}/fakedev*"], "shared_nodes": [f"{d}/fakectl"]}}
    )
    yield nodes[0], nodes[1], nodes[2]


def start_holder(out: Path, node: Path, shared: Path | None) -> tuple[subprocess.Popen[bytes], int]:
    """node_holder.py holding ``node`` (and ``shared`` as fd 7, kept across exec)."""
    argv = [PY, HOLDER, str(out), "fd", str(node), LONG]
    if shared is not None:
        argv = ["sh", "-c", 'exec 7<"$0"; exec "$@"', str(shared), *argv]
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL)

    def ready() -> int | None:
        assert p.poll() is None, f"{argv} ended with {p.returncode}"
        roles = dict(ln.split() for ln in out.read_text().splitlines()) if out.exists() else {}
        return int(roles["holder"]) if "holder" in roles else None

    return p, wait_for(ready, 20, 0.02, "the holder")


@pytest.fixture
def holders(tmp_path: Path, fake_with_shared: tuple[Path, Path, Path]) -> Iterator[tuple[int, int]]:
    """pid A holds fakedev0 and the shared node; pid B the shared node only."""
    dev0, _dev1, shared = fake_with_shared
    started = []
    try:
        a, a_pid = start_holder(tmp_path / "a.out", dev0, shared)
        started.append(a)
        b, b_pid = start_holder(tmp_path / "b.out", shared, None)
        started.append(b)
        yield a_pid, b_pid
    finally:
        for p in started:
            p.kill()
            p.wait()


def test_audit_one_row_per_process_and_device(
    holders: tuple[int, int], fake_with_shared: tuple[Path, Path, Path]
) -> None:
    a_pid, b_pid = holders
    dev0, _dev1, shared = fake_with_shared
    res = piped([*HOLD, "audit", "--device", "fake", "--json"])
    assert res.returncode == 1, res.stderr  # both stray
    doc = json.loads(res.stdout)
    a_rows = [r for r in doc["holders"] if r["pid"] == a_pid]
    assert len(a_rows) == 1, a_rows  # one row: fake:0, with its shared node
    assert a_rows[0]["device"] == "fake:0" and a_rows[0]["node"] == str(dev0)
    assert a_rows[0]["shared_nodes"] == [str(shared)]
    b_rows = [r for r in doc["holders"] if r["pid"] == b_pid]
    assert len(b_rows) == 1, b_rows
    assert b_rows[0]["device"] == "fake" and b_rows[0]["index"] is None
    assert b_rows[0]["node"] == str(shared) and b_rows[0]["shared_nodes"] == [str(shared)]
    # The table: the same rows, the shared-only one said so; piped, the command whole.
    res = piped([*HOLD, "audit", "--device", "fake"])
    lines = res.stdout.splitlines()
    a_line = next(ln for ln in lines if f" {a_pid} " in ln)
    b_line = next(ln for ln in lines if f" {b_pid} " in ln)
    assert a_line.startswith("fake:0 ") and LONG in a_line
    assert b_line.startswith("fake: shared nodes only ") and LONG in b_line
    assert sum(1 for ln in lines if f" {a_pid} " in ln) == 1


def test_audit_fits_80_columns_at_a_terminal(holders: tuple[int, int]) -> None:
    a_pid, b_pid = holders
    code, text = at_terminal([*HOLD, "audit", "--device", "fake"])
    assert code == 1, text
    assert_fits(text, 80)
    lines = text.splitlines()
    assert lines[0].split() == ["DEVICE", "PID", "USER", "AGE", "RSS", "DEVMEM", "LEASE", "COMMAND"]
    a_line = next(ln for ln in lines if f" {a_pid} " in ln)
    assert a_line.startswith("fake:0 ") and "STRAY" in a_line and LONG not in a_line
    assert any(ln.startswith("fake: shared nodes only") and f" {b_pid} " in ln for ln in lines)
    assert lines[-1].startswith("2 holder(s), 2 stray")


def test_ps_of_a_stack_fits_80_columns_at_a_terminal() -> None:
    """``hold ps NAME`` was 94-106 wide at 80 columns (issue 25); piped, whole."""
    up = subprocess.run(
        [*HOLD, "up", "--detach", str(ROOT / "units" / "serving-stack.yaml")],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        assert up.returncode == 0, up.stderr
        code, text = at_terminal([*HOLD, "ps", "serving"])
        assert code == 0, text
        assert "UNIT" in text and "model" in text, text
        assert_fits(text, 80)
        whole = piped([*HOLD, "ps", "serving"])
        assert "http /health" in whole.stdout and "when it exits 0" in whole.stdout
        code, text = at_terminal([*HOLD, "ps"])
        assert code == 0 and "serving" in text, text
        assert_fits(text, 80)
    finally:
        subprocess.run(
            [*HOLD, "down", "serving"], stdin=subprocess.DEVNULL, capture_output=True, timeout=120
        )
