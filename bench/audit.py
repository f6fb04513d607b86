"""The benchmark of issue 4: how long ``hold audit`` takes to find who holds a device node.

Run from the repository root, in the project's venv::

    .venv/bin/python -m bench.audit               # defaults: 2,000 processes, 9 rounds
    .venv/bin/python -m bench.audit --runs 3      # a quick look
    .venv/bin/python -m bench.audit --profile     # and where one scan's time goes

The scene: TOTAL processes (default 2,000) of which HOLDERS (200) hold one
"device" node -- a temporary regular file, declared as the node of a device
class in a temporary configuration. Half the holders keep a descriptor (a
``sleep`` that inherited it), half keep only a memory mapping (every
descriptor closed), so every tool is asked for the same coverage:
descriptors *and* mappings. The rest are ``sleep`` processes holding nothing.
All of them are forked by ``bench/progs/holders.py``; the machine's own
processes are scanned too, by every tool alike.

Timed, side by side and interleaved (each round runs every tool once, in a
rotating order, so a busy second on a shared machine lands on all of them):

* ``hold.holders.scan(targets)`` in this process (the scan alone; its default
  threads, and once more on one thread, to show what the threads add);
* ``hold audit --json`` end to end (interpreter start, configuration, scan,
  attribution, report);
* ``fuser -v NODE`` (psmisc; C);
* ``lsof NODE`` (C).

Every run of every tool is checked: it must report exactly the 200 holder
pids (and the scan: 100 by descriptor, 100 by mapping). A tool that misses
one fails the benchmark rather than being timed. Figures are medians (and
p90, nearest rank) over the rounds; ratios are of medians. Written with
every sample to ``bench/results/<name>.json`` (git-ignored).

Nothing outlives the benchmark: the crowd's parent ends when the pipe from
this process closes (even if this process is killed), and every child dies
with its parent (``PR_SET_PDEATHSIG``); the end is checked.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import re
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.run import RESULTS, loadavg, machine, median, ms, summary
from hold.devices import DeviceClass
from hold.holders import scan, targets

BENCH = Path(__file__).resolve().parent
CROWD = BENCH / "progs" / "holders.py"

# The aims, checked against the medians at the end.
AIM_VS_FUSER = 1.0  # scan faster than fuser
AIM_VS_LSOF = 5.0  # and at least 5x faster than lsof


# --------------------------------------------------------------------------
# The crowd.


class Crowd:
    """TOTAL processes, BY_FD + BY_MAP of which hold ``node``; ended by :meth:`end`."""

    def __init__(self, node: Path, total: int, by_fd: int, by_map: int) -> None:
        self.node = node
        ready_r, ready_w = os.pipe()
        life_r, self.lifeline = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, str(CROWD), str(node), str(total), str(by_fd), str(by_map),
             str(ready_w), str(life_r)],
            pass_fds=(ready_w, life_r), stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        os.close(ready_w)
        os.close(life_r)
        self.kinds: dict[str, set[int]] = {"fd": set(), "mmap": set(), "none": set()}
        try:
            self._read_ready(ready_r, total, timeout=120.0)
        finally:
            os.close(ready_r)

    def _read_ready(self, fd: int, total: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        buf = b""
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while (up := buf.count(b"\n")) < total:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"crowd not up after {timeout}s: {up}/{total}")
            if not poller.poll(left * 1000):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"crowd died while starting: {up}/{total} up")
            buf += chunk
        for line in buf.splitlines():
            kind, pid = line.split()
            self.kinds[kind.decode()].add(int(pid))
        # Until every sleeper has finished its exec, the scans would see a
        # crowd that is still changing (and still using the CPUs).
        sleepers = self.kinds["fd"] | self.kinds["none"]
        while any(_comm(p) != "sleep" for p in sleepers):
            if time.monotonic() > deadline:
                raise RuntimeError("crowd did not settle (some sleeper never exec'd)")
            time.sleep(0.05)

    @property
    def holders(self) -> set[int]:
        return self.kinds["fd"] | self.kinds["mmap"]

    def end(self) -> list[int]:
        """End everything; the pids still alive after that (empty, or a bug to report)."""
        os.close(self.lifeline)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        everyone = set().union(*self.kinds.values())
        deadline = time.monotonic() + 10
        left = [p for p in everyone if _alive_in_group(p, self.proc.pid)]
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = [p for p in left if _alive_in_group(p, self.proc.pid)]
        for p in left:  # never reached unless PDEATHSIG failed: say so, and still clean up
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        return left


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _alive_in_group(pid: int, pgid: int) -> bool:
    """Is ``pid`` still a live process of the crowd (its process group)?"""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except OSError:
        return False
    return fields[0] not in (b"Z", b"X") and int(fields[2]) == pgid


# --------------------------------------------------------------------------
# The tools, each returning the pids it found.


def by_scan(
    tgts: dict[Any, Any], expect_fd: set[int], expect_map: set[int], threads: int = 0
) -> set[int]:
    res = scan(tgts, threads=threads)
    fd = {h.pid for h in res.holders if h.how == "fd"}
    mm = {h.pid for h in res.holders if h.how == "mmap"}
    if fd != expect_fd or mm != expect_map:
        raise AssertionError(
            f"scan: by descriptor {len(fd)} (want {len(expect_fd)}), "
            f"by mapping {len(mm)} (want {len(expect_map)})"
        )
    return fd | mm


def run_tool(
    argv: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, env=env
    )


def by_hold_audit(argv: list[str], env: dict[str, str]) -> set[int]:
    res = run_tool(argv, env)
    if res.returncode != 1:  # every holder is stray: no lease
        raise AssertionError(f"hold audit exited {res.returncode}: {res.stderr[-2000:]}")
    return {r["pid"] for r in json.loads(res.stdout)["holders"]}


def by_fuser(node: Path) -> set[int]:
    # fuser writes the pids alone to stdout; the -v table (user, access,
    # command) goes to stderr, among "Cannot stat" complaints about processes
    # it may not inspect.
    res = run_tool(["fuser", "-v", str(node)])
    return {int(p) for p in res.stdout.split()}


def by_lsof(node: Path) -> set[int]:
    res = run_tool(["lsof", str(node)])
    out = set()
    for line in res.stdout.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 1 and fields[1].isdigit():
            out.add(int(fields[1]))
    return out


# --------------------------------------------------------------------------
# The run.


def profile_scan(tgts: dict[Any, Any]) -> dict[str, Any]:
    """Where one scan's time goes: cProfile of a single-threaded scan, and its CPU split.

    Single-threaded because cProfile sees only the calling thread. The
    built-in calls (``posix.read`` of /proc/PID/maps, ``posix.stat`` of each
    descriptor, ``posix.listdir`` of fd/) are system calls: their time is the
    kernel's work, which no rewrite of the Python around them removes.
    """
    prof = cProfile.Profile()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    prof.enable()
    res = scan(tgts, threads=1)
    prof.disable()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(10)
    return {
        "processes": res.processes,
        "user_s": r1.ru_utime - r0.ru_utime,
        "sys_s": r1.ru_stime - r0.ru_stime,
        "top": text.getvalue(),
    }


def bench(total: int, holders: int, runs: int, warmup: int, profile: bool) -> dict[str, Any]:
    notes: list[str] = []
    missing = [t for t in ("fuser", "lsof") if shutil.which(t) is None]
    if missing:
        raise SystemExit(
            f"bench.audit: {' and '.join(missing)} not installed (apt-get install -y psmisc lsof)"
        )
    hold = str(Path(sys.executable).parent / "hold")
    if not os.access(hold, os.X_OK):
        raise SystemExit(f"bench.audit: {hold}: no hold console script (pip install -e .)")
    work = Path(tempfile.mkdtemp(prefix="hold-bench-audit-"))
    crowd: Crowd | None = None
    try:
        node = work / "benchdev0"
        node.write_bytes(b"\0" * 4096)
        config = work / "config.yaml"
        config.write_text(f'devices:\n  benchdev:\n    nodes: ["{node}"]\n')
        env = dict(os.environ, HOLD_CONFIG=str(config), HOLD_STATE_DIR=str(work / "state"))
        by_fd = holders // 2
        print(f"starting {total} processes ({by_fd} hold the node by descriptor, "
              f"{holders - by_fd} by mapping only)", file=sys.stderr, flush=True)  # fmt: skip
        t0 = time.monotonic()
        crowd = c = Crowd(node, total, by_fd, holders - by_fd)
        setup_s = time.monotonic() - t0
        want = c.holders
        tgts = targets({"benchdev": DeviceClass("benchdev", (str(node),))})
        # (name, in this process?, the call)
        tools: list[tuple[str, bool, Callable[[], set[int]]]] = [
            ("hold.audit.scan()", True, lambda: by_scan(tgts, c.kinds["fd"], c.kinds["mmap"])),
            ("scan(threads=1)", True, lambda: by_scan(tgts, c.kinds["fd"], c.kinds["mmap"], 1)),
            ("hold audit --json", False, lambda: by_hold_audit([hold, "audit", "--json"], env)),
            ("fuser -v NODE", False, lambda: by_fuser(node)),
            ("lsof NODE", False, lambda: by_lsof(node)),
        ]
        wall: dict[str, list[float]] = {name: [] for name, _, _ in tools}
        cpu: dict[str, list[float]] = {name: [] for name, _, _ in tools}
        procs_seen: list[int] = []
        print(f"{warmup} warm-up + {runs} rounds", file=sys.stderr, end=" ", flush=True)
        for rnd in range(warmup + runs):
            k = rnd % len(tools)
            for name, inproc, fn in tools[k:] + tools[:k]:
                # CPU time (user + system) of whoever did the work: this
                # process (all its threads) for the scan, the waited-for
                # child for a command. Less moved by other load than wall time.
                who = resource.RUSAGE_SELF if inproc else resource.RUSAGE_CHILDREN
                r0, t = resource.getrusage(who), time.perf_counter()
                found = fn()
                dt, r1 = time.perf_counter() - t, resource.getrusage(who)
                if found != want:
                    raise AssertionError(
                        f"{name}: found {len(found & want)} of {len(want)} holders"
                        f" (+{len(found - want)} others)"
                    )
                if rnd >= warmup:
                    wall[name].append(dt)
                    cpu[name].append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
            procs_seen.append(sum(1 for n in os.listdir("/proc") if n.isdigit()))
            print(".", file=sys.stderr, end="", flush=True)
        print(file=sys.stderr)
        rows = []
        base, base_cpu = median(wall["hold.audit.scan()"]), median(cpu["hold.audit.scan()"])
        for name, _, _ in tools:
            s = summary(wall[name])
            rows.append({
                "tool": name, **s, "x_scan": s["median"] / base,
                "cpu": summary(cpu[name]), "cpu_x_scan": median(cpu[name]) / base_cpu,
                "samples": wall[name], "cpu_samples": cpu[name],
            })  # fmt: skip
        out = {"rows": rows, "setup_s": setup_s, "proc_entries": procs_seen, "notes": notes}
        if profile:
            out["profile"] = profile_scan(tgts)
        return out
    finally:
        if crowd is not None:
            left = crowd.end()
            if left:
                print(f"bench.audit: {len(left)} crowd processes outlived their parent "
                      f"(killed now): {left[:10]}", file=sys.stderr)  # fmt: skip
        shutil.rmtree(work, ignore_errors=True)


def table(result: dict[str, Any]) -> str:
    m, p = result["machine"], result["params"]
    rows = {r["tool"]: r for r in result["rows"]}
    out = [
        f"Machine: {m['nproc']} CPU ({m['cpu']}), Linux {m['kernel']}, Python {m['python']}; "
        f"load average {result['load_start']} at the start, {result['load_end']} at the end.",
        "",
        f"Who holds one node, among {p['procs']} benchmark processes of which {p['holders']} hold "
        f"it ({p['holders'] // 2} by descriptor, {p['holders'] - p['holders'] // 2} by mapping "
        f"only), {max(result['proc_entries'])} processes on the machine in all; "
        f"{p['runs']} interleaved rounds, ms:",
        "",
        "| tool | median | p90 | min | x scan() | CPU median | CPU x scan() |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        times = [ms(r["median"]), ms(r["p90"]), ms(r["min"]), f"{r['x_scan']:.2f}"]
        cells = [f"`{r['tool']}`", *times, ms(r["cpu"]["median"]), f"{r['cpu_x_scan']:.2f}"]
        out.append("| " + " | ".join(cells) + " |")
    out += [
        "",
        "Wall time from call to return; CPU: user + system time of the process that did the",
        "work (this one's threads for scan(), the command for the others).",
    ]
    fuser, lsof = rows["fuser -v NODE"]["median"], rows["lsof NODE"]["median"]
    scan_m, cli = rows["hold.audit.scan()"]["median"], rows["hold audit --json"]["median"]
    out += [
        "",
        f"Ratios of medians: fuser / scan() = {fuser / scan_m:.2f}, lsof / scan() = "
        f"{lsof / scan_m:.2f}; fuser / `hold audit --json` = {fuser / cli:.2f}, "
        f"lsof / `hold audit --json` = {lsof / cli:.2f}.",
        "",
    ]
    out += ["Aims (issue 4), on medians:", ""] + [f"- {a}" for a in result["aims"]] + [""]
    if "profile" in result:
        pr = result["profile"]
        out += [
            f"Profile of one single-threaded scan of {pr['processes']} processes: "
            f"{ms(pr['user_s'])} ms user, {ms(pr['sys_s'])} ms system CPU; top by own time:",
            "",
            "```",
            *[ln for ln in pr["top"].splitlines() if ln.strip()][-12:],
            "```",
            "",
        ]
    out += [f"Note: {n}" for n in result["notes"]]
    return "\n".join(out).rstrip() + "\n"


def aims(result: dict[str, Any]) -> list[str]:
    rows = {r["tool"]: r for r in result["rows"]}
    scan_m = rows["hold.audit.scan()"]["median"]
    vs_fuser = rows["fuser -v NODE"]["median"] / scan_m
    vs_lsof = rows["lsof NODE"]["median"] / scan_m
    return [
        f"scan() vs fuser: {vs_fuser:.2f}x faster; aim > {AIM_VS_FUSER:g}x: "
        + ("met" if vs_fuser > AIM_VS_FUSER else "MISSED"),
        f"scan() vs lsof: {vs_lsof:.2f}x faster; aim >= {AIM_VS_LSOF:g}x: "
        + ("met" if vs_lsof >= AIM_VS_LSOF else "MISSED"),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.audit", description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=2000, help="benchmark processes (2000)")
    p.add_argument("--holders", type=int, default=200, help="of which hold the node (200)")
    p.add_argument("--runs", type=int, default=9, help="timed rounds (9)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (1)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile one single-threaded scan (cProfile, user/sys split)",
    )
    p.add_argument("--name", help="results/<name>.json (default: audit-date-time-host)")
    a = p.parse_args(argv)
    if not 0 < a.holders <= a.procs or a.runs < 1 or a.warmup < 0:
        p.error("need 0 < --holders <= --procs, --runs >= 1, --warmup >= 0")

    result: dict[str, Any] = {
        "machine": machine(),
        "load_start": loadavg(),
        "params": vars(a),
        "tools": {
            "fuser": _version(["fuser", "-V"]),
            "lsof": _version(["lsof", "-v"]),
        },
    }
    t_begin = time.monotonic()
    result |= bench(a.procs, a.holders, a.runs, a.warmup, a.profile)
    result["load_end"] = loadavg()
    result["elapsed_s"] = time.monotonic() - t_begin
    result["aims"] = aims(result)
    result["notes"].append(
        "a shared machine: figures move with the load (see the load average); the ratios, "
        "taken within interleaved rounds, are steadier than the absolute times."
    )
    text = table(result)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    name = a.name or time.strftime("audit-%Y%m%d-%H%M%S-") + socket.gethostname()
    out = RESULTS / f"{name}.json"
    result["table"] = text
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written: {out.relative_to(BENCH.parent)}", file=sys.stderr)
    return 0


def _version(argv: list[str]) -> str:
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except OSError:
        return "?"
    text = (res.stdout + res.stderr).strip().splitlines()
    return next((ln.strip() for ln in text if re.search(r"\d+\.\d+", ln)), "?")


if __name__ == "__main__":
    sys.exit(main())
