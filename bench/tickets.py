"""The benchmark of issues 3, 13 and 21: what a ticket costs, how fast it changes
hands, what an idle daemon costs, and how all that grows with the machine.

    .venv/bin/python -m bench.tickets                # defaults (about 3 minutes)
    .venv/bin/python -m bench.tickets --only start,loop --tmp /dev/shm   # issue 13's
    .venv/bin/python -m bench.tickets --only start,loop --crowd 0,2000,10000   # issue 21's

Four parts, side by side in one run against the baselines the issues name:

1. **Uncontended start-up**: ``npu-hold -- true`` with a node-backed class
   (a configuration file, its daemon already running) and ``hold run --
   true`` (no configuration file) against ``flock FILE true``,
   ``python3 -c pass`` and ``python3 -c "import click"``, interleaved
   round-robin so noise spreads over all of them.
4. **The loop** (issue 13): ``--workers`` shell loops (20) each running
   ``npu-hold -- true`` ``--per-worker`` times (50) on one node-backed
   device, beside the same loops of ``flock -x LOCK true``: acquisitions per
   second, failed commands (must be none), and the daemon's own handoff from
   its log: from a lease's ``session_ending`` (its holder said ``end``) to
   the next ``granted``; the CPU time of one acquisition (clients and daemon
   together: on a small machine the loop is bound by it); and what proved the
   device empty for each grant (``count``: the kernel's count of its open
   files; ``scan``: a scan of every process, with why the count could not
   answer). ``--tmp``: where the state goes (a daemon's is on tmpfs: /run,
   $XDG_RUNTIME_DIR).

``--crowd 0,2000,10000``: start-up and the loop run once per size, with that
many idle processes added to the machine (forked children that ``pause``,
killed by the kernel with their parent), and each figure at the largest size
is given against the same at the smallest: a ticket must cost the same on a
busy machine.

``--mode cgroup,walk`` (issue 45): and once per way of holding a tree -- a
cgroup leaf where one can be made, or the walk (``cgroups: off``) -- each
with a daemon and configuration of its own; every mode's figures at the
most processes are given against its own at the fewest.

``--namespaces 0,50`` (issue 45): and once per number of "containers" beside
them: mount namespaces of their own, each with a tmpfs on its ``/dev`` and a
node of the loop's device made there by ``mknod`` (what a container runtime
running as root makes for ``--device``), idle. ``--node char`` (the default
as root): the loop's device is ``/dev/full`` (1:7) through a node in the
benchmark's directory, so the daemon watches its other nodes in every mount
namespace; ``--node file``: a regular file (no other node can exist).
2. **Handoff latency** with 20 contending clients: the time from one holder's
   release to the next holder's grant, measured inside the clients with
   CLOCK_MONOTONIC (one clock for the whole machine). Three ways of taking
   turns: the daemon (a client connects, asks, is granted, releases by
   closing), ``flock(2)`` on one file (what ``flock(1)`` does), and the
   ``filelock`` package. The daemon is measured twice: a bare lease, and a
   lease with a registered tree, as ``npu-hold`` registers one (the release
   then includes the survivor check over that tree).
3. **Idle daemon**: RSS, and CPU time over ``--idle`` seconds (default 60)
   with 5 leases held: an idle daemon must not wake up periodically.

Medians, p90/p99 by nearest rank, ratios; markdown table and JSON in
``bench/results/``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.run import loadavg, locks_in, machine, median, percentile

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
VENV_BIN = Path(sys.executable).parent

# A contender: waits at a barrier file, takes its turn, records
# (granted, released) on stdout. Run as its own process, like a real client.
CONTENDER = r"""
import os, sys, time, json
mode, path, barrier, tree = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
while not os.path.exists(barrier):
    time.sleep(0.001)
if mode == "daemon":
    from hold.client.connection import Client
    from hold.statedir import open_state_dir
    c = Client.connect(open_state_dir())
    c.open_session()
    msg = {"op": "acquire", "cls": "npu", "count": 1, "label": "bench", "ttl": 600,
           "grace": 1, "wait": True}
    if tree:
        # As npu-hold registers one: with a cgroup leaf where one can be made.
        from hold_supervisor.proc.cgroup import CgroupUnavailable, Hierarchy
        tree_id = os.urandom(6).hex()
        try:
            leaf = Hierarchy.find().create("hold-" + tree_id).path
        except CgroupUnavailable:
            leaf = None
        msg["tree"] = {"tree_id": tree_id, "leaf": leaf}
    c.send(msg)
    while True:
        m = c.recv(time.monotonic() + 120)
        if m is None or m.get("ev") == "granted":
            break
    granted = time.monotonic()
    released = time.monotonic()
    c.close()
elif mode == "flock":
    import fcntl
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    granted = time.monotonic()
    released = time.monotonic()
    fcntl.flock(fd, fcntl.LOCK_UN)
else:
    import filelock
    lock = filelock.FileLock(path)
    lock.acquire()
    granted = time.monotonic()
    released = time.monotonic()
    lock.release()
print(json.dumps([granted, released]))
"""


def handoffs(
    mode: str, clients: int, workdir: Path, env: dict[str, str], tree: bool
) -> list[float]:
    """Release-to-next-grant gaps (seconds) for ``clients`` contenders taking turns."""
    barrier = workdir / f"go-{mode}-{tree}"
    lockfile = workdir / f"lock-{mode}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                CONTENDER,
                mode,
                str(lockfile),
                str(barrier),
                "1" if tree else "0",
            ],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        for _ in range(clients)
    ]
    # Everyone imported and waiting at the barrier before the race starts.
    time.sleep(2.0 if mode == "daemon" else 1.0)
    barrier.touch()
    turns = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        turns.append(json.loads(out))
    turns.sort()
    # Only the gaps where someone was waiting: all contenders are queued once
    # the first holds, so every later grant follows a release.
    return [nxt[0] - prev[1] for prev, nxt in itertools.pairwise(turns)]


def start_times(
    runs: int, workdir: Path, env: dict[str, str], node_env: dict[str, str]
) -> dict[str, list[float]]:
    """Wall times of each command; ``node_env`` has a configuration with a node-backed npu."""
    lockfile = workdir / "flock-file"
    lockfile.touch()
    commands = {
        "npu-hold -- true (node-backed class)": (
            [str(VENV_BIN / "npu-hold"), "--", "true"],
            node_env,
        ),
        "hold run -- true (no config file)": ([str(VENV_BIN / "hold"), "run", "--", "true"], env),
        "flock FILE true": (["flock", str(lockfile), "true"], env),
        'python3 -c "import click"': ([sys.executable, "-c", "import click"], env),
        "python3 -c pass": ([sys.executable, "-c", "pass"], env),
    }
    out: dict[str, list[float]] = {k: [] for k in commands}
    for _ in range(2):  # warm caches, .pyc files and the daemons
        for argv, e in commands.values():
            subprocess.run(argv, env=e, check=True, capture_output=True, stdin=subprocess.DEVNULL)
    for i in range(runs):
        names = list(commands)
        names = names[i % len(names) :] + names[: i % len(names)]
        for name in names:
            argv, e = commands[name]
            t = time.perf_counter()
            subprocess.run(argv, env=e, check=True, capture_output=True, stdin=subprocess.DEVNULL)
            out[name].append(time.perf_counter() - t)
    return out


# One worker of the loop: runs its command N times, prints one line per failure.
WORKER = 'i=0;while [ $i -lt "$0" ]; do "$@" </dev/null >/dev/null 2>&1||echo x$?; i=$((i+1)); done'


def loop(argv: list[str], workers: int, per: int, env: dict[str, str]) -> dict[str, Any]:
    """``workers`` shell loops of ``per`` runs of ``argv`` at once: rate and failures."""
    t = time.perf_counter()
    procs = [
        subprocess.Popen(
            ["sh", "-c", WORKER, str(per), *argv], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(workers)
    ]
    fails = [line for p in procs for line in p.communicate()[0].splitlines()]
    wall = time.perf_counter() - t
    return {
        "wall_s": round(wall, 3),
        "runs": workers * per,
        "failed": len(fails),
        "failures": fails[:10],
        "per_s": round(workers * per / wall, 1),
    }


def log_events(log: Path, since: float) -> Iterator[tuple[float, dict[str, Any]]]:
    """The daemon's log events from ``since`` on (wall clock), with their time."""
    import datetime

    for line in log.read_text().splitlines():
        if not line.startswith("{"):
            continue  # the daemon's stderr shares its log (a message before it served)
        ev = json.loads(line)
        ts = datetime.datetime.fromisoformat(ev["timestamp"].replace("Z", "+00:00")).timestamp()
        if ts >= since:
            yield ts, ev


def daemon_handoffs(log: Path, since: float) -> list[float]:
    """From the daemon's log (events after ``since``, wall clock): each lease's
    ``session_ending`` to the next ``granted`` of its class, in ms."""
    gaps: list[float] = []
    ending: dict[str, float] = {}  # class -> when its last lease began to end
    cls_of: dict[str, str] = {}  # session -> class
    for ts, ev in log_events(log, since):
        if ev["event"] == "granted":
            cls = "npu"  # the loop's one class
            cls_of[ev["session"]] = cls
            if cls in ending:
                gaps.append((ts - ending.pop(cls)) * 1000)
        elif ev["event"] == "session_ending" and ev["session"] in cls_of:
            ending[cls_of[ev["session"]]] = ts
    return gaps


def loops(workers: int, per: int, workdir: Path, node_env: dict[str, str]) -> dict[str, Any]:
    """The loop of ``npu-hold -- true`` and of ``flock -x LOCK true``, one after the other.

    Also: the CPU time one acquisition costs, clients and daemon together
    (the loop's reaped descendants, and the daemon's own ticks), and what
    proved the device empty for each grant (the daemon's log: ``count``,
    the kernel's count; ``scan``, a scan of every process; ``handoff``, the
    scan at the previous lease's end), with why a scan was needed.
    """
    lockfile = workdir / "loop-lock"
    lockfile.touch()
    state = Path(node_env["HOLD_STATE_DIR"])
    # The daemon runs before the loop starts, so its CPU is read on both sides.
    subprocess.run(
        [str(VENV_BIN / "npu-hold"), "--", "true"], env=node_env, check=True, capture_output=True
    )
    daemon = int((state / "daemon.lock").read_text())
    since = time.time()
    cpu0, d0 = _children_cpu(), _cpu(daemon)
    hold = loop([str(VENV_BIN / "npu-hold"), "--", "true"], workers, per, node_env)
    cpu1, d1 = _children_cpu(), _cpu(daemon)
    hold["cpu_ms_per_acquisition"] = round((cpu1 - cpu0 + d1 - d0) * 1000 / hold["runs"], 2)
    hold["daemon_cpu_ms_per_acquisition"] = round((d1 - d0) * 1000 / hold["runs"], 2)
    cpu0 = _children_cpu()
    flock = loop(["flock", "-x", str(lockfile), "true"], workers, per, node_env)
    flock["cpu_ms_per_acquisition"] = round((_children_cpu() - cpu0) * 1000 / flock["runs"], 2)
    out: dict[str, Any] = {"npu-hold -- true": hold, "flock -x LOCK true": flock}
    log = state / "daemon.log"
    out["daemon_handoff_ms"] = [round(g, 3) for g in daemon_handoffs(log, since)]
    out["checks"], out["scan_why"] = grant_checks(log, since)
    return out


def _children_cpu() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def grant_checks(log: Path, since: float) -> tuple[dict[str, int], dict[str, int]]:
    """(grants by what proved the device empty, scans by why the count could not answer)."""
    checks: dict[str, int] = {}
    why: dict[str, int] = {}
    for _ts, ev in log_events(log, since):
        if ev["event"] == "granted":
            checks[ev.get("check", "?")] = checks.get(ev.get("check", "?"), 0) + 1
        elif ev["event"] == "scan_needed":
            for reason in ev["why"].values():
                key = f"at {ev.get('at', 'grant')}, {reason}"
                why[key] = why.get(key, 0) + 1
    return checks, why


# N idle processes, as on a shared machine: forked children that pause, each
# killed by the kernel when this parent ends (PR_SET_PDEATHSIG); the parent
# ends when the benchmark closes its stdin (or dies).
CROWD = r"""
import ctypes, os, signal, sys
libc = ctypes.CDLL(None)
me = os.getpid()
for _ in range(int(sys.argv[1])):
    if os.fork() == 0:
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != me:
            os._exit(0)
        os.closerange(0, 3)
        while True:
            signal.pause()
print("ready", flush=True)
sys.stdin.read()
"""


def crowd(n: int) -> subprocess.Popen[str]:
    """``n`` idle processes until the returned parent's stdin is closed."""
    p = subprocess.Popen(
        [sys.executable, "-c", CROWD, str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    if p.stdout.readline().strip() != "ready":
        p.kill()
        raise RuntimeError("the crowd did not start")
    return p


CONTAINER = "mount -t tmpfs none /dev && mknod /dev/accel0 c 1 7 && exec sleep 100000"
UNSHARE = ["unshare", "-m", "--propagation", "private", "--kill-child"]


def containers(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` idle "containers" (see the module docstring); killed by :func:`_end_containers`."""
    out = []
    try:
        for _ in range(n):
            out.append(
                subprocess.Popen(
                    [
                        "unshare",
                        "-m",
                        "--propagation",
                        "private",
                        "--kill-child",
                        "sh",
                        "-c",
                        CONTAINER,
                    ]
                )
            )
    except BaseException:
        _end_containers(out)
        raise
    return out


def _end_containers(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def processes() -> int:
    return sum(1 for n in os.listdir("/proc") if n.isdigit())


def idle_daemon(seconds: float, workdir: Path, env: dict[str, str]) -> dict[str, Any]:
    """RSS and CPU of the daemon over ``seconds`` with 5 leases held (5 device class)."""
    for i in range(5):
        (workdir / f"dev{i}").touch()
    holders = [
        subprocess.Popen(
            [
                str(VENV_BIN / "hold"),
                "run",
                "--device",
                f"bench:{i}",
                "--",
                "sleep",
                str(int(seconds) + 30),
            ],
            env=env,
        )
        for i in range(5)
    ]
    try:
        state = Path(env["HOLD_STATE_DIR"])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            res = subprocess.run(
                [str(VENV_BIN / "hold"), "status", "--json"],
                env=env,
                capture_output=True,
                text=True,
            )
            if res.returncode == 0:
                devs = json.loads(res.stdout)["classes"]["bench"]["devices"]
                if all(d["holder"] for d in devs):
                    break
            time.sleep(0.2)
        pid = int((state / "daemon.lock").read_text())
        time.sleep(1.0)
        cpu0 = _cpu(pid)
        time.sleep(seconds)
        cpu1 = _cpu(pid)
        rss = _rss(pid)
    finally:
        for h in holders:
            h.terminate()
        for h in holders:
            h.wait(timeout=60)
    return {"seconds": seconds, "cpu_ms": round((cpu1 - cpu0) * 1000, 2), "rss_mb": rss}


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return -1.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30, help="start-up runs per command")
    ap.add_argument("--clients", type=int, default=20, help="contenders for the handoff")
    ap.add_argument("--rounds", type=int, default=3, help="handoff races per method")
    ap.add_argument("--idle", type=float, default=60.0, help="idle measurement, seconds")
    ap.add_argument("--workers", type=int, default=20, help="shell loops in the loop")
    ap.add_argument("--per-worker", type=int, default=50, help="runs per loop")
    ap.add_argument(
        "--crowd",
        default="0",
        help="idle processes added, comma-separated sizes (start and loop run at each)",
    )
    ap.add_argument(
        "--namespaces",
        default="0",
        help="idle mount namespaces with a node of the device added, comma-separated counts",
    )
    ap.add_argument(
        "--node",
        choices=("char", "file"),
        default="char" if os.geteuid() == 0 else "file",
        help="the loop's device: /dev/full through a node here (root), or a regular file",
    )
    ap.add_argument(
        "--mode",
        default="cgroup",
        help="how trees are held, comma-separated: cgroup (a leaf where one can be made), "
        "walk (cgroups: off)",
    )
    ap.add_argument("--only", default="start,handoff,idle,loop", help="parts, comma-separated")
    ap.add_argument("--tmp", help="where the state directories go (default: $TMPDIR)")
    ap.add_argument("--name", default=time.strftime("tickets-%Y%m%d-%H%M%S"))
    args = ap.parse_args(argv)
    parts = set(args.only.split(","))
    sizes = sorted({int(n) for n in args.crowd.split(",")})
    spaces = sorted({int(n) for n in args.namespaces.split(",")})
    modes = list(dict.fromkeys(args.mode.split(",")))
    for m in modes:
        if m not in MODES:
            ap.error(f"--mode {m!r}: one of {', '.join(MODES)}")

    result: dict[str, Any] = {
        "machine": machine(),
        "load_start": loadavg(),
        "params": vars(args),
        "processes": processes(),
        "sizes": [],
    }
    crowds: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory(prefix="hold-bench-", dir=args.tmp) as tmp:
        work = Path(tmp)
        config = work / "config.yaml"
        config.write_text(f'devices:\n  bench:\n    nodes: ["{work}/dev*"]\n')
        if args.node == "char":
            os.mknod(work / "npudev0", 0o20666, os.makedev(1, 7))
        else:
            (work / "npudev0").touch()
        env = dict(
            os.environ,
            HOLD_STATE_DIR=str(work / "state"),
            HOLD_CONFIG=str(config),
            HOLD_LOCK_DIR=str(locks_in(work)),
            PYTHONDONTWRITEBYTECODE="",
        )
        envs = {m: mode_envs(m, work, env) for m in modes}
        ctrs: list[subprocess.Popen[bytes]] = []
        try:
            added = 0
            for size, ns, mode in itertools.product(sizes, spaces, modes):
                plain_env, node_env = envs[mode]
                if size > added:
                    crowds.append(crowd(size - added))
                    added = size
                if ns != len(ctrs):
                    _end_containers(ctrs)
                    ctrs = containers(ns)
                row: dict[str, Any] = {
                    "crowd": size,
                    "namespaces": ns,
                    "mode": mode,
                    "processes": processes(),
                }
                print(
                    f"-- {size} idle processes added ({row['processes']} in all), "
                    f"{ns} mount namespaces, {mode}",
                    flush=True,
                )
                if "start" in parts:
                    starts = start_times(args.runs, work, plain_env, node_env)
                    row["start"] = {k: [round(x * 1000, 3) for x in v] for k, v in starts.items()}
                if "loop" in parts:
                    row["loop"] = loops(args.workers, args.per_worker, work, node_env)
                result["sizes"].append(row)
            for c in crowds:
                _end_crowd(c)
            crowds.clear()
            _end_containers(ctrs)
            if "handoff" in parts:
                result["handoff_ms"] = handoff_table(
                    args.rounds, args.clients, work, envs[modes[0]][0]
                )
            if "idle" in parts:
                result["idle"] = idle_daemon(args.idle, work, env)
        finally:
            for lock in work.glob("*state*/daemon.lock"):
                subprocess.run(["kill", lock.read_text().strip()], check=False)
            for c in crowds:
                _end_crowd(c)
            _end_containers(ctrs)
    result["load_end"] = loadavg()
    print(table(result))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    return 0


MODES = {"cgroup": "auto", "walk": "off"}  # --mode -> the configuration's cgroups


def mode_envs(mode: str, work: Path, env: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(the plain run's environment, the node-backed class's) for ``mode``: each with
    a daemon and configuration of its own. In the default mode the plain run has
    no configuration file, as most machines run."""
    node_config = work / f"node-config-{mode}.yaml"
    node_config.write_text(
        f'cgroups: {MODES[mode]}\ndevices:\n  npu:\n    nodes: ["{work}/npudev*"]\n'
    )
    plain = {k: v for k, v in env.items() if k != "HOLD_CONFIG"}
    plain["HOLD_STATE_DIR"] = str(work / f"plain-state-{mode}")
    if mode != "cgroup":
        plain_config = work / f"plain-config-{mode}.yaml"
        plain_config.write_text(f"cgroups: {MODES[mode]}\n")
        plain["HOLD_CONFIG"] = str(plain_config)
    node = dict(env, HOLD_CONFIG=str(node_config), HOLD_STATE_DIR=str(work / f"node-state-{mode}"))
    return plain, node


def _end_crowd(c: subprocess.Popen[str]) -> None:
    """Its parent ends; the kernel kills the children (PR_SET_PDEATHSIG)."""
    if c.stdin is not None and not c.stdin.closed:
        c.stdin.close()
    try:
        c.wait(timeout=30)
    except subprocess.TimeoutExpired:
        c.kill()
        c.wait()


def handoff_table(rounds: int, clients: int, work: Path, env: dict[str, str]) -> dict[str, Any]:
    hand: dict[str, list[float]] = {}
    for name, mode, tree in (
        ("daemon, bare lease", "daemon", False),
        ("daemon, lease + tree", "daemon", True),
        ("flock(2)", "flock", False),
        ("filelock", "filelock", False),
    ):
        gaps: list[float] = []
        for _ in range(rounds):
            gaps += handoffs(mode, clients, work, env, tree)
        hand[name] = [round(g * 1000, 3) for g in gaps]
    return hand


def _column(s: dict[str, Any]) -> str:
    ns = s.get("namespaces", 0)
    out = f"{s['processes']:,} processes" + (f", {ns} mount namespaces" if ns else "")
    return out + (f", {s['mode']}" if s.get("mode", "cgroup") != "cgroup" else "")


def table(r: dict[str, Any]) -> str:
    m = r["machine"]
    lines = [f"Machine: {m}; load {r['load_start']} -> {r['load_end']}", ""]
    sizes = r["sizes"]
    if sizes and "start" in sizes[0]:
        lines += [
            "Start-up, median ms (p90), and x `python3 -c pass` at the same size:",
            "",
            "| command | " + " | ".join(_column(s) for s in sizes) + " |",
            "| --- |" + " ---: |" * len(sizes),
        ]
        for name in sizes[0]["start"]:
            cells = []
            for s in sizes:
                v, py = s["start"][name], median(s["start"]["python3 -c pass"])
                cells.append(f"{median(v):.1f} ({percentile(v, 90):.1f}) {median(v) / py:.2f}x")
            lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    if sizes and "loop" in sizes[0]:
        w, n = r["params"]["workers"], r["params"]["per_worker"]
        lines += [
            "",
            f"Loop: {w} workers x {n} runs each; CPU ms per acquisition (clients + daemon):",
            "",
            "| | " + " | ".join(_column(s) for s in sizes) + " |",
            "| --- |" + " ---: |" * len(sizes),
        ]
        for name in ("npu-hold -- true", "flock -x LOCK true"):
            cells = [
                f"{s['loop'][name]['per_s']}/s, {s['loop'][name]['failed']} failed, "
                f"{s['loop'][name]['cpu_ms_per_acquisition']} ms CPU"
                for s in sizes
            ]
            lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
        cells = []
        for s in sizes:
            g = s["loop"]["daemon_handoff_ms"]
            cells.append(f"p50 {median(g):.2f}, p99 {percentile(g, 99):.2f} ms" if g else "-")
        lines.append("| daemon handoff (ending -> next granted) | " + " | ".join(cells) + " |")
        cells = [
            ", ".join(f"{k} {v}" for k, v in sorted(s["loop"]["checks"].items())) for s in sizes
        ]
        lines.append("| grants by what proved the device empty | " + " | ".join(cells) + " |")
        cells = [
            "; ".join(f"{k}: {v}" for k, v in sorted(s["loop"]["scan_why"].items())) or "-"
            for s in sizes
        ]
        lines.append("| why a grant scanned | " + " | ".join(cells) + " |")
    # Each mode (and number of namespaces) against its own row at the fewest
    # processes: a ticket must cost the same on a busy machine (issue 45's aims:
    # start-up within 1.25x, the loop at least 0.75x).
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for s in sizes:
        groups.setdefault((s.get("mode", "cgroup"), s.get("namespaces", 0)), []).append(s)
    for rows in groups.values():
        if len(rows) < 2:
            continue
        first, last = rows[0], rows[-1]
        lines += ["", f"At {_column(last)} against {_column(first)}:"]
        if "start" in first:
            for name in (
                "npu-hold -- true (node-backed class)",
                "hold run -- true (no config file)",
            ):
                a, b = median(first["start"][name]), median(last["start"][name])
                met = "met" if b / a <= 1.25 else "MISSED"
                lines.append(f"- `{name}`: {b / a:.2f}x the time (aim 1.25x: {met})")
        if "loop" in first:
            a = first["loop"]["npu-hold -- true"]["per_s"]
            b = last["loop"]["npu-hold -- true"]["per_s"]
            met = "met" if b / a >= 0.75 else "MISSED"
            lines.append(
                f"- the loop of `npu-hold -- true`: {b / a:.2f}x the rate (aim 0.75x: {met})"
            )
    if "handoff_ms" in r:
        n = len(next(iter(r["handoff_ms"].values())))
        lines += [
            "",
            f"Handoff, {n} gaps each:",
            "",
            "| method | p50 ms | p99 ms | max ms |",
            "| --- | ---: | ---: | ---: |",
        ]
        for name, v in r["handoff_ms"].items():
            lines.append(f"| {name} | {median(v):.2f} | {percentile(v, 99):.2f} | {max(v):.2f} |")
    if "idle" in r:
        i = r["idle"]
        lines += [
            "",
            f"Idle daemon with 5 leases: {i['cpu_ms']} ms CPU in {i['seconds']:g} s; "
            f"RSS {i['rss_mb']} MB",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
