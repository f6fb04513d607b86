"""Task units (``kind: task``): one isolated, bounded run per call.

Through the Python API (:class:`hold_supervisor.task.task.TaskRunner`, no daemon) and
through ``hold up`` + ``hold call``, with real processes: ``progs/task_prog.py``
records in DIR/started every time it starts (so "nothing started" can be
checked) and, in ``nasty`` mode, every pid of its tree (an escapee included)
in DIR/pids, so a test can check that every one of them is gone. The autouse
leak check adds that nothing is left under pytest.
"""

from __future__ import annotations

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
from hold_supervisor.proc.identity import NoSuchProcess, read_cmdline
from hold_supervisor.stackfile.load import StackFileError, UnitSpec, load
from hold_supervisor.task.task import (
    ARGS_LIMIT,
    STDERR_TAIL,
    STDOUT_LIMIT,
    ArgsRefused,
    Busy,
    CallResult,
    TaskRunner,
)

PY = sys.executable
PROG = str(PROGS / "task_prog.py")
# The lane: one CPU, and not the whole machine where there is more than one,
# so that "inherited the parent's mask" cannot pass for "got its lane".
LANE = max(allowed_cpus())

ARGS = """
      s: {type: float, min: 0, max: 30}
      n: {type: int, min: 0, max: 1000000000}
      word: {type: str, max_len: 8}
      text: {type: str}
      mode: {type: str, choices: [fast, slow]}
      flag: {type: bool}
"""


# --------------------------------------------------------------------------
# Helpers.


def task_yaml(base: Path, mode: str, *, name: str = "ex", **keys: str) -> str:
    """A task unit running task_prog.py in ``mode``; ``keys`` are added as written."""
    cmd = "[" + ", ".join(f'"{a}"' for a in (PY, PROG, str(base), mode)) + "]"
    opts = {"timeout": "20s", "stop": "{grace: 300ms}", **keys}
    body = f'  {name}:\n    kind: task\n    cmd: {cmd}\n    cpus: "{LANE}"\n'
    body += "".join(f"    {k}: {v}\n" for k, v in opts.items())
    body += f"    args:{ARGS}"
    return body


def spec_of(base: Path, mode: str, **keys: str) -> UnitSpec:
    spec = load(str(base / "stack.yaml"), text="name: t\nunits:\n" + task_yaml(base, mode, **keys))
    return spec.units["ex"]


@pytest.fixture
def runner_for(cgroup_mode: str, tmp_path: Path) -> Iterator[object]:
    """A factory of standalone runners (closed at the end), in the test's cgroup mode."""
    runners: list[TaskRunner] = []

    def make(mode: str, **keys: str) -> TaskRunner:
        r = TaskRunner.standalone(
            "ex",
            spec_of(tmp_path, mode, **keys),
            cgroups="required" if cgroup_mode == "cgroup" else "off",
            log_path=str(tmp_path / "calls.log"),
        )
        runners.append(r)
        return r

    yield make
    for r in runners:
        r.close()
        if r.leaf is not None:
            assert not os.path.exists(r.leaf.path), "the unit's cgroup leaf was left"


def started(base: Path) -> list[str]:
    path = base / "started"
    return path.read_text().splitlines() if path.exists() else []


def tree_pids(base: Path) -> dict[str, int]:
    path = base / "pids"
    if not path.exists():
        return {}
    return {role: int(pid) for role, pid in (ln.split() for ln in path.read_text().splitlines())}


def wait_tree(base: Path) -> dict[str, int]:
    return wait_for(
        lambda: (p := tree_pids(base)) and len(p) == 3 and p,
        10,
        what="root, child and escapee to start",
    )


def assert_gone(pids: dict[str, int], timeout: float = 0.0) -> None:
    if timeout:
        wait_for(lambda: not any(alive(p) for p in pids.values()), timeout, what=f"{pids} to end")
    left = {role: pid for role, pid in pids.items() if alive(pid)}
    assert not left, f"still alive: {left}"


def records(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)  # the log is JSON lines: a record per call, one per run
        if "call" in rec:
            out.append(rec)
    return out


# --------------------------------------------------------------------------
# The stack file.


def test_task_units_are_validated(tmp_path: Path) -> None:
    text = f"""\
name: t
units:
  svc:
    cmd: [sleep, "10"]
    after: [ex]
    concurrency: 2
  ex:
    kind: task
    cmd: [{PY}]
    port: auto
    ready: {{log: x}}
    restart: {{policy: always}}
    timeout: 3
    concurrency: 0
    args:
      size: {{type: int, min: 1, max: 2.5}}
      name: {{type: str, min: 1}}
      mode: {{type: str, choices: [a, 3]}}
      9x: {{type: int}}
      y: {{type: list}}
      z: {{type: bool, extra: 1}}
  nolane:
    kind: task
    cmd: [{PY}]
  emptylane:
    kind: task
    cmd: [{PY}]
    cpus: ""
"""
    path = tmp_path / "stack.yaml"
    path.write_text(text)
    with pytest.raises(StackFileError) as info:
        load(str(path))
    got = "\n".join(e.split(":", 2)[2].strip() for e in info.value.errors)
    for want in [
        "units.svc.after[0]: 'ex' is a task unit",
        "units.svc.concurrency: only for a task unit",
        "units.ex.port: not for a task unit",
        "units.ex.ready: not for a task unit",
        "units.ex.restart: not for a task unit",
        "units.ex.timeout: 3 is not valid: a duration with its unit",
        "units.ex.concurrency: 0 is not valid: a whole number, 1 or more",
        "units.ex.args.size: max 2.5 is not valid: a whole number for an int",
        "units.ex.args.name: min and max are for int and float arguments, not str",
        "units.ex.args.mode: choice 3 is not valid: a string",
        "units.ex.args.9x: '9x' is not valid: an argument name",
        "units.ex.args.y.type: 'list' is not valid: one of int, float, str, bool",
        "units.ex.args.z.extra: unknown key; accepted: type, min, max, max_len, choices, required",
        "units.nolane: cpus is required for a task unit",
        "units.emptylane.cpus: '' is not valid: a list of CPUs",
    ]:
        assert want in got, f"{want!r} not in:\n{got}"
    # Each error names its line.
    assert any(e.startswith(f"{path}:6: units.svc.concurrency") for e in info.value.errors)

    # hold validate agrees (exit 2, nothing started); a good task file is valid.
    res = subprocess.run([*HOLD, "validate", str(path)], capture_output=True, text=True)
    assert res.returncode == 2 and "cpus is required for a task unit" in res.stderr
    path.write_text("name: t\nunits:\n" + task_yaml(tmp_path, "report"))
    res = subprocess.run([*HOLD, "validate", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


# --------------------------------------------------------------------------
# The API.


def test_escapee_is_stopped_at_the_timeout(runner_for: object, tmp_path: Path) -> None:
    make = runner_for
    runner: TaskRunner = make("nasty", timeout="1s")  # type: ignore[operator]
    t0 = time.monotonic()
    r = runner.call({})
    took = time.monotonic() - t0
    pids = tree_pids(tmp_path)
    assert set(pids) == {"root", "child", "escapee"}, pids
    assert r.outcome == "timeout" and r.exit_code == 124, r
    assert r.survivors == () and r.report is not None and r.report.ok
    assert r.report.outcome == "killed"  # they ignore TERM: the grace ran out
    stopped = {m.pid for m in r.report.stopped}
    assert set(pids.values()) <= stopped, (pids, r.report.summary())
    assert_gone(pids)
    # The timeout, then the grace (0.3 s), then the kill: bounded.
    assert 1.0 <= took < 1.0 + 0.3 + LOADED, took
    assert r.wall < 1.0 + 0.3 + LOADED
    rec = records(tmp_path / "calls.log")
    assert len(rec) == 1 and rec[0]["exit"] == 124 and rec[0]["survivors"] == []
    assert rec[0]["call"] == r.call_id and rec[0]["args_sha256"] == r.args_sha256


def test_timeout_counts_from_the_start_not_the_collection(tmp_path: Path) -> None:
    with TaskRunner.standalone("ex", spec_of(tmp_path, "sleep", timeout="700ms")) as runner:
        call = runner.submit({"s": 20})
        # Nobody collects: the call must still end at its timeout.
        wait_for(lambda: started(tmp_path), 10, what="the task to start")
        pid = int(started(tmp_path)[0].split()[1])
        wait_for(lambda: call.done(), 20, what="the call to end on its own")
        assert not alive(pid)
        # Collected late, on purpose: what the test is about (not a wait for an event).
        time.sleep(0.5)
        r = call.result(timeout=0)
        assert r.outcome == "timeout" and r.exit_code == 124
        assert 0.7 <= r.wall < 0.7 + LOADED, r.wall  # its timeout, not the sleep's 20 s


def test_concurrency_limit_holds_under_20_parallel_calls(tmp_path: Path) -> None:
    with TaskRunner.standalone(
        "ex", spec_of(tmp_path, "overlap", concurrency="3"), cgroups="auto"
    ) as runner:
        results: list[CallResult] = []
        lock = threading.Lock()

        def one() -> None:
            res = runner.call({"s": 0.15})
            with lock:
                results.append(res)

        threads = [threading.Thread(target=one) for _ in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
    assert len(results) == 20 and all(r.exit_code == 0 for r in results), results
    events = []
    for line in (tmp_path / "times").read_text().splitlines():
        what, _call, t = line.split()
        events.append((float(t), 0 if what == "end" else 1))
    assert len(events) == 40
    running = peak = 0
    for _t, is_start in sorted(events):  # an end at the same instant comes first
        running += 1 if is_start else -1
        peak = max(peak, running)
    assert peak <= 3, f"{peak} calls overlapped (concurrency 3)"
    assert peak >= 2, "the calls never ran in parallel"
    assert max(r.queued for r in results) > 0.1  # some had to wait


def test_waiting_calls_go_in_arrival_order_and_no_wait_is_refused(tmp_path: Path) -> None:
    with TaskRunner.standalone("ex", spec_of(tmp_path, "sleep", concurrency="1")) as runner:
        first = runner.submit({"s": 0.5})
        wait_for(lambda: first.state == "running", 10, what="the first call to run")
        with pytest.raises(Busy) as info:
            runner.submit({}, no_wait=True)
        assert info.value.code == 75 and "busy" in str(info.value)
        calls = [runner.submit({"n": i}) for i in range(5)]
        results = [c.result(timeout=30) for c in calls]
        assert [r.exit_code for r in results] == list(range(5))
        starts = [c.started_at for c in calls]
        assert all(s is not None for s in starts)
        assert starts == sorted(starts), "calls did not start in the order they came"  # type: ignore[type-var]
        assert first.result(timeout=10).exit_code == 0
    # Refused with --no-wait: nothing started for it.
    assert len(started(tmp_path)) == 6


def test_refused_arguments_start_nothing(tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    spec = spec_of(tmp_path, "report")
    with TaskRunner.standalone("ex", spec, log_path=str(log)) as runner:
        bad: list[tuple[object, str]] = [
            ({"size": 3}, "argument 'size' is not accepted by task ex (accepted: flag, mode, n"),
            ({"n": "3"}, "argument 'n': '3' is not valid: an int"),
            ({"n": 2.0}, "argument 'n': 2.0 is not valid: an int"),
            ({"n": True}, "argument 'n': True is not valid: an int"),
            ({"n": -1}, "argument 'n': -1 is not valid: an int from 0 to 1000000000"),
            ({"s": 31}, "argument 's': 31 is not valid: a number from 0 to 30"),
            ({"s": float("nan")}, "argument 's': nan is not valid"),
            ({"word": "x" * 9}, "a string of at most 8 characters (this one has 9)"),
            ({"mode": "medium"}, "a string, one of 'fast', 'slow'"),
            ({"flag": 1}, "argument 'flag': 1 is not valid: true or false"),
            ({"text": "x" * ARGS_LIMIT}, "too large"),
            ([1, 2], "are not valid: a JSON object"),
        ]
        for args, why in bad:
            with pytest.raises(ArgsRefused) as info:
                runner.submit(args)
            assert info.value.code == 2
            assert why in str(info.value), (args, str(info.value))
        # Every problem at once.
        with pytest.raises(ArgsRefused) as info:
            runner.submit({"n": -1, "size": 1})
        assert len(info.value.errors) == 2
        # Text arguments (hold call --arg) are read by the declared type, strictly.
        with pytest.raises(ArgsRefused) as info:
            runner.submit({}, text_args={"n": "0x10", "flag": "yes", "s": "inf"})
        assert len(info.value.errors) == 3, info.value.errors
        assert runner.running() == []
        assert started(tmp_path) == [] and records(log) == []
        # The same arguments, well formed, do start it.
        r = runner.call({"n": 5, "mode": "fast"}, text_args={"s": "1.5", "flag": "true"})
        assert r.exit_code == 0, r
        assert json.loads(r.stdout)["args"] == {"n": 5, "mode": "fast", "s": 1.5, "flag": True}
        assert len(started(tmp_path)) == 1


def test_the_task_starts_on_its_lane_with_0_1_2_and_a_minimal_env(
    runner_for: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SUPERVISOR_SECRET", "do-not-leak")
    clutter = os.open(os.devnull, os.O_RDONLY)
    os.set_inheritable(clutter, True)
    try:
        make = runner_for
        runner: TaskRunner = make("report")  # type: ignore[operator]
        r = runner.call({"n": 1})
    finally:
        os.close(clutter)
    assert r.exit_code == 0, r
    seen = json.loads(r.stdout)
    assert seen["mask"] == [LANE], "the task's first instruction ran off its lane"
    assert r.cpus == frozenset({LANE})
    assert seen["fds"] == [0, 1, 2]
    assert "SUPERVISOR_SECRET" not in seen["env"]
    allowed = {"PATH", "HOME", "LANG", "TERM", "USER", "TZ", "PWD"}
    extra = {k for k in seen["env"] if k not in allowed and not k.startswith(("LC_", "HOLD_"))}
    assert not extra, extra
    assert {"HOLD_TREE", "HOLD_CALL", "HOLD_UNIT"} <= set(seen["env"])

    # grep's own first instruction, not only a Python program's view of it.
    spec = load(
        str(tmp_path / "s.yaml"),
        text=f"name: t\nunits:\n  g:\n    kind: task\n    cmd: [grep, Cpus_allowed_list, "
        f'/proc/self/status]\n    cpus: "{LANE}"\n',
    ).units["g"]
    with TaskRunner.standalone("g", spec) as g:
        out = g.call({}).stdout.decode().split()
    assert out == ["Cpus_allowed_list:", str(LANE)]


def parked(runner: TaskRunner) -> list[int]:
    """The stubs parked in the unit's leaf: processes in it (a stub moves itself
    into a leaf below the unit's, then reads its call) that still run the
    stub's shell, asleep on that read. Empty while any of them is not yet there."""
    assert runner.leaf is not None
    pids = runner.leaf.pids()
    for pid in pids:
        st = scan.stat_of(pid)
        try:
            cmd = read_cmdline(pid)
            wchan = Path(f"/proc/{pid}/wchan").read_text()
        except (NoSuchProcess, OSError):
            return []
        if st is None or st.state != "S" or not cmd.startswith("/bin/sh -c "):
            return []
        if wchan != "0" and "pipe" not in wchan:  # "0": the kernel does not say
            return []
    return pids


def test_the_parked_stub_runs_nothing_before_a_call(tmp_path: Path) -> None:
    from hold_supervisor.proc.cgroup import CgroupUnavailable, Hierarchy

    try:
        Hierarchy.find()
    except CgroupUnavailable as e:
        pytest.skip(f"no writable cgroup v2 here: {e}")
    with TaskRunner.standalone("ex", spec_of(tmp_path, "report"), cgroups="required") as runner:
        # The stub: the one process in the unit's leaf, blocked reading its call.
        (stub,) = wait_for(lambda: parked(runner), 10, what="a stub parked for the first call")
        assert started(tmp_path) == [], "the task ran before any call"
        first = runner.call({"n": 1})
        assert first.pid == stub and first.exit_code == 0
        # Killed while parked (by anyone): the next call starts cold, isolated the same.
        (second_stub,) = wait_for(
            lambda: [p for p in parked(runner) if p != stub], 10, what="a new stub"
        )
        os.kill(second_stub, signal.SIGKILL)
        wait_for(lambda: not alive(second_stub), 20, what="the stub to die")
        second = runner.call({"n": 2})
        assert second.exit_code == 0 and second.pid != second_stub
        for r in (first, second):
            seen = json.loads(r.stdout)
            assert seen["mask"] == [LANE] and seen["fds"] == [0, 1, 2], seen
            assert seen["args"]["n"] in (1, 2)
            assert {"HOLD_CALL", "HOLD_TREE"} <= set(seen["env"])
        assert [line.split()[0] for line in started(tmp_path)] == [first.call_id, second.call_id]


def test_output_is_bounded(tmp_path: Path) -> None:
    with TaskRunner.standalone("ex", spec_of(tmp_path, "flood")) as runner:
        r = runner.call({"n": 3 * STDOUT_LIMIT})
    assert r.exit_code == 0
    assert len(r.stdout) == STDOUT_LIMIT and r.stdout_truncated
    assert r.stdout_bytes == 3 * STDOUT_LIMIT
    # The end of stderr is what says what went wrong: the tail is kept.
    assert r.stderr_truncated and len(r.stderr_tail) == STDERR_TAIL
    assert r.stderr_tail.endswith(b"e\n")


def test_cancel_mid_run_leaves_nothing(runner_for: object, tmp_path: Path) -> None:
    make = runner_for
    runner: TaskRunner = make("nasty", concurrency="1", timeout="60s")  # type: ignore[operator]
    call = runner.submit({})
    queued = runner.submit({})
    pids = wait_tree(tmp_path)
    # A call still waiting for its slot leaves the line; nothing starts.
    queued.cancel()
    q = queued.result(timeout=5)
    assert q.outcome == "cancelled" and q.exit_code == 130 and q.pid is None
    t0 = time.monotonic()
    call.cancel()
    r = call.result(timeout=50)
    took = time.monotonic() - t0
    assert r.outcome == "cancelled" and r.exit_code == 130, r
    assert r.survivors == ()
    assert_gone(pids)
    assert took < 0.3 + LOADED, took  # the grace, then the kill: not the timeout's 60 s
    assert len(started(tmp_path)) == 1

    # Leaving a `with call:` block without its result cancels it the same way.
    (tmp_path / "pids").unlink()
    with pytest.raises(KeyboardInterrupt), runner.submit({}):
        pids = wait_tree(tmp_path)
        raise KeyboardInterrupt
    assert_gone(pids)


def test_closing_the_runner_stops_its_calls(tmp_path: Path) -> None:
    runner = TaskRunner.standalone("ex", spec_of(tmp_path, "nasty"))
    call = runner.submit({})
    pids = wait_tree(tmp_path)
    results = runner.close()
    assert [r.outcome for r in results] == ["cancelled"] and call.done()
    assert_gone(pids)
    with pytest.raises(Exception, match="takes no more calls"):
        runner.submit({})


# --------------------------------------------------------------------------
# hold up + hold call.


class Up:
    """``hold up FILE`` in the background, its stderr in a file."""

    def __init__(self, base: Path, body: str, env: dict[str, str] | None = None, **kw: object):
        self.path = base / "stack.yaml"
        self.path.write_text("name: t\nunits:\n" + body)
        self.err_path = base / "up.stderr"
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [*HOLD, "up", str(self.path)],
                stdin=subprocess.DEVNULL,
                stdout=err,
                stderr=err,
                env=env,
                **kw,  # type: ignore[arg-type]
            )
        wait_for(lambda: " is up " in self.err or self.proc.poll() is not None, 20, what="up")
        assert " is up " in self.err, self.err

    @property
    def err(self) -> str:
        return self.err_path.read_text()

    def down(self) -> int:
        res = subprocess.run([*HOLD, "down", "t"], capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        code = self.wait()
        assert code == 0, self.err
        return code

    def wait(self, timeout: float = 30) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"hold up did not end: {self.err}") from None


def hold_call(*args: str, timeout: float = 30, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*HOLD, "call", "t", *args], capture_output=True, text=True, timeout=timeout, **kw
    )  # type: ignore[call-overload, no-any-return]


def test_hold_call_through_the_stack(tmp_path: Path) -> None:
    body = (
        task_yaml(tmp_path, "report")
        + task_yaml(tmp_path, "sleep", name="slow", timeout="3s", concurrency="1")
        + task_yaml(tmp_path, "gate", name="gated", timeout="40s", concurrency="1")
    )
    env = dict(os.environ, SUPERVISOR_SECRET="do-not-leak")
    r, w = os.pipe()  # an inheritable descriptor in hold up's hands
    os.set_inheritable(w, True)
    try:
        up = Up(tmp_path, body, env=env, pass_fds=(w,))
    finally:
        os.close(r)
        os.close(w)
    try:
        # Output: the task's stdout on stdout, the summary on stderr, its exit code.
        res = hold_call("ex", "--arg", "n=7", "--arg", "mode=slow", "--arg", "flag=false")
        assert res.returncode == 0, res.stderr
        seen = json.loads(res.stdout)
        assert seen["args"] == {"n": 7, "mode": "slow", "flag": False}
        assert seen["mask"] == [LANE] and seen["fds"] == [0, 1, 2]
        assert "SUPERVISOR_SECRET" not in seen["env"]
        assert "ex call " in res.stderr and "exited 0" in res.stderr

        res = hold_call("slow", "--json-args", "-", "--json", input='{"n": 3}')
        assert res.returncode == 3, res.stderr
        doc = json.loads(res.stdout)
        assert doc["outcome"] == "exited" and doc["exit"] == 3 and doc["cpus"] == str(LANE)

        # The timeout: 124. Refused arguments: 2, nothing started.
        res = hold_call("slow", "--arg", "s=20")
        assert res.returncode == 124, res.stderr
        n = len(started(tmp_path))
        for bad in (["--arg", "s=fast"], ["--arg", "zz=1"], ["--arg", "s=99"], ["--arg", "s"]):
            res = hold_call("slow", *bad)
            assert res.returncode == 2, (bad, res.stderr)
            assert bad[1] in res.stderr or "not valid" in res.stderr or "accepted" in res.stderr
        res = hold_call("slow", "--json-args", "-", input="[1]")
        assert res.returncode == 2 and "a JSON object" in res.stderr
        res = hold_call("nosuch")
        assert res.returncode == 2, res.stderr
        assert "no unit of stack t (task units: ex, slow, gated)" in res.stderr
        assert len(started(tmp_path)) == n

        # --no-wait while the only slot is taken: 75; hold ps shows the running call.
        # The call holds its slot until the test opens the gate: a timed call
        # (2.5 s) ended before ps read it, on a loaded machine.
        bg = subprocess.Popen(
            [*HOLD, "call", "t", "gated"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            wait_for(lambda: len(started(tmp_path)) == n + 1, 20, what="the gated call")
            res = hold_call("gated", "--no-wait")
            assert res.returncode == 75, res.stderr
            ps = subprocess.run([*HOLD, "ps", "t"], capture_output=True, text=True, timeout=30)
            gated = [ln for ln in ps.stdout.splitlines() if ln.startswith("gated ")]
            assert len(gated) == 1 and "per call: 1 running" in gated[0], ps.stdout
            assert "CALL" in ps.stdout and "running" in ps.stdout, ps.stdout
        finally:
            (tmp_path / "gate").touch()
            assert bg.wait(30) == 0
        assert len(started(tmp_path)) == n + 1

        # Each call is in the unit's log.
        rec = records(tmp_path / "state" / "stacks" / "t" / "logs" / "slow.log")
        assert [x["exit"] for x in rec] == [3, 124]
        assert all(len(str(x["args_sha256"])) == 64 for x in rec)
    finally:
        assert up.down() == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_killing_hold_call_cancels_the_call(tmp_path: Path, sig: int) -> None:
    up = Up(tmp_path, task_yaml(tmp_path, "nasty"))
    try:
        client = subprocess.Popen(
            [*HOLD, "call", "t", "ex"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        pids = wait_tree(tmp_path)
        client.send_signal(sig)
        _out, err = client.communicate(timeout=15)
        if sig == signal.SIGINT:
            # It asked the stack to cancel and waited for the stop: all gone now.
            assert client.returncode == 130, err
            assert b"cancelled" in err
            assert_gone(pids)
        else:
            assert_gone(pids, timeout=10)
        rec = wait_for(
            lambda: records(tmp_path / "state" / "stacks" / "t" / "logs" / "ex.log"),
            10,
            what="the call's record",
        )
        assert rec[0]["outcome"] == "cancelled" and rec[0]["survivors"] == []
    finally:
        assert up.down() == 0


def test_a_stopping_stack_stops_its_calls(tmp_path: Path) -> None:
    up = Up(tmp_path, task_yaml(tmp_path, "nasty"))
    client = subprocess.Popen(
        [*HOLD, "call", "t", "ex"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    pids = wait_tree(tmp_path)
    assert up.down() == 0
    assert_gone(pids)
    _out, err = client.communicate(timeout=10)
    assert client.returncode == 130 and b"the stack is stopping" in err, err


def test_sigkill_of_hold_up_stops_its_calls(tmp_path: Path) -> None:
    # The unit's tree (its leaf, which holds each call's; its marker, which
    # each call carries) was registered with the daemon: the guardian stops it.
    up = Up(tmp_path, task_yaml(tmp_path, "nasty"))
    client = subprocess.Popen(
        [*HOLD, "call", "t", "ex"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        pids = wait_tree(tmp_path)
        up.proc.kill()
        up.proc.wait(10)
        assert_gone(pids, timeout=10)
    finally:
        client.wait(10)


def _call_over_socket(tmp_path: Path, then: bytes) -> dict[str, object]:
    """A call of ``slow`` (1 s) on the stack's own socket, ``then`` sent once it
    runs (as ``hold call`` sends its cancel); the final answer."""
    from hold_supervisor.jsonlines import LineBuffer

    path = tmp_path / "state" / "stacks" / "t" / "control.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        s.connect(str(path))
        s.sendall(b'{"op": "call", "unit": "slow", "args": {"s": 1}}\n')
        lines = LineBuffer()
        while True:
            data = s.recv(65536)
            assert data, "the stack closed the call's connection without a result"
            for msg in lines.feed(data):
                if msg.get("done"):
                    return msg
                if msg["ev"] == "running" or (msg["ev"] == "accepted" and not msg.get("beat")):
                    s.sendall(then)


def test_only_a_cancel_request_cancels_a_call(tmp_path: Path) -> None:
    """On a call's connection, ``{"op": "cancel"}`` cancels it; a line that merely
    contains the word goes by, and a line that is not JSON ends the call as a
    closed connection would."""
    up = Up(tmp_path, task_yaml(tmp_path, "sleep", name="slow"))
    try:
        decoy = _call_over_socket(tmp_path, b'{"op": "ps", "note": "cancel"}\n')
        assert decoy["ev"] == "result" and decoy["outcome"] == "exited", decoy
        asked = _call_over_socket(tmp_path, b'{"op": "cancel"}\n')
        assert asked["ev"] == "result" and asked["outcome"] == "cancelled", asked
        junk = _call_over_socket(tmp_path, b"cancel\n")
        assert junk["outcome"] == "cancelled", junk
        rec = records(tmp_path / "state" / "stacks" / "t" / "logs" / "slow.log")
        assert [r["outcome"] for r in rec] == ["exited", "cancelled", "cancelled"], rec
    finally:
        assert up.down() == 0
