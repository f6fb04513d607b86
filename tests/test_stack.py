"""Stacks through the real CLI (``hold up / ps / logs / restart / down``), with real processes.

Each unit is ``progs/stack_unit.py``, which records its starts and stops in
DIR/events and every pid it (and its escapee) has in DIR/pids, so a test can
check the order of things and that every one of them is gone at the end (the
autouse leak check adds that nothing is left under pytest).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CPU, HOLD, LOADED, PROGS, ROOT, alive, procscan_cmd, wait_for

from hold_supervisor.proc import scan

PY = sys.executable
UNIT = str(PROGS / "stack_unit.py")


# --------------------------------------------------------------------------
# Helpers.


def unit(base: Path, name: str, *opts: str) -> str:
    """The flow-style YAML list for a stack_unit.py command."""
    args = [PY, UNIT, str(base), name, *opts]
    return "[" + ", ".join(f'"{a}"' for a in args) + "]"


def write_stack(base: Path, body: str, name: str = "t") -> Path:
    path = base / "stack.yaml"
    path.write_text(f"name: {name}\nunits:\n{body}")
    return path


def hold(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*HOLD, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
    )


class Up:
    """``hold up FILE`` in the background of the test, its stderr in a file."""

    def __init__(self, base: Path, path: Path, *args: str) -> None:
        self.err_path = base / "up.stderr"
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [*HOLD, "up", *args, str(path)], stdin=subprocess.DEVNULL, stdout=err, stderr=err
            )

    @property
    def err(self) -> str:
        return self.err_path.read_text()

    def wait_up(self, timeout: float = 20) -> None:
        wait_for(
            lambda: " is up " in self.err or self.proc.poll() is not None,
            timeout,
            what="the stack to come up",
        )
        assert " is up " in self.err, self.err

    def wait(self, timeout: float = 30) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"hold up did not end in {timeout}s: {self.err}") from None


def events(base: Path) -> list[tuple[str, str, int, float]]:
    path = base / "events"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        what, name, pid, t = line.split()
        out.append((what, name, int(pid), float(t)))
    return out


def pids(base: Path) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    path = base / "pids"
    if path.exists():
        for line in path.read_text().splitlines():
            name, pid = line.split()
            out.setdefault(name, []).append(int(pid))
    return out


def holders(path: Path) -> list[int]:
    return list(scan.holders_of([scan.node_of_stat(os.stat(path), str(path))], scan.pids()))


def assert_all_gone(base: Path, timeout: float = 10) -> None:
    every = [p for ps in pids(base).values() for p in ps]
    assert every, "no unit recorded its pid"
    wait_for(lambda: not any(alive(p) for p in every), timeout, what=f"pids {every} to end")
    if (base / "device").exists():
        assert holders(base / "device") == []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# --------------------------------------------------------------------------
# Starting.


def test_dependency_order_and_parallel_start(tmp_path: Path) -> None:
    path = write_stack(
        tmp_path,
        f"""
  a:
    cmd: {unit(tmp_path, "a", "--delay", "1.5", "--http", "{port}")}
    port: auto
    ready: {{http: /health, timeout: 10s}}
  b:
    cmd: {unit(tmp_path, "b", "--delay", "1.5", "--tcp", "{port}")}
    port: auto
    ready: {{tcp: "{{port}}", timeout: 10s}}
  c:
    cmd: {unit(tmp_path, "c", "--say", "READY {units.a.port}")}
    after: [a, b]
    ready: {{log: "^READY [0-9]+$", timeout: 10s}}
""",
    )
    res = hold("up", "--for", "200ms", str(path))
    assert res.returncode == 0, res.stderr
    ev = events(tmp_path)
    starts = {n: t for what, n, _, t in ev if what == "start"}
    # a and b start together: each before the other could be ready (1.5 s
    # after its start; 0.4 s apart was too close for two interpreters started
    # on a machine beside busy loops)...
    assert abs(starts["a"] - starts["b"]) < 1.5, ev
    # ...and c only once both are ready.
    assert starts["c"] > max(starts["a"], starts["b"]) + 1.5, ev
    # Stopped in reverse: c before a and b.
    stops = [n for what, n, _, _ in ev if what == "stop"]
    assert stops[0] == "c" and set(stops) == {"a", "b", "c"}, ev
    for name in "abc":
        assert f"{name}: ready after" in res.stderr
    assert "survivor check empty" in res.stderr
    assert_all_gone(tmp_path)


def test_every_readiness_kind(tmp_path: Path) -> None:
    flag = tmp_path / "e.flag"
    path = write_stack(
        tmp_path,
        f"""
  h:
    cmd: {unit(tmp_path, "h", "--delay", "0.3", "--http", "{port}")}
    port: auto
    ready: {{http: /health, timeout: 10s}}
  t:
    cmd: {unit(tmp_path, "t", "--delay", "0.3", "--tcp", "{port}")}
    port: auto
    ready: {{tcp: "{{port}}", timeout: 10s}}
  l:
    cmd: {unit(tmp_path, "l", "--delay", "0.3", "--say", "model loaded")}
    ready: {{log: "loaded$", timeout: 10s}}
  e:
    cmd: {unit(tmp_path, "e", "--delay", "0.3", "--touch", str(flag))}
    ready: {{exec: [test, -e, "{flag}"], timeout: 10s}}
  f:
    cmd: {unit(tmp_path, "f", "--delay", "0.3", "--touch", "{run_dir}/f.ready")}
    ready: {{file: "{{run_dir}}/f.ready", timeout: 10s}}
""",
    )
    res = hold("up", "--for", "100ms", str(path))
    assert res.returncode == 0, res.stderr
    for name, detail in [
        ("h", "GET /health: 200"),
        ("t", "accepts connections"),
        ("l", "output matched"),
        ("e", "probe command exited 0"),
        ("f", "f.ready exists"),
    ]:
        assert f"{name}: ready after" in res.stderr and detail in res.stderr, res.stderr
    assert_all_gone(tmp_path)


def test_foreign_server_on_a_named_port_is_refused_naming_it(tmp_path: Path) -> None:
    port = free_port()
    foreign = subprocess.Popen(
        [
            PY,
            "-c",
            f"""
import socket, time
s = socket.socket(); s.bind(("127.0.0.1", {port})); s.listen(); print("up", flush=True)
time.sleep(60)
""",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert foreign.stdout is not None and foreign.stdout.readline() == "up\n"
        path = write_stack(
            tmp_path,
            f"""
  web:
    cmd: {unit(tmp_path, "web", "--http", "{port}")}
    port: {port}
    ready: {{http: /health, timeout: 5s}}
""",
        )
        res = hold("up", str(path))
        assert res.returncode == 2, res.stderr
        assert (
            f"{path}:6: units.web.port: port {port} is already taken by pid {foreign.pid}"
            in res.stderr
        ), res.stderr
        assert not (tmp_path / "events").exists()  # nothing started
    finally:
        foreign.kill()
        foreign.wait()


def test_an_answer_from_a_foreign_listener_is_not_believed(tmp_path: Path) -> None:
    """The port is free when the stack starts; someone else takes it before the unit's
    probe: the probe's answer comes from outside the unit's tree, so it is refused."""
    port = free_port()
    path = write_stack(
        tmp_path,
        f"""
  first:
    cmd: {unit(tmp_path, "first", "--delay", "1.0", "--say", "READY")}
    ready: {{log: READY, timeout: 10s}}
  second:
    cmd: {unit(tmp_path, "second")}
    port: {port}
    after: [first]
    ready: {{tcp: "{{port}}", timeout: 10s}}
""",
    )
    up = Up(tmp_path, path)
    foreign = None
    try:
        wait_for(lambda: events(tmp_path), 10, what="the first unit to start")
        foreign = subprocess.Popen(
            [
                PY,
                "-c",
                f"""
import socket, time
s = socket.socket(); s.bind(("127.0.0.1", {port})); s.listen()
while True:
    c, _ = s.accept(); c.close()
""",
            ]
        )
        code = up.wait()
        # A definite no (waiting cannot help): 5, not the timeout's 124.
        assert code == 5, up.err
        assert f"held by pid {foreign.pid}" in up.err and "not by this unit" in up.err, up.err
        assert "failed its readiness check: probe tcp " in up.err, up.err
    finally:
        if foreign is not None:
            foreign.kill()
            foreign.wait()
    assert_all_gone(tmp_path)


def test_failure_at_start_stops_what_started_in_reverse_order(tmp_path: Path) -> None:
    path = write_stack(
        tmp_path,
        f"""
  a:
    cmd: {unit(tmp_path, "a", "--say", "READY")}
    ready: {{log: READY}}
  b:
    cmd: {unit(tmp_path, "b", "--say", "READY")}
    after: [a]
    ready: {{log: READY}}
  c:
    cmd: {unit(tmp_path, "c", "--delay", "0.1", "--exit", "7")}
    after: [b]
    ready: {{log: READY}}
""",
    )
    res = hold("up", str(path))
    assert res.returncode == 4, res.stderr
    assert "unit c failed to start: exited with status 7 before it was ready" in res.stderr
    assert "| c: giving up now" in res.stderr  # its last output lines
    stops = [n for what, n, _, _ in events(tmp_path) if what == "stop"]
    assert stops == ["b", "a"], events(tmp_path)
    assert_all_gone(tmp_path)


def test_a_unit_that_prints_why_and_exits_at_once_is_told_with_its_last_words(
    tmp_path: Path,
) -> None:
    """Its last lines are in the pipe when its exit is seen; the failure waits for
    the reader to take them (20,000 lines first, so that it has work to do)."""
    prog = tmp_path / "loud.py"
    prog.write_text(
        "import sys\n"
        "sys.stdout.write(''.join(f'line {i}\\n' for i in range(20000)))\n"
        "print('the last word', flush=True)\n"
        "sys.exit(7)\n"
    )
    path = write_stack(
        tmp_path,
        f"""
  loud:
    cmd: [{PY}, {prog}]
    ready: {{log: NEVER}}
""",
    )
    res = hold("up", str(path))
    assert res.returncode == 4, res.stderr
    assert "| the last word" in res.stderr, res.stderr[-2000:]


def test_never_ready_in_time_is_exit_124_and_names_the_unit_and_probe(tmp_path: Path) -> None:
    path = write_stack(
        tmp_path,
        f"""
  slow:
    cmd: {unit(tmp_path, "slow", "--say", "still loading")}
    ready: {{log: "^READY$", timeout: 500ms}}
""",
    )
    t0 = time.monotonic()
    res = hold("up", str(path))
    assert res.returncode == 124, res.stderr
    assert (
        "unit slow did not become ready in time: not ready within 0.5s (probe log ^READY$"
        in res.stderr
    ), res.stderr
    assert "| still loading" in res.stderr
    assert time.monotonic() - t0 < 0.5 + LOADED
    assert_all_gone(tmp_path)


# --------------------------------------------------------------------------
# Supervising.


def test_restart_with_growing_backoff_then_give_up(tmp_path: Path) -> None:
    path = write_stack(
        tmp_path,
        f"""
  flaky:
    cmd: {unit(tmp_path, "flaky", "--say", "READY", "--crash-after", "0.1")}
    ready: {{log: READY}}
    restart: {{policy: on-failure, max: 2, backoff: 300ms, max_backoff: 10s}}
""",
    )
    res = hold("up", str(path))
    assert res.returncode == 4, res.stderr
    seen = [(what, t) for what, _, _, t in events(tmp_path)]
    assert [what for what, _ in seen] == ["start", "crash"] * 3, res.stderr
    # From each crash to the next start: at least that restart's backoff. A lower
    # bound only: a loaded machine lengthens the wait, never shortens it.
    waited = [seen[i + 1][1] - seen[i][1] for i in (1, 3)]
    assert waited[0] >= 0.3 and waited[1] >= 0.6, waited
    assert "restart 1 of 2 in 0.3s" in res.stderr and "restart 2 of 2 in 0.6s" in res.stderr
    assert "restarts exhausted (2 of 2 in a row)" in res.stderr
    assert_all_gone(tmp_path)


def test_restart_count_resets_once_the_unit_stayed_up(tmp_path: Path) -> None:
    path = write_stack(
        tmp_path,
        f"""
  flaky:
    cmd: {unit(tmp_path, "flaky", "--say", "READY", "--crash-after", "0.4")}
    ready: {{log: READY}}
    restart: {{policy: always, max: 1, backoff: 50ms, reset_after: 200ms}}
""",
    )
    # Until the third start, not for a fixed time: a loaded machine's start-ups
    # (2-3 s each) fitted two starts into 2.5 s.
    up = Up(tmp_path, path)
    try:
        wait_for(
            lambda: (
                [w for w, _, _, _ in events(tmp_path)].count("start") >= 3
                or up.proc.poll() is not None
            ),
            60,
            what="a third start",
        )
    finally:
        down = hold("down", "t")
    assert up.wait() == 0, up.err
    assert down.returncode == 0, down.stderr
    starts = [t for what, _, _, t in events(tmp_path) if what == "start"]
    assert len(starts) >= 3, up.err  # max 1, but each run reset the count
    assert "exhausted" not in up.err
    assert_all_gone(tmp_path)


# --------------------------------------------------------------------------
# Stopping: nothing is left, however it ends (with an escapee holding a "device").


def escapee_stack(base: Path) -> Path:
    return write_stack(
        base,
        f"""
  model:
    cmd: {unit(base, "model", "--http", "{port}")}
    port: auto
    ready: {{http: /health}}
    stop: {{grace: 2s}}
  worker:
    cmd: {unit(base, "worker", "--escapee", "--ignore-term", "--say", "READY")}
    after: [model]
    ready: {{log: READY}}
    stop: {{grace: 300ms}}
""",
    )


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_everything(tmp_path: Path, cgroup_mode: str, sig: int) -> None:
    up = Up(tmp_path, escapee_stack(tmp_path))
    up.wait_up()
    wait_for(lambda: "worker-escapee" in pids(tmp_path), 20, what="the escapee")
    up.proc.send_signal(sig)
    assert up.wait() == 0, up.err
    assert f"{signal.Signals(sig).name} received" in up.err
    stops = [n for what, n, _, _ in events(tmp_path) if what == "stop"]
    assert stops == ["model"]  # the worker ignores TERM: it was killed after its grace
    assert "survivor check empty" in up.err
    assert_all_gone(tmp_path, timeout=2)


def test_sigkill_of_hold_up_the_daemon_stops_everything(tmp_path: Path, cgroup_mode: str) -> None:
    up = Up(tmp_path, escapee_stack(tmp_path))
    up.wait_up()
    wait_for(lambda: "worker-escapee" in pids(tmp_path), 20, what="the escapee")
    # Walk mode: hold up is a keeper and its launcher, which stops the units once
    # the keeper is killed, then ends itself.
    launchers = [
        st.pid
        for st in scan.snapshot().values()
        if st.ppid == up.proc.pid and " hold up " in procscan_cmd(st.pid)
    ]
    up.proc.kill()
    up.proc.wait()
    assert_all_gone(tmp_path, timeout=15)
    # Its survivor check and clean-up come after the units' end: a loaded
    # machine took more than the 2 s the leak check waits.
    wait_for(lambda: not any(alive(p) for p in launchers), LOADED, what=f"{launchers} to end")


def test_detach_ps_logs_restart_down(tmp_path: Path, cgroup_mode: str) -> None:
    path = escapee_stack(tmp_path)
    res = hold("up", "--detach", str(path))
    try:
        assert res.returncode == 0, res.stderr
        assert "model: ready after" in res.stderr and "is up in the background" in res.stderr
        ps = hold("ps", "t")
        assert ps.returncode == 0, ps.stderr
        assert "model" in ps.stdout and "worker" in ps.stdout and "log READY" in ps.stdout
        assert hold("ps").stdout.splitlines()[1].startswith("t ")
        logs = hold("logs", "t", "worker")
        assert logs.returncode == 0, logs.stderr
        said = [
            line.split(" out | ", 1)[1] for line in logs.stdout.splitlines() if " out | " in line
        ]
        assert "READY" in said, logs.stdout
        assert hold("logs", "t", "nobody").returncode == 2

        old = pids(tmp_path)["model"][-1]
        rs = hold("restart", "t", "model")
        assert rs.returncode == 0, rs.stderr
        assert not alive(old) and len(pids(tmp_path)["model"]) == 2

        with open(tmp_path / "follow.out", "w") as out:
            follow = subprocess.Popen(
                [*HOLD, "logs", "-f", "t", "model"], stdout=out, stdin=subprocess.DEVNULL
            )
    finally:
        down = hold("down", "t")
    assert down.returncode == 0, down.stderr + res.stderr
    assert "stack t stopped" in down.stderr
    assert follow.wait(10) == 0  # follow ends with the stack
    assert "model: starting" in (tmp_path / "follow.out").read_text()
    assert hold("ps", "t").returncode == 1
    assert_all_gone(tmp_path, timeout=2)


def test_units_run_inside_the_stacks_ticket(tmp_path: Path) -> None:
    nodes = tmp_path / "nodes"
    nodes.mkdir()
    (nodes / "fakedev0").write_text("")
    (tmp_path / "config.yaml").write_text(
        f'cgroups: auto\ndevices:\n  fake: {{nodes: ["{nodes}/fakedev*"]}}\n'
    )
    check = tmp_path / "check"
    script = (
        f"{PY} -m hold check --device fake; echo $? > {check}.tmp; mv {check}.tmp {check}; "
        f'echo "$HOLD_DEVICES" > {tmp_path}/devices; exec sleep 30'
    )
    path = tmp_path / "stack.yaml"
    path.write_text(f"""name: ticketed
hold: {{device: fake, ttl: 1h, label: "stack test"}}
units:
  u:
    cmd:
      - /bin/sh
      - -c
      - '{script}'
    ready: {{file: "{check}"}}
""")
    res = hold("up", "--for", "100ms", str(path))
    assert res.returncode == 0, res.stderr
    assert check.read_text().strip() == "0"  # `hold check` passed inside the unit
    assert (tmp_path / "devices").read_text().strip() == "fake:0"
    assert "inside lease" in res.stderr


def test_demo_stack_runs_anywhere(tmp_path: Path) -> None:
    res = subprocess.run(
        [*HOLD, "up", "--for", "300ms", "units/demo-stack.yaml"],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    for name in ("model", "predictor", "executor"):
        assert f"{name}: ready after" in res.stderr
    assert "survivor check empty" in res.stderr


def test_detach_returns_the_failure_of_a_stack_that_never_came_up(tmp_path: Path) -> None:
    path = write_stack(
        tmp_path,
        f"""
  a:
    cmd: {unit(tmp_path, "a", "--exit", "9")}
    ready: {{log: READY}}
""",
    )
    res = hold("up", "--detach", str(path))
    assert res.returncode == 4, res.stderr
    assert "unit a failed to start: exited with status 9" in res.stderr
    assert hold("ps", "t").returncode == 1
    assert_all_gone(tmp_path)


def test_unit_log_rotates_by_size_and_follow_crosses_rotations(tmp_path: Path) -> None:
    from hold_supervisor.unitlog import RotatingLog, follow, tail_lines

    path = tmp_path / "u.log"
    log = RotatingLog(str(path), max_bytes=100, keep=2)
    log.write("first")
    _, ino, offset = tail_lines(str(path), None)
    for i in range(30):
        log.write(f"line {i:02d} " + "x" * 20)
    log.close()
    assert path.stat().st_size <= 100
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("u.log"))
    assert names == ["u.log", "u.log.1", "u.log.2"]
    last, _, _ = tail_lines(str(path), 1)
    assert last == ["line 29 " + "x" * 20]
    # A follower that started at "first" sees what the current file holds after rotation.
    seen = list(follow(str(path), ino, offset, keep_going=lambda: False))
    assert seen[-1] == "line 29 " + "x" * 20


def test_no_such_stack_is_exit_1_for_every_command_with_did_you_mean(tmp_path: Path) -> None:
    """ps, logs, restart, call and down agree: no such stack is exit 1, with the
    closest name of the stacks that exist; down of a stopped stack is 0 (as
    systemctl stop), down of a name that never ran here is 1."""
    path = write_stack(
        tmp_path,
        f"""
  a:
    cmd: {unit(tmp_path, "a", "--say", "READY")}
    ready: {{log: READY}}
  tool:
    kind: task
    cmd: [{PY}, -c, "print(1)"]
    cpus: "{CPU}"
    timeout: 10s
""",
        name="uxstack",
    )
    res = hold("up", "--detach", str(path))
    try:
        assert res.returncode == 0, res.stderr
        for args in (
            ("ps", "uxstak"),
            ("ps", "--json", "uxstak"),
            ("logs", "uxstak", "a"),
            ("restart", "uxstak", "a"),
            ("call", "uxstak", "tool"),
            ("down", "uxstak"),
        ):
            got = hold(*args)
            assert got.returncode == 1, (args, got.stderr)
            assert "did you mean 'uxstack'?" in got.stderr, (args, got.stderr)
            assert got.stdout == "", (args, got.stdout)
    finally:
        down = hold("down", "uxstack")
    assert down.returncode == 0, down.stderr
    again = hold("down", "uxstack")
    assert again.returncode == 0 and "stack uxstack is not running" in again.stderr
    for args in (("ps", "uxstack"), ("restart", "uxstack", "a"), ("call", "uxstack", "tool")):
        got = hold(*args)
        assert got.returncode == 1 and "stack uxstack is not running" in got.stderr, args
    assert hold("logs", "uxstack", "a").returncode == 0  # its logs outlive it


def test_validate_shows_what_hold_up_would_do(tmp_path: Path) -> None:
    """Services and one-shots in start order with their conditions, task units apart;
    --json is the resolved stack, versioned."""
    path = write_stack(
        tmp_path,
        f"""
  tool:
    kind: task
    cmd: [{PY}, -c, "print(1)"]
    cpus: "{CPU}"
    timeout: 10s
  api:
    cmd: [{PY}, -c, "pass"]
    after: [migrate, model]
    liveness: {{tcp: "{{port}}", period: 2s}}
    port: auto
  model:
    cmd: [{PY}, -c, "pass"]
    ready: {{log: READY}}
    essential: false
  migrate:
    kind: oneshot
    cmd: [{PY}, -c, "pass"]
""",
    )
    res = hold("validate", str(path))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == f"{path}: stack t is valid: 3 unit(s) started by hold up, 1 task unit(s)"
    assert lines[1] == "start order:"
    assert [ln.split()[1:3] for ln in lines[2:5]] == [
        ["model", "service"],
        ["migrate", "oneshot"],
        ["api", "service"],
    ]
    assert lines[2].endswith("ready: log READY; not essential")
    assert "done when it exits 0" in lines[3]
    assert "after migrate (completed), model (ready); ready: at start" in lines[4]
    assert "liveness: tcp {port} every 2s, restart after 3 failures" in lines[4]
    assert lines[5].startswith("task units (never started by hold up")
    assert lines[6].split() == ["tool", "cpus", f"{CPU},", "timeout", "10s,", "concurrency", "1"]

    res = hold("validate", "--json", str(path))
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["version"] == 1 and got["stack"] == "t" and got["tasks"] == ["tool"]
    assert got["start_order"] == ["model", "migrate", "api"]
    assert got["stack_dir"] == str(tmp_path)
    api = got["units"]["api"]
    assert api["after"] == [
        {"unit": "migrate", "condition": "completed"},
        {"unit": "model", "condition": "ready"},
    ]
    assert api["stop"] == {"signal": "SIGTERM", "grace": 10.0} and api["essential"] is True
    assert got["units"]["model"]["essential"] is False


def test_ps_shows_kinds_states_essential_and_liveness(tmp_path: Path) -> None:
    """hold ps: kind, the not-essential marker, completed/skipped, liveness; --json
    versioned, without the channel's framing."""
    path = write_stack(
        tmp_path,
        f"""
  migrate:
    kind: oneshot
    cmd: [{PY}, -c, "pass"]
  bad:
    kind: oneshot
    cmd: [{PY}, -c, "raise SystemExit(1)"]
    essential: false
  after_bad:
    cmd: [{PY}, -c, "import time; time.sleep(60)"]
    after: [bad]
    essential: false
  api:
    cmd: {unit(tmp_path, "api", "--say", "READY")}
    after: [migrate]
    ready: {{log: READY}}
    liveness: {{exec: [{PY}, -c, "pass"], period: 200ms}}
  tool:
    kind: task
    cmd: [{PY}, -c, "print(1)"]
    cpus: "{CPU}"
    timeout: 10s
""",
    )
    res = hold("up", "--detach", str(path))
    try:
        assert res.returncode == 0, res.stderr

        def units() -> dict[str, dict[str, object]]:
            got = hold("ps", "--json", "t")
            assert got.returncode == 0, got.stderr
            doc = json.loads(got.stdout)
            assert doc["version"] == 1 and "ev" not in doc and "done" not in doc
            return {u["unit"]: u for u in doc["units"]}

        wait_for(lambda: units()["api"]["liveness"] == "ok", 15, what="a liveness answer")
        u = units()
        assert {n: (u[n]["kind"], u[n]["state"], u[n]["essential"]) for n in u} == {
            "migrate": ("oneshot", "completed", True),
            "bad": ("oneshot", "failed", False),
            "after_bad": ("service", "skipped", False),
            "api": ("service", "ready", True),
            "tool": ("task", "ready", True),
        }
        every = json.loads(hold("ps", "--json").stdout)
        assert every["version"] == 1 and [s["stack"] for s in every["stacks"]] == ["t"]
        assert "ev" not in every["stacks"][0]

        table = hold("ps", "t")
        assert table.returncode == 0, table.stderr
        rows = {ln.split()[0]: ln.split() for ln in table.stdout.splitlines()[1:] if ln.strip()}
        assert rows["UNIT"][:3] == ["UNIT", "KIND", "STATE"] and rows["UNIT"][-1] == "LIVENESS"
        assert rows["migrate"][1:3] == ["oneshot", "completed"]
        assert rows["bad*"][1:3] == ["oneshot", "failed"]
        assert rows["after_bad*"][1:3] == ["service", "skipped"]
        assert rows["api"][1:3] == ["service", "ready"] and rows["api"][-1] == "ok"
        assert rows["tool"][1] == "task"
        assert "* not essential" in table.stdout
    finally:
        assert hold("down", "t").returncode == 0
