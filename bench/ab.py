"""Tickets before and after a change, interleaved in one run (issue 13).

    .venv/bin/python -m bench.ab --before 2ed38f4            # this tree against that commit
    .venv/bin/python -m bench.ab --before 2ed38f4 --runs 25 --rounds 3 --per-worker 15

A shared machine's speed drifts by more than most changes gain (this VM ran
1.7 times slower in the evening than in the morning), so a comparison is
only fair inside one run. ``--before`` is checked out with ``git archive``
into a temporary directory; both versions run through the same harness
(``python -c "from hold.cli.entry import ..."`` with ``PYTHONPATH`` at the
version, bytecode compiled first, a node-backed class, each version with its
own daemon and state directory):

* **start-up**: ``npu-hold -- true``, ``hold run -- true`` (no
  configuration file) and ``hold run -- true`` with ``cgroups: off`` (walk
  mode: the keeper's fork, issue 23), and a TAB (``hold st``, ``npu-hold
  --de``: the program run as the shell runs it to complete a word) beside
  ``python3 -c pass``, interleaved round-robin;
* **the loop**: ``--workers`` (20) shell loops of ``--per-worker`` (15)
  ``npu-hold -- true`` each, ``--rounds`` times per version, alternating;
  acquisitions per second, failed commands, and the daemon's handoff (from a
  lease's ``session_ending`` to the next ``granted``, from its log).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from bench.run import loadavg, locks_in, machine, median, percentile

ROOT = Path(__file__).resolve().parent.parent
NPU = "import sys; from {entry} import npu_main; sys.exit(npu_main())"
RUN = "import sys; from {entry} import main; sys.exit(main(sys.argv[1:]))"


def entry_module(code: Path) -> str:
    """Where a version keeps its console entry points (``hold/entry.py`` before issue 22)."""
    return "hold.cli.entry" if (code / "hold" / "cli" / "entry.py").exists() else "hold.entry"


def checkout(rev: str, into: Path) -> Path:
    """``hold`` and ``supervisor`` of ``rev`` (or this tree, for ``.``), compiled."""
    into.mkdir(parents=True)
    if rev == ".":
        for pkg in ("hold", "supervisor"):
            subprocess.run(["cp", "-r", str(ROOT / pkg), str(into)], check=True)
    else:
        tar = subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev, "hold", "supervisor"],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
    if (into / "hold" / "cli").is_dir():  # since issue 22: the folder imports as hold_supervisor
        (into / "supervisor").rename(into / "hold_supervisor")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="")
    compile_all = [sys.executable, "-m", "compileall", "-q", str(into)]
    subprocess.run(compile_all, check=True, stdout=subprocess.DEVNULL, env=env)
    return into


def version_env(code: Path, state: Path, config: bool, walk: bool = False) -> dict[str, str]:
    """Environment of one version: its code, its own state; ``config``: a file with a
    node-backed ``npu`` class; ``walk``: and ``cgroups: off`` (no leaf: the keeper)."""
    state.mkdir(parents=True, exist_ok=True)
    (state / "npudev0").touch()
    cfg = state / "cfg.yaml"
    walk_line = "cgroups: off\n" if walk else ""
    cfg.write_text(f'{walk_line}devices:\n  npu:\n    nodes: ["{state}/npudev*"]\n')
    env = dict(
        os.environ,
        PYTHONPATH=str(code),
        HOLD_STATE_DIR=str(state / "state"),
        HOLD_LOCK_DIR=str(locks_in(state)),
        PYTHONDONTWRITEBYTECODE="1",
    )
    if config:
        env["HOLD_CONFIG"] = str(cfg)
    else:
        env.pop("HOLD_CONFIG", None)
    return env


def start_ups(codes: dict[str, Path], work: Path, runs: int) -> dict[str, list[float]]:
    cmds: dict[str, tuple[list[str], dict[str, str] | None, Path | None]] = {
        "python3 -c pass": ([sys.executable, "-c", "pass"], None, None)
    }
    for name, code in codes.items():
        cmds[f"npu-hold -- true ({name})"] = (
            [sys.executable, "-c", NPU.format(entry=entry_module(code)), "--", "true"],
            version_env(code, work / f"s-{name}", True),
            code,
        )
        cmds[f"hold run -- true, walk ({name})"] = (
            [sys.executable, "-c", RUN.format(entry=entry_module(code)), "run", "--", "true"],
            version_env(code, work / f"w-{name}", True, walk=True),
            code,
        )
        cmds[f"hold run -- true ({name})"] = (
            [sys.executable, "-c", RUN.format(entry=entry_module(code)), "run", "--", "true"],
            version_env(code, work / f"r-{name}", False),
            code,
        )
        # A TAB: the shell runs the program with click's variables (issue 25).
        for what, var, run in (
            ("hold st", "_HOLD_COMPLETE", RUN),
            ("npu-hold --de", "_NPU_HOLD_COMPLETE", NPU),
        ):
            env = version_env(code, work / f"c-{name}", True)
            env.update({var: "bash_complete", "COMP_WORDS": what, "COMP_CWORD": "1"})
            cmds[f"TAB after {what} ({name})"] = (
                [sys.executable, "-c", run.format(entry=entry_module(code))],
                env,
                code,
            )
    for argv, env, cwd in cmds.values():  # each daemon started, each cache warm
        subprocess.run(argv, env=env, cwd=cwd, check=True, capture_output=True)
    times: dict[str, list[float]] = {k: [] for k in cmds}
    items = list(cmds.items())
    for r in range(runs):
        for k, (argv, env, cwd) in items[r % len(items) :] + items[: r % len(items)]:
            t0 = time.perf_counter()
            subprocess.run(argv, env=env, cwd=cwd, check=True, capture_output=True)
            times[k].append((time.perf_counter() - t0) * 1000)
    return times


def loop(code: Path, state: Path, workers: int, per: int) -> tuple[float, int, list[float]]:
    """(acquisitions per second, failed commands, handoff gaps in ms) of one loop."""
    env = version_env(code, state, True)
    npu = NPU.format(entry=entry_module(code))
    subprocess.run([sys.executable, "-c", npu, "--", "true"], env=env, cwd=code, check=True)
    script = (
        f'for i in $(seq {per}); do "{sys.executable}" -c "$NPU" -- true 2>/dev/null '
        "|| echo FAIL; done"
    )
    t0 = time.perf_counter()
    shell = ["bash", "-c", script]
    procs = [
        subprocess.Popen(shell, env=dict(env, NPU=npu), cwd=code, stdout=subprocess.PIPE, text=True)
        for _ in range(workers)
    ]
    failed = sum(p.communicate()[0].count("FAIL") for p in procs)
    wall = time.perf_counter() - t0
    return workers * per / wall, failed, handoffs(state / "state" / "daemon.log")


def handoffs(log: Path) -> list[float]:
    def at(e: dict[str, str]) -> float:
        return datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()

    events = [json.loads(line) for line in log.read_text().splitlines()]
    ends = sorted(at(e) for e in events if e.get("event") == "session_ending")
    grants = sorted(at(e) for e in events if e.get("event") == "granted")
    gaps = []
    for t in ends:
        i = bisect.bisect_right(grants, t)
        if i < len(grants):
            gaps.append((grants[i] - t) * 1000)
    return gaps


def stop_daemons(work: Path) -> None:
    """SIGTERM every daemon this run started (their pids are in their lock files)."""
    for lock in work.glob("*/state/daemon.lock"):
        text = lock.read_text().strip()
        if text.isdigit():
            try:
                os.kill(int(text), signal.SIGTERM)
            except ProcessLookupError:
                pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="a git revision (the baseline)")
    ap.add_argument("--after", default=".", help="a git revision, or . for this tree (default)")
    ap.add_argument("--runs", type=int, default=25)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=20)
    ap.add_argument("--per-worker", type=int, default=15)
    a = ap.parse_args()
    load0 = loadavg()
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as t:
        work = Path(t)
        codes = {
            "before": checkout(a.before, work / "before"),
            "after": checkout(a.after, work / "after"),
        }
        try:
            times = start_ups(codes, work, a.runs)
            loops: dict[str, list[tuple[float, int, list[float]]]] = {k: [] for k in codes}
            for r in range(a.rounds):
                for name, code in codes.items():
                    loops[name].append(loop(code, work / f"l-{name}-{r}", a.workers, a.per_worker))
        finally:
            stop_daemons(work)
    print(
        f"Machine: {machine()}; load {load0} -> {loadavg()}; before = {a.before}, "
        f"after = {a.after}\n"
    )
    base = median(times["python3 -c pass"])
    print(f"| start-up ({a.runs} interleaved runs) | median ms | x python3 -c pass |")
    print("| --- | ---: | ---: |")
    for k, v in times.items():
        print(f"| `{k}` | {median(v):.1f} | {median(v) / base:.2f} |")
    print(
        f"\n| loop, {a.workers} x {a.per_worker}, {a.rounds} rounds | acquisitions/s "
        "(median) | failed | handoff p50 / p99 ms |\n| --- | ---: | ---: | --- |"
    )
    for name, rows in loops.items():
        gaps = sorted(g for _, _, gs in rows for g in gs)
        print(
            f"| {name} | {median([r for r, _, _ in rows]):.1f} | "
            f"{sum(f for _, f, _ in rows)} | {median(gaps):.2f} / {percentile(gaps, 99):.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
