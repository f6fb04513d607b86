"""The benchmark of issue 25's resource figures: what one reading of a tree costs.

    .venv/bin/python -m bench.figures                 # defaults: 200 rounds, 40 starts
    .venv/bin/python -m bench.figures --procs 1000    # as on a shared machine

Interleaved rounds, so that noise on a shared machine spreads over all of them:

* **import**: ``python -c "import psutil"`` against ``python -c pass`` (wall
  time from spawn to exit; the difference is what psutil adds to a start-up);
* **a 10-process tree, through psutil**: :func:`hold_supervisor.proc.usage.of_pids`
  (CPU times, children's included, and RSS of each) against **by hand**: the
  same figures from ``/proc/PID/stat`` and ``/proc/PID/statm``, parsed here;
* **its cgroup leaf**: :func:`~hold_supervisor.proc.usage.of_leaf` (``cpu.stat``,
  and ``memory.current``/``pids.current`` where the controllers are, else
  psutil over the leaf's processes); skipped without a writable cgroup v2;
* **the walk**: what the daemon does for a lease without a leaf: the tree's
  members found through a :class:`~hold_supervisor.proc.cache.ProcCache`
  (:meth:`hold_supervisor.proc.tree.Tree.members`), then ``of_pids``.

``--procs N`` first starts N idle processes (killed at the end): the walk
grows with them. Medians and p90; markdown and JSON (every sample) in
``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.run import loadavg, machine, median, percentile
from hold_supervisor.environ import MARKER
from hold_supervisor.proc import usage
from hold_supervisor.proc.cache import ProcCache
from hold_supervisor.proc.cgroup import CgroupUnavailable, Hierarchy, Leaf
from hold_supervisor.proc.identity import ProcessId, read_stat
from hold_supervisor.proc.tree import Tree

BENCH = Path(__file__).resolve().parent
TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
TREE = (
    "import os, time\nfor _ in range(9):\n    if os.fork() == 0:\n        break\ntime.sleep(600)\n"
)


def by_hand(pids: list[int]) -> tuple[float, int, int]:
    """CPU seconds (children's included), resident bytes and count, from /proc directly."""
    cpu, rss, count = 0.0, 0, 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
            with open(f"/proc/{pid}/statm", "rb") as f:
                pages = int(f.read().split()[1])
        except OSError:
            continue
        # utime, stime, cutime, cstime: fields 14-17, f[11:15] after the comm.
        cpu += sum(int(x) for x in fields[11:15]) / TICK
        rss += pages * PAGE
        count += 1
    return cpu, rss, count


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def spawn_ms(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, stdin=subprocess.DEVNULL)
    return (time.perf_counter() - t0) * 1000


def start_tree(leaf: Leaf | None, tree_id: str) -> tuple[subprocess.Popen[bytes], list[int]]:
    pre = (lambda: leaf.move(os.getpid())) if leaf is not None else None
    env = {**os.environ, MARKER: tree_id}
    p = subprocess.Popen(
        [sys.executable, "-c", TREE], preexec_fn=pre, start_new_session=True, env=env
    )
    deadline = time.monotonic() + 10
    while True:
        found = Tree(tree_id, ProcessId(p.pid, read_stat(p.pid).starttime), p.pid, p.pid).members()
        if len(found) == 10:
            return p, sorted(found)
        if time.monotonic() > deadline:
            raise SystemExit(f"the 10-process tree did not start: {len(found)} found")
        time.sleep(0.01)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--runs", type=int, default=200, help="readings of each kind")
    ap.add_argument("--starts", type=int, default=40, help="interpreter starts of each kind")
    ap.add_argument("--procs", type=int, default=0, help="idle processes started first")
    ap.add_argument("--name", help="the results file's name")
    args = ap.parse_args()

    idle = [subprocess.Popen(["sleep", "3600"], start_new_session=True) for _ in range(args.procs)]
    trees: list[subprocess.Popen[bytes]] = []
    leaf: Leaf | None = None
    hier: Hierarchy | None = None
    samples: dict[str, list[float]] = {}
    try:
        walk_proc, walk_pids = start_tree(None, "benchwalk")
        trees.append(walk_proc)
        try:
            hier = Hierarchy.find()
            leaf = hier.create(f"bench-figures-{os.getpid()}")
            leaf_proc, _ = start_tree(leaf, "benchleaf")
            trees.append(leaf_proc)
        except CgroupUnavailable as e:
            print(f"no cgroup leaf here ({e}): its row is left out", file=sys.stderr)
        walk_tree = Tree(
            "benchwalk",
            ProcessId(walk_proc.pid, read_stat(walk_proc.pid).starttime),
            walk_proc.pid,
            walk_proc.pid,
            cache=ProcCache(),
        )
        kinds: dict[str, Callable[[], float]] = {
            "10-process tree, psutil (of_pids)": lambda: timed(lambda: usage.of_pids(walk_pids)),
            "10-process tree, /proc by hand": lambda: timed(lambda: by_hand(walk_pids)),
            "walk-mode lease: members (cached walk) + of_pids": lambda: timed(
                lambda: usage.of_pids(walk_tree.members())
            ),
        }
        if leaf is not None:
            kinds["cgroup leaf (of_leaf)"] = lambda: timed(lambda: usage.of_leaf(leaf.path))
        starts: dict[str, Callable[[], float]] = {
            "python -c pass": lambda: spawn_ms([sys.executable, "-c", "pass"]),
            "python -c 'import psutil'": lambda: spawn_ms([sys.executable, "-c", "import psutil"]),
        }
        for run in range(args.runs):
            order = list(kinds)
            order = order[run % len(order) :] + order[: run % len(order)]
            for k in order:
                samples.setdefault(k, []).append(kinds[k]())
        for run in range(args.starts + 2):
            for k in list(starts)[run % 2 :] + list(starts)[: run % 2]:
                ms = starts[k]()
                if run >= 2:  # two warm-up rounds
                    samples.setdefault(k, []).append(ms)
    finally:
        for p in [*trees, *idle]:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        if leaf is not None and hier is not None:
            leaf.kill()
            leaf.wait_empty(5)
            leaf.remove(hier.base)

    procs = len([n for n in os.listdir("/proc") if n.isdigit()])
    lines = [
        f"{procs + args.procs} processes on the machine; {args.runs} readings, "
        f"{args.starts} starts of each",
        "",
        "| reading | median | p90 |",
        "| --- | ---: | ---: |",
    ]
    for k, v in samples.items():
        lines.append(f"| {k} | {median(v):.3f} ms | {percentile(v, 90):.3f} ms |")
    cost = median(samples["python -c 'import psutil'"]) - median(samples["python -c pass"])
    lines.append(f"\npsutil's import adds {cost:.1f} ms to a start-up (difference of medians)")
    print("\n".join(lines))
    out = BENCH / "results" / f"{args.name or time.strftime('%Y%m%d-%H%M%S')}-figures.json"
    out.parent.mkdir(exist_ok=True)
    doc: dict[str, Any] = {
        "machine": machine(),
        "load": loadavg(),
        "args": vars(args),
        "samples": samples,
    }
    out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
