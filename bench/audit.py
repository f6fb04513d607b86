"""The benchmark of issues 4 and 21: how long ``hold audit`` takes to find who holds a
device node, beside ``fuser`` and ``lsof``, as the machine fills with processes.

Run from the repository root, in the project's venv::

    .venv/bin/python -m bench.audit                          # 2,000 extra processes, 9 rounds
    .venv/bin/python -m bench.audit --total 0,2000,10000     # one row per size (issue 21)
    .venv/bin/python -m bench.audit --runs 3                 # a quick look
    .venv/bin/python -m bench.audit --profile                # and where one scan's time goes

The scene, for each size N of ``--total``: N extra processes on the machine,
of which HOLDERS (200; all of them where N is smaller) hold one "device"
node -- a temporary regular file, declared as the node of a device class in
a temporary configuration. Half the holders keep a descriptor (a ``sleep``
that inherited it), half keep only a memory mapping (every descriptor
closed), so every tool is asked for the same coverage: descriptors *and*
mappings. The rest are ``sleep`` processes holding nothing. All of them are
forked by ``bench/progs/holders.py``; the machine's own processes are scanned
too, by every tool alike. At N = 0 nobody holds the node, and every tool
must say so. Before a crowd starts, the machine's limits (``pid_max``,
``threads-max``, ``ulimit -u``) are checked to leave room for it.

Timed, side by side and interleaved (each round runs every tool once, in a
rotating order, so a busy second on a shared machine lands on all of them):

* ``hold.devices.holders.scan(targets)`` in this process (the scan alone: in the
  calling thread, as the daemon runs it; and spread over forked workers, as
  ``hold audit`` runs it);
* ``hold audit --json`` end to end (interpreter start, configuration, scan,
  attribution, report);
* ``fuser -v NODE`` (psmisc; C);
* ``lsof NODE`` (C).

Every run of every tool is checked: it must report exactly the holder pids
(and the scan: half by descriptor, half by mapping). A tool that misses one
fails the benchmark rather than being timed. Figures are medians (and p90,
nearest rank) over the rounds; ratios are of medians. The summary gives, per
size, ``hold audit --json`` against ``fuser -v NODE`` (issue 21: at most
1.0 at 10,000). Written with every sample to ``bench/results/<name>.json``
(git-ignored).

Nothing outlives the benchmark: each size's crowd is ended before the next
starts; the crowd's parent ends when the pipe from this process closes (even
if this process is killed: SIGKILL, or SIGTERM, which ends Python without
its ``finally``), and every child dies with its parent
(``PR_SET_PDEATHSIG``); the end is checked.
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

from bench.run import RESULTS, loadavg, locks_in, machine, median, ms, summary
from hold.devices.classes import DeviceClass
from hold.devices.holders import scan, targets

BENCH = Path(__file__).resolve().parent
CROWD = BENCH / "progs" / "holders.py"

# The aim, checked against the medians at the end: hold audit no slower
# than fuser (issue 21, at 10,000 extra processes; shown at every size).
AIM_AUDIT_VS_FUSER = 1.0


# --------------------------------------------------------------------------
# The crowd.


class Crowd:
    """TOTAL processes, BY_FD + BY_MAP of which hold ``node``; ended by :meth:`end`."""

    def __init__(self, node: Path, total: int, by_fd: int, by_map: int) -> None:
        self.node = node
        ready_r, ready_w = os.pipe()
        life_r, self.lifeline = os.pipe()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(CROWD),
                str(node),
                str(total),
                str(by_fd),
                str(by_map),
                str(ready_w),
                str(life_r),
            ],
            pass_fds=(ready_w, life_r),
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
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
    tgts: dict[Any, Any],
    expect_fd: set[int],
    expect_map: set[int],
    forks: bool = False,
) -> set[int]:
    res = scan(tgts, forks=forks)
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


def by_hold_audit(argv: list[str], env: dict[str, str], stray: bool) -> set[int]:
    res = run_tool(argv, env)
    if res.returncode != (1 if stray else 0):  # every holder is stray: no lease
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
    res = scan(tgts)
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


def room_for(extra: int) -> str | None:
    """Why the machine cannot take ``extra`` more processes (None: it can, with room
    to spare for the tools and for everyone else's work)."""
    now = sum(1 for n in os.listdir("/proc") if n.isdigit())
    need = now + extra + 1000  # the tools, the test runs of others, a margin
    limits = {
        "kernel.pid_max": _int_file("/proc/sys/kernel/pid_max"),
        "kernel.threads-max": _int_file("/proc/sys/kernel/threads-max"),
    }
    soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if os.geteuid() != 0 and soft != resource.RLIM_INFINITY:  # root is not held to it
        limits["ulimit -u"] = soft
    short = [f"{k} is {v}" for k, v in limits.items() if v is not None and v < need]
    if short:
        return f"{extra} more processes on top of {now} need about {need}: " + ", ".join(short)
    return None


def _int_file(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def bench(total: int, holders: int, runs: int, warmup: int, profile: bool) -> dict[str, Any]:
    """One size: ``total`` extra processes, ``holders`` of them holding the node."""
    notes: list[str] = []
    hold = str(Path(sys.executable).parent / "hold")
    work = Path(tempfile.mkdtemp(prefix="hold-bench-audit-"))
    crowd: Crowd | None = None
    try:
        node = work / "benchdev0"
        node.write_bytes(b"\0" * 4096)
        config = work / "config.yaml"
        config.write_text(f'devices:\n  benchdev:\n    nodes: ["{node}"]\n')
        env = dict(
            os.environ,
            HOLD_CONFIG=str(config),
            HOLD_STATE_DIR=str(work / "state"),
            HOLD_LOCK_DIR=str(locks_in(work)),
        )
        if env.pop("PYTHONDONTWRITEBYTECODE", None):
            # As installed, hold's modules are compiled once (the warm-up round
            # writes the cache), not at every start.
            notes.append(
                "PYTHONDONTWRITEBYTECODE was set: not for `hold audit`, whose "
                "bytecode the warm-up round caches, as an installation has it"
            )
        by_fd = holders // 2
        print(
            f"{total} extra processes ({by_fd} hold the node by descriptor, "
            f"{holders - by_fd} by mapping only)",
            file=sys.stderr,
            flush=True,
        )
        t0 = time.monotonic()
        kinds: dict[str, set[int]] = {"fd": set(), "mmap": set(), "none": set()}
        if total:
            crowd = Crowd(node, total, by_fd, holders - by_fd)
            kinds = crowd.kinds
        setup_s = time.monotonic() - t0
        want = kinds["fd"] | kinds["mmap"]
        fd, mm = kinds["fd"], kinds["mmap"]
        tgts = targets({"benchdev": DeviceClass("benchdev", (str(node),))})
        audit = [hold, "audit", "--json"]
        # (name, in this process?, the call)
        tools: list[tuple[str, bool, Callable[[], set[int]]]] = [
            ("scan()", True, lambda: by_scan(tgts, fd, mm)),
            ("scan(forks=True)", True, lambda: by_scan(tgts, fd, mm, forks=True)),
            ("hold audit --json", False, lambda: by_hold_audit(audit, env, bool(want))),
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
                # process (all its threads) and its forked workers for the
                # scan, the waited-for child for a command. Less moved by
                # other load than wall time.
                r0 = _cpu(inproc)
                t = time.perf_counter()
                found = fn()
                dt, r1 = time.perf_counter() - t, _cpu(inproc)
                if found != want:
                    raise AssertionError(
                        f"{name}: found {len(found & want)} of {len(want)} holders"
                        f" (+{len(found - want)} others)"
                    )
                if rnd >= warmup:
                    wall[name].append(dt)
                    cpu[name].append(r1 - r0)
            procs_seen.append(sum(1 for n in os.listdir("/proc") if n.isdigit()))
            print(".", file=sys.stderr, end="", flush=True)
        print(file=sys.stderr)
        rows = []
        base, base_cpu = median(wall["scan()"]), median(cpu["scan()"])
        for name, _, _ in tools:
            s = summary(wall[name])
            rows.append(
                {
                    "tool": name,
                    **s,
                    "x_scan": s["median"] / base,
                    "cpu": summary(cpu[name]),
                    "cpu_x_scan": median(cpu[name]) / max(base_cpu, 1e-9),
                    "samples": wall[name],
                    "cpu_samples": cpu[name],
                }
            )
        out = {
            "total": total,
            "holders": len(want),
            "rows": rows,
            "setup_s": setup_s,
            "proc_entries": procs_seen,
            "notes": notes,
            "load": loadavg(),
        }
        if profile:
            out["profile"] = profile_scan(tgts)
        return out
    finally:
        if crowd is not None:
            left = crowd.end()
            if left:
                print(
                    f"bench.audit: {len(left)} crowd processes outlived their parent "
                    f"(killed now): {left[:10]}",
                    file=sys.stderr,
                )
        shutil.rmtree(work, ignore_errors=True)


def _cpu(inproc: bool) -> float:
    # In this process: its threads, and the scan's forked workers (reaped: children).
    who = [resource.RUSAGE_SELF] if inproc else []
    who.append(resource.RUSAGE_CHILDREN)
    return sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, who))


def audit_vs_fuser(size: dict[str, Any]) -> float:
    rows = {r["tool"]: r for r in size["rows"]}
    return float(rows["hold audit --json"]["median"] / rows["fuser -v NODE"]["median"])


def table(result: dict[str, Any]) -> str:
    m, p = result["machine"], result["params"]
    out = [
        f"Machine: {m['host']}: {m['nproc']} CPU ({m['cpu']}), Linux {m['kernel']}, "
        f"Python {m['python']}; kernel.pid_max {m['pid_max']}, kernel.threads-max "
        f"{m['threads_max']}, ulimit -u {m['ulimit_u']}; load average {result['load_start']} "
        f"at the start, {result['load_end']} at the end.",
        "",
        f"`hold audit --json` against `fuser -v NODE`, by extra processes on the machine "
        f"(of which up to {p['holders']} hold the node, half by descriptor, half by mapping "
        f"only); {p['runs']} interleaved rounds each, medians in ms:",
        "",
        "| extra processes | on the machine | holders | `hold audit --json` | `fuser -v NODE` "
        "| audit / fuser | `lsof NODE` | `scan(forks=True)` | `scan()` |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for size in result["sizes"]:
        rows = {r["tool"]: r for r in size["rows"]}
        cells = [
            f"{size['total']:,}",
            f"{max(size['proc_entries']):,}",
            str(size["holders"]),
            ms(rows["hold audit --json"]["median"]),
            ms(rows["fuser -v NODE"]["median"]),
            f"{audit_vs_fuser(size):.2f}",
            ms(rows["lsof NODE"]["median"]),
            ms(rows["scan(forks=True)"]["median"]),
            ms(rows["scan()"]["median"]),
        ]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "Aims, on medians:", ""] + [f"- {a}" for a in result["aims"]] + [""]
    for size in result["sizes"]:
        out += [
            f"At {size['total']:,} extra processes ({max(size['proc_entries']):,} on the "
            f"machine; load average {size['load']} after), ms:",
            "",
            "| tool | median | p90 | min | x scan() | CPU median | CPU x scan() |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in size["rows"]:
            times = [ms(r["median"]), ms(r["p90"]), ms(r["min"]), f"{r['x_scan']:.2f}"]
            cells = [f"`{r['tool']}`", *times, ms(r["cpu"]["median"]), f"{r['cpu_x_scan']:.2f}"]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
        if "profile" in size:
            pr = size["profile"]
            out += [
                f"Profile of one single-threaded scan of {pr['processes']} processes: "
                f"{ms(pr['user_s'])} ms user, {ms(pr['sys_s'])} ms system CPU; top by own time:",
                "",
                "```",
                *[ln for ln in pr["top"].splitlines() if ln.strip()][-12:],
                "```",
                "",
            ]
    out += [
        "Wall time from call to return; CPU: user + system time of the processes that did",
        "the work (this one's threads and forked workers for scan(), the command for the",
        "others). `scan()` is the daemon's (one thread); `hold audit` runs `scan(forks=True)`.",
        "",
    ]
    out += [f"Note: {n}" for n in result["notes"]]
    return "\n".join(out).rstrip() + "\n"


def aims(result: dict[str, Any]) -> list[str]:
    out = []
    for size in result["sizes"]:
        ratio = audit_vs_fuser(size)
        out.append(
            f"at {size['total']:,} extra: `hold audit --json` / `fuser -v NODE` = {ratio:.2f}; "
            f"aim <= {AIM_AUDIT_VS_FUSER:g} (issue 21, at 10,000): "
            + ("met" if ratio <= AIM_AUDIT_VS_FUSER else "MISSED")
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.audit", description=__doc__.splitlines()[0])
    p.add_argument(
        "--total",
        "--procs",
        default="2000",
        metavar="N[,N...]",
        help="extra processes on the machine, one size or several (0,2000,10000); 2000",
    )
    p.add_argument("--holders", type=int, default=200, help="of which hold the node (200)")
    p.add_argument("--runs", type=int, default=9, help="timed rounds per size (9)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (1)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile one single-threaded scan (cProfile, user/sys split)",
    )
    p.add_argument("--name", help="results/<name>.json (default: audit-date-time-host)")
    a = p.parse_args(argv)
    try:
        sizes = [int(n.replace("_", "")) for n in a.total.split(",")]
    except ValueError:
        p.error(f"--total {a.total!r}: counts, comma-separated")
    if any(n < 0 for n in sizes) or a.holders < 1 or a.runs < 1 or a.warmup < 0:
        p.error("need --total >= 0, --holders >= 1, --runs >= 1, --warmup >= 0")
    missing = [t for t in ("fuser", "lsof") if shutil.which(t) is None]
    if missing:
        p.exit(
            2,
            f"bench.audit: {' and '.join(missing)} not installed "
            "(apt-get install -y psmisc lsof)\n",
        )
    if not os.access(Path(sys.executable).parent / "hold", os.X_OK):
        p.exit(2, "bench.audit: no hold console script beside this Python (pip install -e .)\n")
    for n in sizes:
        why = room_for(n)
        if why is not None:
            p.exit(2, f"bench.audit: {why}\n")

    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    result: dict[str, Any] = {
        "machine": machine()
        | {
            "pid_max": _int_file("/proc/sys/kernel/pid_max"),
            "threads_max": _int_file("/proc/sys/kernel/threads-max"),
            "ulimit_u": "unlimited" if nproc == resource.RLIM_INFINITY else nproc,
        },
        "load_start": loadavg(),
        "params": vars(a) | {"sizes": sizes},
        "tools": {
            "fuser": _version(["fuser", "-V"]),
            "lsof": _version(["lsof", "-v"]),
        },
    }
    t_begin = time.monotonic()
    result["sizes"] = [bench(n, min(a.holders, n), a.runs, a.warmup, a.profile) for n in sizes]
    result["load_end"] = loadavg()
    result["elapsed_s"] = time.monotonic() - t_begin
    result["aims"] = aims(result)
    notes = dict.fromkeys(n for size in result["sizes"] for n in size["notes"])  # each once
    result["notes"] = [
        *notes,
        "a shared machine: figures move with the load (see the load average); the ratios, "
        "taken within interleaved rounds, are steadier than the absolute times.",
    ]
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
