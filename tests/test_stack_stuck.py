"""A stuck stack supervisor never blocks its callers, and its stack can still be
stopped (issue 23, docs/DESIGN.md "Deadlines").

Each test starts a real stack (``hold up --detach``), stops its supervisor with
SIGSTOP (as one stalled on a disk or a lock looks) and runs the stack commands
with a bounded subprocess timeout: each returns within its deadline, names the
supervisor that did not answer, with an exit status from the table and never a
traceback; ``hold down`` stops every unit through the ticket daemon (the
supervisor killed, the lifeline). Bounds are deadlines, not speed: generous for
a loaded 2-core machine. The waits are shortened for these tests with
``HOLD_ANSWER_WAIT=2s`` (:mod:`hold.client.waits`: 3 s and 5 s answers, a 20 s wait
for the daemon's stop and a 15 s margin for a call's result become 2 s, 2 s,
8 s and 6 s), so that the whole file stays well inside the suite's time. The
supervisor is always continued (or killed) in a ``finally``; the autouse leak
check adds that nothing is left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import HOLD, LOADED, PROGS, alive, wait_for

from hold_supervisor.parse import allowed_cpus
from hold_supervisor.proc import scan
from hold_supervisor.stack.controlsock import NoAnswer, request

PY = sys.executable
UNIT = str(PROGS / "stack_unit.py")
TASK = str(PROGS / "task_prog.py")
LANE = max(allowed_cpus())
WAIT = 2  # HOLD_ANSWER_WAIT, seconds


@pytest.fixture(autouse=True)
def short_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOLD_ANSWER_WAIT", f"{WAIT}s")


def flow(*args: str) -> str:
    return "[" + ", ".join(f'"{a}"' for a in args) + "]"


def write_stack(base: Path, *, task: str = "") -> Path:
    """Three services (one ignores SIGTERM and leaves a setsid escapee), and a
    task unit when ``task`` names its keys."""
    body = f"""
  model:
    cmd: {flow(PY, UNIT, str(base), "model", "--http", "{port}")}
    port: auto
    ready: {{http: /health}}
    stop: {{grace: 2s}}
  worker:
    cmd: {flow(PY, UNIT, str(base), "worker", "--escapee", "--ignore-term", "--say", "READY")}
    after: [model]
    ready: {{log: READY}}
    stop: {{grace: 1s}}
  executor:
    cmd: {flow(PY, UNIT, str(base), "executor", "--tcp", "{port}")}
    port: auto
    after: [worker]
    ready: {{tcp: "{{port}}"}}
"""
    if task:
        (base / "task").mkdir()
        body += f"""
  ex:
    kind: task
    cmd: {flow(PY, TASK, str(base / "task"), "sleep")}
    cpus: "{LANE}"
    stop: {{grace: 300ms}}
    args:
      s: {{type: float, min: 0, max: 60}}
{task}"""
    path = base / "stack.yaml"
    path.write_text(f"name: t\nunits:{body}")
    return path


def hold(*args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess[str], float]:
    """The command's result and its wall time."""
    t0 = time.monotonic()
    res = subprocess.run(
        [*HOLD, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
    )
    return res, time.monotonic() - t0


def unit_pids(base: Path) -> dict[str, int]:
    out = {}
    for line in (base / "pids").read_text().splitlines():
        name, pid = line.split()
        out[name] = int(pid)
    return out


def call_pids(base: Path) -> list[int]:
    path = base / "task" / "started"
    return [int(ln.split()[1]) for ln in path.read_text().splitlines()] if path.exists() else []


def supervisor(name: str = "t") -> int:
    lock = Path(os.environ["HOLD_STATE_DIR"]) / "stacks" / name / "stack.lock"
    return int(lock.read_text().strip())


@contextlib.contextmanager
def stuck_stack(path: Path) -> Iterator[int]:
    """The stack up in the background, then its supervisor stopped (SIGSTOP): its pid.
    Afterwards it is continued and stopped cleanly, or killed (the daemon then
    stops its units), whatever the test did."""
    res, _ = hold("up", "--detach", str(path))
    assert res.returncode == 0, res.stderr
    pid = supervisor()
    parent = scan.stat_of(pid)
    # Walk mode: the keeper above the supervisor (hold_supervisor.spawn.keeper) ends last.
    keeper = parent.ppid if parent is not None and parent.comm == "hold-keeper" else None
    unit_pids(path.parent)  # every service recorded its pid
    wait_for(lambda: "worker-escapee" in unit_pids(path.parent), 10, what="the escapee")
    os.kill(pid, signal.SIGSTOP)
    try:
        yield pid
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGCONT)
            try:
                hold("down", "t", timeout=60)
            finally:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
        every = list(unit_pids(path.parent).values()) + call_pids(path.parent)
        wait_for(lambda: not any(alive(p) for p in every), 30, what="every unit to end")
        if keeper is not None:
            wait_for(lambda: not alive(keeper), 15, what="the keeper to end")


def assert_no_traceback(res: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in res.stderr + res.stdout, res.stderr


# --------------------------------------------------------------------------
# ps, restart, down.


def test_stuck_supervisor_ps_restart_and_down(tmp_path: Path, cgroup_mode: str) -> None:
    path = write_stack(tmp_path)
    with stuck_stack(path) as pid:
        units = unit_pids(tmp_path)
        said = f"the supervisor of stack t (pid {pid}) did not answer in"

        # hold ps: the stack is named as not answering, never "no stack is running".
        res, wall = hold("ps", timeout=30)
        assert res.returncode == 124, res.stderr
        assert wall < WAIT + LOADED, wall
        assert_no_traceback(res)
        assert "no stack is running" not in res.stdout
        row = res.stdout.splitlines()[1].split()
        assert row[:2] == ["t", str(pid)] and "not answering" in res.stdout, res.stdout
        assert f"{said} {WAIT} s (its process is stopped" in res.stderr, res.stderr
        assert "hold down t stops its units through the ticket daemon" in res.stderr

        res, wall = hold("ps", "--json", timeout=30)
        assert res.returncode == 124 and wall < WAIT + LOADED, (wall, res.stderr)
        doc = json.loads(res.stdout)
        assert doc["stacks"] == []
        assert doc["not_answering"] == [{"stack": "t", "pid": pid, "waited_s": float(WAIT)}]

        res, wall = hold("ps", "t", timeout=30)
        assert res.returncode == 124 and wall < WAIT + LOADED, (wall, res.stderr)
        assert_no_traceback(res)
        assert f"{said} {WAIT} s" in res.stderr, res.stderr

        # hold restart: refused within its deadline, nothing restarted.
        res, wall = hold("restart", "t", "model", timeout=30)
        assert res.returncode == 124 and wall < 3 * WAIT + LOADED, (wall, res.stderr)
        assert_no_traceback(res)
        assert f"{said} {WAIT} s" in res.stderr and "model was not restarted" in res.stderr
        assert alive(units["model"])

        # hold down: every unit stopped through the ticket daemon.
        res, wall = hold("down", "t", timeout=60)
        assert res.returncode == 0, res.stderr
        assert wall < 30, (wall, res.stderr)
        assert_no_traceback(res)
        assert f"{said} {WAIT} s" in res.stderr, res.stderr
        assert "its units were stopped through the ticket daemon" in res.stderr, res.stderr
        assert "stack t stopped" in res.stderr
        # When it returns, everything is gone: the units, the escapee, the supervisor.
        left = {n: p for n, p in units.items() if alive(p)}
        assert not left, (left, res.stderr)
        assert not alive(pid)

    res, _ = hold("ps")
    assert res.returncode == 0 and res.stdout.strip() == "no stack is running", res
    res, _ = hold("down", "t")
    assert res.returncode == 0 and "not running" in res.stderr


def test_supervisor_and_daemon_both_stuck_down_stops_the_units_itself(tmp_path: Path) -> None:
    """No guardian answers either (the daemon stopped too): what the daemon has not
    stopped after hold down's wait for it, hold down stops itself, and says so."""
    from conftest import daemon_pid

    path = write_stack(tmp_path)
    daemon: int | None = None
    with stuck_stack(path) as pid:
        daemon = daemon_pid(Path(os.environ["HOLD_STATE_DIR"]))
        assert daemon is not None
        os.kill(daemon, signal.SIGSTOP)
        try:
            units = unit_pids(tmp_path)
            res, wall = hold("down", "t", timeout=90)
            assert res.returncode == 0, res.stderr
            assert wall < 40, (wall, res.stderr)  # WAIT + 4 x WAIT for the daemon + a stop
            assert_no_traceback(res)
            assert f"the rest (not empty after {4 * WAIT} s) by hold down" in res.stderr, res.stderr
            assert "stack t stopped" in res.stderr
            left = {n: p for n, p in units.items() if alive(p)}
            assert not left, (left, res.stderr)
            assert not alive(pid)
        finally:
            os.kill(daemon, signal.SIGCONT)


def test_a_stuck_stack_still_starting_is_killed(tmp_path: Path) -> None:
    """hold down of a stack waiting for its ticket (no control socket yet) whose
    process is stopped: SIGTERM cannot reach it, so after WAIT s it is killed."""
    npu_hold = str(Path(sys.executable).parent / "npu-hold")
    (tmp_path / "accel0").write_text("")
    Path(os.environ["HOLD_CONFIG"]).write_text(
        f'devices:\n  npu:\n    nodes: ["{tmp_path}/accel*"]\n'
    )
    work = tmp_path / "work"
    work.mkdir()
    stack = tmp_path / "stack.yaml"
    stack.write_text("name: t\nhold: {device: npu}\nunits:\n  one:\n    cmd: [sleep, '60']\n")
    holder = subprocess.Popen(
        [npu_hold, "--", PY, str(PROGS / "gated.py"), str(work), "A", "--wait"],
        stderr=subprocess.DEVNULL,
    )
    up: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: (work / "A.ready").exists(), 20, what="the holder")
        with open(tmp_path / "up.err", "w") as err:
            up = subprocess.Popen([*HOLD, "up", str(stack)], stdin=subprocess.DEVNULL, stderr=err)
        wait_for(lambda: "waiting for npu" in (tmp_path / "up.err").read_text(), 20, what="up")
        up.send_signal(signal.SIGSTOP)
        res, wall = hold("down", "t", timeout=60)
        assert res.returncode == 0, res.stderr
        assert wall < 20, (wall, res.stderr)
        assert_no_traceback(res)
        assert f"stack t is starting (pid {up.pid})" in res.stderr
        assert f"(pid {up.pid}) did not stop in {WAIT} s (its process is stopped" in res.stderr
        assert "no unit of it was running" in res.stderr and "stack t stopped" in res.stderr
        assert up.wait(5) == -signal.SIGKILL
        assert holder.poll() is None  # the holder's lease is untouched
    finally:
        (work / "A.go").write_text("")
        assert holder.wait(30) == 0
        if up is not None and up.poll() is None:
            up.send_signal(signal.SIGCONT)
            up.kill()
            up.wait()


def test_a_stuck_stack_does_not_hide_the_others(tmp_path: Path) -> None:
    """hold ps asks every stack at once: the stuck one costs one wait, the others show."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    good = tmp_path / "b" / "stack.yaml"
    good.write_text(f"name: good\nunits:\n  one:\n    cmd: {flow('sleep', '60')}\n")
    res, _ = hold("up", "--detach", str(good))
    assert res.returncode == 0, res.stderr
    try:
        with stuck_stack(write_stack(tmp_path / "a")) as pid:
            res, wall = hold("ps", timeout=30)
            assert res.returncode == 124 and wall < WAIT + LOADED, (wall, res.stderr)
            rows = [ln.split()[:2] for ln in res.stdout.splitlines()[1:]]
            assert rows == [["good", str(supervisor("good"))], ["t", str(pid)]], res.stdout
            res, _ = hold("down", "t")
            assert res.returncode == 0, res.stderr
    finally:
        res, _ = hold("down", "good")
        assert res.returncode == 0, res.stderr


# --------------------------------------------------------------------------
# hold call.


def test_stuck_supervisor_call_has_a_deadline(tmp_path: Path) -> None:
    path = write_stack(tmp_path, task="    timeout: 2s\n    concurrency: 1\n")
    with stuck_stack(path) as pid:
        for extra in ([], ["--no-wait"]):
            res, wall = hold("call", "t", "ex", "--arg", "s=0", *extra, timeout=30)
            assert res.returncode == 124, (extra, res.stderr)
            assert wall < 2 * WAIT + LOADED, (extra, wall)
            assert_no_traceback(res)
            assert f"(pid {pid}) did not take the call in {WAIT} s" in res.stderr, res.stderr
        res, wall = hold("down", "t")
        assert res.returncode == 0 and wall < 30, (wall, res.stderr)
    assert call_pids(tmp_path) == []  # no call ever started


def test_a_running_call_waits_no_longer_than_its_timeout(tmp_path: Path) -> None:
    """Its supervisor stopped while the call runs: the result's deadline is the
    task's timeout, its grace and a margin (2 + 0.3 + 3 x WAIT s here)."""
    path = write_stack(tmp_path, task="    timeout: 2s\n")
    with stuck_stack(path) as pid:
        os.kill(pid, signal.SIGCONT)
        client = subprocess.Popen(
            [*HOLD, "call", "t", "ex", "--arg", "s=50"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_for(lambda: call_pids(tmp_path), 10, what="the call to start")
            time.sleep(1)  # its client has heard "running" (told within 0.1 s)
            os.kill(pid, signal.SIGSTOP)
            t0 = time.monotonic()
            _out, err = client.communicate(timeout=60)
            wall = time.monotonic() - t0
        finally:
            if client.poll() is None:
                client.kill()
                client.wait()
        assert client.returncode == 124, err
        # Counted from the call's start, ~1 s and more before the stop (as 14 < 17.3 was).
        assert 2.3 + 3 * WAIT - 3.3 < wall < 30, (wall, err)
        assert_no_traceback(subprocess.CompletedProcess([], 124, "", err))
        assert f"(pid {pid}) gave no result for call " in err
        assert f"in {2.3 + 3 * WAIT:g} s (its timeout 2 s, grace 0.3 s)" in err, err
        res, _ = hold("down", "t")
        assert res.returncode == 0, res.stderr
        assert not any(alive(p) for p in call_pids(tmp_path))


def test_a_queued_call_is_not_taken_for_a_stuck_one(tmp_path: Path) -> None:
    """While a call waits for its slot the stack says so (queued) every 2 s: a wait
    in line longer than the silence a client accepts (8 s) is not a stuck stack."""
    path = write_stack(tmp_path, task="    timeout: 20s\n    concurrency: 1\n")
    with stuck_stack(path) as pid:
        os.kill(pid, signal.SIGCONT)
        first = subprocess.Popen(
            [*HOLD, "call", "t", "ex", "--arg", "s=10"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_for(lambda: call_pids(tmp_path), 10, what="the first call to start")
            res, wall = hold("call", "t", "ex", "--arg", "s=0", timeout=60)
            assert res.returncode == 0, res.stderr
            assert wall > 8, wall  # it waited in line longer than a silence is allowed
        finally:
            assert first.wait(30) == 0
        res, _ = hold("down", "t")
        assert res.returncode == 0 and "did not answer" not in res.stderr, res.stderr


# --------------------------------------------------------------------------
# The control socket's own deadlines.


def test_request_connect_and_answer_are_bounded(tmp_path: Path) -> None:
    """A socket that is listened on but never served (a stopped process's): the
    answer's deadline; once its backlog is full, the connect's."""
    path = str(tmp_path / "control.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(0)
    held: list[socket.socket] = []
    try:
        t0 = time.monotonic()
        with pytest.raises(NoAnswer, match=r"did not answer 'ps' in 0.5 s"):
            request(path, {"op": "ps"}, timeout=0.5)
        assert time.monotonic() - t0 < LOADED
        # Fill the backlog, then a connect of request's own would block.
        for _ in range(8):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            try:
                c.connect(path)
            except BlockingIOError:
                c.close()
                break
            held.append(c)
        done = threading.Event()

        def ask() -> None:
            with pytest.raises(NoAnswer):
                request(path, {"op": "down"}, timeout=0.5)
            done.set()

        t = threading.Thread(target=ask, daemon=True)
        t.start()
        assert done.wait(5)
        t.join()
    finally:
        for c in held:
            c.close()
        server.close()


def test_request_waits_as_long_as_the_stack_said(tmp_path: Path) -> None:
    """After ``stopping`` (with ``within``), the wait is what on_message makes of it;
    past it, NoAnswer says what was heard last (hold down: "did not finish its stop")."""
    path = str(tmp_path / "control.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    conns: list[socket.socket] = []

    def serve() -> None:
        conn, _ = server.accept()
        conns.append(conn)
        conn.recv(4096)
        conn.sendall(b'{"ev": "stopping", "within": 0.3}\n')  # then nothing more

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(NoAnswer) as e:
            request(path, {"op": "down"}, timeout=40, on_message=lambda m: m["within"] + 0.2)
        assert time.monotonic() - t0 < LOADED  # the word's 0.5 s, not the request's 40
        assert e.value.heard == {"ev": "stopping", "within": 0.3}
        assert e.value.waited == pytest.approx(0.5)
    finally:
        t.join(5)
        for c in conns:
            c.close()
        server.close()
