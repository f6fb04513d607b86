"""``hold top``'s start-up, beside ``hold status`` (issue 25).

    .venv/bin/python -m bench.top                 # 30 rounds
    .venv/bin/python -m bench.top --runs 10 --rich /path/to/site-packages

One daemon (its own state directory, a class of two regular files) serves a
lease that holds npu:0; a plain process holds npu:1 (a stray). Run
round-robin with a rotating start, each from ``posix_spawn`` to its exit,
stdin on ``/dev/null``, stdout a pipe (so ``hold top`` prints its one plain
frame and exits):

* ``python3 -c pass`` (the floor of any Python command here);
* ``python3 -c "import curses"`` (what the live view adds);
* ``hold top --help`` and ``hold status`` (click, the configuration, the ask);
* ``hold top`` piped: its first frame (the daemon asked, the stacks listed,
  one stray scan of every process);
* with ``--rich DIR``: ``python3 -c "import rich.live, rich.table,
  rich.console"`` with ``DIR`` on the path, the library not chosen.

Byte code is cached in a temporary ``PYTHONPYCACHEPREFIX``, filled by a
warm-up round. Prints a markdown table: median and p90 in ms, runs, the machine.
And the import alone, timed inside a fresh interpreter each run (the least
of the runs beside the median: on a loaded machine the least is the cost,
the rest is waiting for a CPU): ``curses``, and ``rich``'s with ``--rich``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.run import loadavg, machine, median, percentile

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
HOLDER = ROOT / "tests" / "progs" / "node_holder.py"


def _time(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    res = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    took = time.perf_counter() - start
    if res.returncode != 0:
        raise SystemExit(f"{argv} exited {res.returncode}: {res.stderr.decode()[-500:]}")
    return took


def _wait_file(path: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and "holder" in path.read_text()):
        if time.monotonic() > deadline:
            raise SystemExit(f"{path}: no holder within {timeout}s")
        time.sleep(0.02)


IMPORT_TIMER = "import time; t = time.perf_counter(); import {mods}; print(time.perf_counter() - t)"


def _import_s(mods: str, env: dict[str, str]) -> float:
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_TIMER.format(mods=mods)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return float(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--rich", metavar="DIR", help="a directory where rich is installed")
    args = ap.parse_args(argv)
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="bench-top-") as tmp:
        work = Path(tmp)
        nodes = work / "nodes"
        nodes.mkdir()
        for i in (0, 1):
            (nodes / f"accel{i}").write_bytes(b"\0" * 4096)
        (work / "config.yaml").write_text(f'devices:\n  npu:\n    nodes: ["{nodes}/accel*"]\n')
        env = dict(os.environ)
        env.update(
            HOLD_STATE_DIR=str(work / "state"),
            HOLD_CONFIG=str(work / "config.yaml"),
            HOLD_LOCK_DIR=str(work / "locks"),
            PYTHONPYCACHEPREFIX=str(work / "pycache"),
        )
        (work / "locks").mkdir(mode=0o1777)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        holds_0 = [py, str(HOLDER), str(work / "lease.out"), "fd", str(nodes / "accel0")]
        lease = subprocess.Popen(
            [str(BIN / "npu-hold"), "-t", "10m", "--device", "npu:0", "--", *holds_0],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        stray = subprocess.Popen(
            [py, str(HOLDER), str(work / "stray.out"), "fd", str(nodes / "accel1")],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        try:
            _wait_file(work / "lease.out")
            _wait_file(work / "stray.out")
            cases = {
                "python3 -c pass": [py, "-c", "pass"],
                "python3 -c 'import curses'": [py, "-c", "import curses"],
                "hold top --help": [str(BIN / "hold"), "top", "--help"],
                "hold status": [str(BIN / "hold"), "status"],
                "hold top (piped: one frame)": [str(BIN / "hold"), "top"],
            }
            envs = dict.fromkeys(cases, env)
            if args.rich:
                name = "python3 -c 'import rich.live, rich.table, rich.console'"
                cases[name] = [py, "-c", "import rich.live, rich.table, rich.console"]
                envs[name] = {**env, "PYTHONPATH": args.rich}
            names = list(cases)
            for n in names:  # warm-up: byte code, page cache
                _time(cases[n], envs[n])
            samples: dict[str, list[float]] = {n: [] for n in names}
            imports = {"curses": env}
            if args.rich:
                imports["rich.live, rich.table, rich.console"] = envs[names[-1]]
            imported: dict[str, list[float]] = {m: [] for m in imports}
            for r in range(args.runs):
                for n in names[r % len(names) :] + names[: r % len(names)]:
                    samples[n].append(_time(cases[n], envs[n]))
                for m, m_env in imports.items():
                    imported[m].append(_import_s(m, m_env))
        finally:
            lease.send_signal(signal.SIGTERM)
            stray.kill()
            stray.wait()
            lease.wait(30)
            pid = (work / "state" / "daemon.lock").read_text().strip()
            if pid.isdigit():
                os.kill(int(pid), signal.SIGTERM)
    m = machine()
    where = f"{m['cpu']}, {m['nproc']} CPUs, Python {m['python']}"
    print(f"hold top start-up, {args.runs} runs each, round-robin; {where}; load {loadavg()}\n")
    base = median(samples[names[0]])
    print("| command | median ms | p90 ms | median - python3 -c pass |")
    print("| --- | ---: | ---: | ---: |")
    for n in names:
        med = median(samples[n])
        p90 = percentile(samples[n], 90)
        print(f"| `{n}` | {med * 1000:.1f} | {p90 * 1000:.1f} | {(med - base) * 1000:+.1f} |")
    print("\n| import, in-process | least ms | median ms |")
    print("| --- | ---: | ---: |")
    for m, got in imported.items():
        print(f"| `import {m}` | {min(got) * 1000:.1f} | {median(got) * 1000:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
