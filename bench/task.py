"""The benchmark of issue 6: what a call of a task unit costs beyond the spawn itself.

    .venv/bin/python -m bench.task                    # defaults: 200 rounds, hold call every 5th
    .venv/bin/python -m bench.task --runs 40          # a quick look
    .venv/bin/python -m bench.task --procs 1000       # as on a shared machine

One task that exits at once (``/bin/true``, on a one-CPU lane), called in
interleaved rounds (so that noise on a shared machine spreads over all of them):

* **bare**: ``subprocess.run(["/bin/true"])`` -- the spawn and reap alone;
* **API, cgroup**: :meth:`hold_supervisor.task.task.TaskRunner.call` of a standalone
  runner with a cgroup leaf per call (needs a writable cgroup v2: root or a
  delegated subtree; skipped otherwise). Measured twice, because the kernel
  makes the answer depend on pacing: the spawn moves the child into its leaf
  (a write to ``cgroup.procs``), and that write waits for an RCU grace period
  (the cgroup threadgroup lock's slow path, typically ~10 ms) unless another
  move happened a few ms before. The runner therefore keeps a stub parked in
  the next call's leaf (see :mod:`hold_supervisor.task.task`). **after idle**: the
  call follows 25 ms of quiet (sporadic calls, as tool calls come; the
  parked stub is ready); **back-to-back**: it follows another call at once
  (bursts: the stub may still be being replaced, and the call then spawns
  cold, sharing the grace period with that move);
* **API, walk**: the same without cgroups (the call's tree is found by
  walking ``/proc``: each of the stop's looks lists /proc twice and reads what
  is not proven older than the call, :mod:`hold_supervisor.proc.cache`);
* **hold call**: the console script against a running ``hold up`` of the
  same unit (its default, cgroup auto), every ``--cli-every``-th round; with
  ``python3 -c pass`` beside it, the interpreter start any Python CLI pays.

``--procs N`` first starts N idle processes (``sleep``, in a session of their
own, killed at the end): a shared machine has many, and the walk's cost grows
with them (the process count is in the table's first line).

Every call is checked (exit 0, no survivors). Medians and p90 (nearest
rank), each with its overhead over the bare spawn's median and the ratio;
markdown table and JSON (every sample) in ``bench/results/``. The aim: the
API's overhead under 5 ms per call beyond the bare spawn.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.run import loadavg, machine, median, percentile
from hold_supervisor.parse import allowed_cpus
from hold_supervisor.proc.cgroup import CgroupUnavailable, Hierarchy
from hold_supervisor.stackfile.load import load
from hold_supervisor.task.task import TaskRunner

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
VENV_BIN = Path(sys.executable).parent
AIM_API_OVERHEAD_MS = 5.0
TASK = "/bin/true"
IDLE_S = 0.025


def stack_text(lane: int) -> str:
    return (
        "name: bench-task\nunits:\n  ex:\n    kind: task\n"
        f'    cmd: [{TASK}]\n    cpus: "{lane}"\n    timeout: 10s\n    concurrency: 1\n'
    )


def checked(runner: TaskRunner) -> Callable[[], None]:
    def one() -> None:
        r = runner.call({})
        if r.exit_code != 0 or r.survivors:
            raise RuntimeError(f"call failed: {r}")

    return one


def start_stack(path: Path, env: dict[str, str], err: Path) -> subprocess.Popen[bytes]:
    with open(err, "wb") as f:
        proc = subprocess.Popen(
            [str(VENV_BIN / "hold"), "up", str(path)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=f,
        )
    deadline = time.monotonic() + 30
    while b" is up " not in err.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"hold up did not come up: {err.read_text()}")
        time.sleep(0.05)
    return proc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.task", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=200, help="interleaved rounds (200)")
    ap.add_argument("--cli-every", type=int, default=5, help="hold call in every Nth round (5)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed rounds first (5)")
    ap.add_argument("--procs", type=int, default=0, help="idle processes to start first (0)")
    ap.add_argument("--name", default=time.strftime("task-%Y%m%d-%H%M%S"))
    a = ap.parse_args(argv)
    crowd = start_crowd(a.procs)
    try:
        return run(a)
    finally:
        stop_crowd(crowd)


def start_crowd(n: int) -> subprocess.Popen[bytes] | None:
    """``n`` idle processes (children of one shell, in its own session), or None."""
    if n <= 0:
        return None
    script = f"i=0; while [ $i -lt {n} ]; do sleep 3600 & i=$((i+1)); done; echo up; wait"
    proc = subprocess.Popen(
        ["/bin/sh", "-c", script], stdout=subprocess.PIPE, start_new_session=True
    )
    assert proc.stdout is not None
    proc.stdout.readline()  # "up": every sleep has been started
    return proc


def stop_crowd(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the shell's session: its group, all of it
    except ProcessLookupError:
        pass
    proc.wait()
    # Gone before the next run counts processes: the sleeps were re-parented to
    # us where we became a subreaper (walk mode; reaped here, by their group),
    # else to init.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            while os.waitpid(-proc.pid, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)


def run(a: argparse.Namespace) -> int:

    lane = max(allowed_cpus())
    result: dict[str, Any] = {
        "machine": machine(),
        "load_start": loadavg(),
        "params": vars(a) | {"lane": lane, "task": TASK},
        "processes": sum(1 for n in os.listdir("/proc") if n.isdigit()),
    }
    with tempfile.TemporaryDirectory(prefix="hold-bench-task-") as tmp:
        work = Path(tmp)
        path = work / "stack.yaml"
        path.write_text(stack_text(lane))
        (work / "config.yaml").write_text("cgroups: auto\n")
        env = dict(
            os.environ, HOLD_STATE_DIR=str(work / "state"), HOLD_CONFIG=str(work / "config.yaml")
        )
        spec = load(str(path)).units["ex"]
        runners: dict[str, TaskRunner] = {}
        try:
            Hierarchy.find()
            runners["cgroup"] = TaskRunner.standalone("ex", spec, cgroups="required")
        except CgroupUnavailable as e:
            result["notes"] = [f"no API cgroup case: {e}"]
        # Last: without a leaf this process becomes a child subreaper.
        runners["walk"] = TaskRunner.standalone("ex", spec, cgroups="off")
        up = start_stack(path, env, work / "up.err")
        try:
            cases: dict[str, Callable[[], None]] = {
                "bare subprocess.run": lambda: subprocess.run([TASK], check=True),
            }
            # (untimed preparation, timed call) per case
            prep: dict[str, Callable[[], None]] = {}
            if "cgroup" in runners:
                cg = checked(runners["cgroup"])
                cases["API, cgroup, after idle"] = cg
                prep["API, cgroup, after idle"] = lambda: time.sleep(IDLE_S)
                cases["API, cgroup, back-to-back"] = cg
                prep["API, cgroup, back-to-back"] = cg
            cases["API, walk"] = checked(runners["walk"])
            cli_cases: dict[str, Callable[[], None]] = {
                "hold call": lambda: subprocess.run(
                    [str(VENV_BIN / "hold"), "call", "bench-task", "ex"],
                    env=env,
                    check=True,
                    capture_output=True,
                ),
                "python3 -c pass": lambda: subprocess.run(
                    [sys.executable, "-c", "pass"], env=env, check=True
                ),
            }
            samples: dict[str, list[float]] = {k: [] for k in [*cases, *cli_cases]}
            print(f"{a.runs} rounds ...", file=sys.stderr, flush=True)
            for i in range(a.warmup + a.runs):
                names = list(cases)
                if i % a.cli_every == 0:
                    names += list(cli_cases)
                names = names[i % len(names) :] + names[: i % len(names)]
                for name in names:
                    fn = cases.get(name) or cli_cases[name]
                    if name in prep:
                        prep[name]()
                    t = time.perf_counter()
                    fn()
                    took = time.perf_counter() - t
                    if i >= a.warmup:
                        samples[name].append(took * 1000)
        finally:
            for r in runners.values():
                r.close()
            up.send_signal(signal.SIGTERM)
            up.wait(60)
            lock = work / "state" / "daemon.lock"
            if lock.exists():
                try:
                    os.kill(int(lock.read_text().strip()), signal.SIGTERM)
                except (ValueError, OSError):
                    pass
    result["samples_ms"] = {k: [round(x, 4) for x in v] for k, v in samples.items()}
    result["load_end"] = loadavg()
    text = table(result)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    result["table"] = text
    out = RESULTS / f"{a.name}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written: {out.relative_to(BENCH.parent)}", file=sys.stderr)
    return 0


def table(r: dict[str, Any]) -> str:
    m = r["machine"]
    s = r["samples_ms"]
    bare = median(s["bare subprocess.run"])
    py = median(s["python3 -c pass"])
    lines = [
        f"Machine: {m['cpu']}, {m['nproc']} CPUs, kernel {m['kernel']}, Python {m['python']}; "
        f"load {r['load_start']} -> {r['load_end']}; {r.get('processes', '?')} processes; "
        f"task {r['params']['task']} on CPU {r['params']['lane']}",
        "",
        "| per call | n | median ms | p90 ms | over bare ms | x bare |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, v in s.items():
        med = median(v)
        lines.append(
            f"| {name} | {len(v)} | {med:.2f} | {percentile(v, 90):.2f} | "
            f"{med - bare:+.2f} | {med / bare:.1f} |"
        )
    lines.append("")
    hc = median(s["hold call"])
    lines.append(f"`hold call` beyond `python3 -c pass`: {hc - py:+.1f} ms ({hc / py:.1f}x).")
    for name in ("API, cgroup, after idle", "API, cgroup, back-to-back", "API, walk"):
        if name in s:
            over = median(s[name]) - bare
            verdict = "met" if over < AIM_API_OVERHEAD_MS else "NOT met"
            lines.append(
                f"Aim (API < {AIM_API_OVERHEAD_MS:g} ms beyond the bare spawn), {name}: "
                f"{over:.2f} ms, {verdict}."
            )
    for note in r.get("notes", []):
        lines.append(f"Note: {note}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
