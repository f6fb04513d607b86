"""The benchmark of issue 5: ``hold up`` / ``hold down`` against supervisord, side by side.

Run from the repository root, in the project's venv::

    .venv/bin/python -m bench.stack              # 7 interleaved rounds (~3 minutes)
    .venv/bin/python -m bench.stack --runs 3     # a quick look

supervisord comes from PyPI (``supervisor``) in a venv of its own,
``.venv/supervisord`` (git-ignored with ``.venv/``)::

    .venv/bin/python -m venv .venv/supervisord && .venv/supervisord/bin/pip install supervisor

Not in the project's venv: PyPI's package is *also* imported as
``supervisor``, so installed there it would shadow this project's
``supervisor/`` package for every console script (``hold`` included).

One stack, three units that are all ready at once (``bench/progs/``):

* ``web`` -- ends at once on SIGTERM;
* ``stubborn`` -- ignores SIGTERM, so a stop waits out the 2 s grace and kills it;
* ``escaper`` -- double-forks a ``setsid`` *escapee* that holds a temporary
  "device" file open (it left the unit's session, group and ancestry).

The same three programs run under each contender, with the same grace
(``stop: {grace: 2s}`` / ``stopwaitsecs=2``). supervisord is configured as
the issue says: ``stopasgroup=true``, ``killasgroup=true``, ``startsecs=0``.
Each round runs every contender once, in a rotating order, and each run
measures:

(a) **up**: from launching the tool to "all three units up". For ``hold``:
    ``hold up --detach FILE`` returns once the stack is up (with a readiness
    probe, ``log: READY``, that is *proven* ready; without one, "started").
    For supervisord: ``supervisord -n -c CONF`` is launched and its XML-RPC
    interface is asked (over its unix socket, from this process, every
    10 ms) until all three programs are RUNNING -- which with ``startsecs=0``
    means "spawned", not "proven ready". A second supervisord row has the
    daemon already running (``autostart=false``) and times
    ``supervisorctl start all``. Next to the tool's answer: when the three
    units really were up, from their own announcements (CLOCK_MONOTONIC).
(b) **stop**: ``hold down NAME`` against ``supervisorctl stop all``, each
    from launch to return; reported as that time minus the 2 s grace. Next to
    it, when the last unit process really was gone (pidfds watched from here),
    and how long after the last death (of a unit, or of the escapee where the
    stop took it) the command returned (issue 13: within 20 ms).
(b') **memory**: the VmRSS of the process that supervises the running units
    (``hold ps``'s pid: the detached stack; supervisord's own), read from
    ``/proc/PID/status`` once the stack is up (issue 13: at most 25 MB).
(c) **survivors**: the moment the stop command returns, which of the four
    announced processes (``web``, ``stubborn``, ``escaper``, ``escapee``) is
    still alive, by pid *and* start time; who holds the "device" file
    (every ``/proc/PID/fd`` looked at); and which process still carries the
    run's marker in its environment. All three checks are this file's own
    code, not the code under test. Survivors are then killed by the
    benchmark, and every run must end with nothing left: no announced
    process, no holder, no marked process, no supervisor process, no cgroup
    leaf. Anything else stops the benchmark (after killing what is left).

The ticket daemon of ``hold`` (the guardian of the stack's trees) is started
once per state directory before the rounds, as a user's daemon would already
be running; supervisord is started by each run, being the stack's supervisor
itself. One untimed warm-up round first; byte-code caching is on for every
contender and unit (a temporary ``PYTHONPYCACHEPREFIX``), as on an ordinary
install, whatever the caller's ``PYTHONDONTWRITEBYTECODE`` says.

Figures: medians and p90 (nearest rank); markdown table, and JSON with
every sample in ``bench/results/<name>.json``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import xmlrpc.client
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from bench.run import loadavg, machine, median, percentile
from hold_supervisor.proc.cgroup import CgroupUnavailable, Hierarchy

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PROGS = BENCH / "progs"
RESULTS = BENCH / "results"
SUPERVISORD_VENV = ROOT / ".venv" / "supervisord"

GRACE_S = 2.0
POLL_S = 0.010  # how often supervisord is asked whether its programs run
TOOL_TIMEOUT_S = 30.0
ROLES = ("web", "stubborn", "escaper", "escapee")
UNITS = ("web", "stubborn", "escaper")  # the escapee is no unit: it escaped one

# The issues' aims (5, then 13).
AIM_STOP_OVER_GRACE_S = 0.100
AIM_ANSWER_LAG_S = 0.020  # `hold down` returns within this of the last death
AIM_RSS_MB = 25.0  # the stack's supervisor process

MARK = "BENCH_STACK_RUN"  # in every unit's environment: "<session>:<variant>:<run>"
TOOL_MARK = "BENCH_STACK_TOOL"  # in every supervisor's environment: "<session>"


class BenchError(Exception):
    """A check failed: the benchmark stops (after killing what is left)."""


# --------------------------------------------------------------------------
# Looking at processes, independently of the code under test.


class Proc(NamedTuple):
    role: str
    pid: int
    starttime: int
    up_at: float  # CLOCK_MONOTONIC


def stat_of(pid: int) -> tuple[str, int] | None:
    """(state letter, start time) of a pid, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return fields[0].decode(), int(fields[19])


def alive(p: Proc) -> bool:
    st = stat_of(p.pid)
    return st is not None and st[1] == p.starttime and st[0] not in ("Z", "X", "x")


def pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def holders_of(path: Path) -> list[int]:
    """Every live process with a descriptor open on ``path`` (matched by device and inode)."""
    try:
        st = os.stat(path)
    except OSError:
        return []
    key = (st.st_dev, st.st_ino)
    out = []
    me = os.getpid()
    for pid in pids():
        if pid == me:
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                s = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if (s.st_dev, s.st_ino) == key:
                state = stat_of(pid)
                if state is not None and state[0] not in ("Z", "X", "x"):
                    out.append(pid)
                break
    return out


def marked(name: str, value: str, *, prefix: bool = False) -> list[int]:
    """Every live process whose environment has ``name=value`` (``prefix``: ``name=value...``)."""
    entry = f"\0{name}={value}{'' if prefix else chr(0)}".encode()
    out = []
    for pid in pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = b"\0" + f.read()
        except OSError:
            continue
        if entry in env:
            state = stat_of(pid)
            if state is not None and state[0] not in ("Z", "X", "x"):
                out.append(pid)
    return out


def kill_pid(pid: int, starttime: int | None = None) -> bool:
    """SIGKILL through a pidfd (after checking the start time, where known)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        st = stat_of(pid)
        if st is None or (starttime is not None and st[1] != starttime):
            return False
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        select.select([fd], [], [], 5.0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def wait_gone(pid: int, timeout: float) -> bool:
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


class Watcher:
    """Records when each announced process exits, woken by its pidfd."""

    def __init__(self, procs: list[Proc]) -> None:
        self.fds: dict[int, Proc] = {}
        for p in procs:
            try:
                fd = os.pidfd_open(p.pid)
            except OSError:
                continue
            if alive(p):  # opened on the right process (the pid was not reused)
                self.fds[fd] = p
            else:
                os.close(fd)
        self.gone: dict[str, float] = {}
        self._r, self._w = os.pipe()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._r, select.POLLIN)
        for fd in self.fds:
            poller.register(fd, select.POLLIN)
        left = len(self.fds)
        while left:
            for fd, _ in poller.poll():
                if fd == self._r:
                    return
                self.gone[self.fds[fd].role] = time.monotonic()
                poller.unregister(fd)
                left -= 1

    def close(self) -> dict[str, float]:
        os.write(self._w, b"x")
        self._thread.join(5.0)
        for fd in (*self.fds, self._r, self._w):
            os.close(fd)
        return dict(self.gone)


# --------------------------------------------------------------------------
# One run's files: where the units announce themselves, the "device".


class RunDir:
    def __init__(self, base: Path, session: str, variant: str, run: int) -> None:
        self.path = base / f"{variant}-{run}"
        self.path.mkdir(parents=True)
        self.announce = self.path / "announce"
        self.device = self.path / "device"
        self.device.write_bytes(b"")
        self.mark = f"{session}:{variant}:{run}"

    def unit_env(self) -> dict[str, str]:
        return {"BENCH_ANNOUNCE": str(self.announce), MARK: self.mark}

    def commands(self) -> dict[str, list[str]]:
        py = [sys.executable, "-S"]  # stdlib only: no site-packages to import
        return {
            "web": [*py, str(PROGS / "unit_ready.py"), "web"],
            "stubborn": [*py, str(PROGS / "unit_stubborn.py"), "stubborn"],
            "escaper": [*py, str(PROGS / "unit_escaper.py"), str(self.device)],
        }

    def procs(self) -> dict[str, Proc]:
        out: dict[str, Proc] = {}
        try:
            text = self.announce.read_text()
        except FileNotFoundError:
            return out
        for line in text.splitlines():
            role, pid, start, up = line.split()
            out[role] = Proc(role, int(pid), int(start), float(up))
        return out

    def wait_procs(self, timeout: float = 10.0) -> dict[str, Proc]:
        deadline = time.monotonic() + timeout
        while True:
            got = self.procs()
            if all(r in got for r in ROLES):
                return got
            if time.monotonic() > deadline:
                raise BenchError(f"{self.path.name}: only {sorted(got)} announced in {timeout}s")
            time.sleep(0.005)


# --------------------------------------------------------------------------
# The contenders. Each: setup (untimed), start (timed), stop (timed), teardown.


class Contender:
    key = ""
    title = ""
    up_means = ""

    def setup(self, run: RunDir) -> None: ...

    def start(self, run: RunDir) -> None:
        raise NotImplementedError

    def after_start(self, run: RunDir) -> None: ...

    def stop(self, run: RunDir) -> None:
        raise NotImplementedError

    def teardown(self, run: RunDir) -> list[str]:
        """End the supervisor itself; what did not go as it should."""
        return []

    def inner_stop_ms(self) -> float | None:
        return None

    def supervisor_pid(self) -> int | None:
        """The process that supervises the units while they run (its memory is measured)."""
        return None

    def close(self) -> None: ...


def _run(argv: list[str], env: dict[str, str], cwd: Path, what: str) -> None:
    try:
        res = subprocess.run(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=TOOL_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise BenchError(f"{what}: no answer in {TOOL_TIMEOUT_S:g}s") from None
    if res.returncode != 0:
        raise BenchError(f"{what}: exit {res.returncode}\n{res.stdout}{res.stderr}")


class HoldDaemon:
    """The ticket daemon of one state directory, started before the rounds."""

    def __init__(self, work: Path, path: str, hold: str, session: str) -> None:
        self.state = work / f"state-{path}"
        config = work / f"config-{path}.yaml"
        config.write_text(f"cgroups: {'required' if path == 'cgroup' else 'off'}\n")
        self.env = dict(os.environ, HOLD_STATE_DIR=str(self.state), HOLD_CONFIG=str(config))
        self.env[TOOL_MARK] = session
        self.env.pop("HOLD_LEASE", None)
        self.hold = hold
        # Not through _run: the daemon keeps what it inherits as 1 and 2, so a
        # pipe there would never reach its end.
        res = subprocess.run(
            [hold, "daemon", "--detach"],
            env=self.env,
            cwd=work,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=TOOL_TIMEOUT_S,
            check=False,
        )
        if res.returncode != 0:
            raise BenchError(f"hold daemon ({path}): exit {res.returncode}")

    def close(self) -> None:
        try:
            pid = int((self.state / "daemon.lock").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        if not wait_gone(pid, 10.0):
            kill_pid(pid)


class Hold(Contender):
    def __init__(
        self, key: str, daemon: HoldDaemon, *, probe: bool, hierarchy: Hierarchy | None
    ) -> None:
        self.key = key
        self.name = f"bench-{key}"
        self.daemon = daemon
        self.probe = probe
        self.hierarchy = hierarchy
        path = "cgroup leaf" if hierarchy is not None else "no cgroup (walk)"
        self.title = f"hold, {path}" + ("" if probe else ", no probe")
        self.up_means = "`hold up --detach` returned: " + (
            "each unit printed READY (log probe)" if probe else "spawned (no probe)"
        )
        self.stack_pid = 0
        self.trees: list[str] = []
        self.log = daemon.state / "stacks" / self.name / "supervisor.log"
        self.log_offset = 0
        self._inner: float | None = None

    def setup(self, run: RunDir) -> None:
        units: dict[str, Any] = {}
        for name, cmd in run.commands().items():
            u: dict[str, Any] = {
                "cmd": cmd,
                "env": run.unit_env(),
                "stop": {"signal": "TERM", "grace": f"{GRACE_S:g}s"},
            }
            if self.probe:
                u["ready"] = {"log": "READY", "timeout": "10s"}
            units[name] = u
        (run.path / "stack.yaml").write_text(yaml.safe_dump({"name": self.name, "units": units}))
        try:
            self.log_offset = self.log.stat().st_size
        except FileNotFoundError:
            self.log_offset = 0

    def start(self, run: RunDir) -> None:
        _run(
            [self.daemon.hold, "up", "--detach", str(run.path / "stack.yaml")],
            self.daemon.env,
            run.path,
            f"{self.key}: hold up",
        )

    def after_start(self, run: RunDir) -> None:
        res = subprocess.run(
            [self.daemon.hold, "ps", self.name, "--json"],
            env=self.daemon.env,
            capture_output=True,
            text=True,
            timeout=TOOL_TIMEOUT_S,
            check=False,
        )
        if res.returncode != 0:
            raise BenchError(f"{self.key}: hold ps: exit {res.returncode}: {res.stderr}")
        ps = json.loads(res.stdout)
        self.stack_pid = int(ps["pid"])
        self.trees = [u["tree"] for u in ps["units"]]
        if [u["state"] for u in ps["units"]] != ["ready"] * 3:
            raise BenchError(f"{self.key}: not all units ready after hold up: {ps['units']}")

    def stop(self, run: RunDir) -> None:
        _run([self.daemon.hold, "down", self.name], self.daemon.env, run.path, f"{self.key}: down")

    def teardown(self, run: RunDir) -> list[str]:
        problems = []
        if self.stack_pid and not wait_gone(self.stack_pid, 10.0):
            problems.append(f"hold up (pid {self.stack_pid}) still running after hold down")
            kill_pid(self.stack_pid)
        if self.hierarchy is not None:
            for tree in self.trees:
                leaf = Path(self.hierarchy.base) / f"hold-{tree}"
                if leaf.exists():
                    problems.append(f"cgroup leaf {leaf} left behind")
        # The stack's own account of its stop: the slowest unit's stop_tree.
        self._inner = None
        try:
            with open(self.log, "rb") as f:
                f.seek(self.log_offset)
                text = f.read().decode(errors="replace")
        except OSError:
            text = ""
        times = [
            int(m)
            for m in re.findall(
                r": (?:exited|killed|nothing left running) "
                r"\(\d+ process\(es\), (\d+) ms\)",
                text,
            )
        ]
        if times:
            self._inner = max(times) / 1000
        return problems

    def inner_stop_ms(self) -> float | None:
        return self._inner

    def supervisor_pid(self) -> int | None:
        return self.stack_pid or None


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=5.0)
        self.unix_path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5.0)
        s.connect(self.unix_path)
        self.sock = s


class _UnixTransport(xmlrpc.client.Transport):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.unix_path = path

    def make_connection(self, host: Any) -> http.client.HTTPConnection:
        return _UnixHTTPConnection(self.unix_path)


def rpc(sock: Path) -> Any:
    """supervisord's XML-RPC interface over its unix socket (a fresh connection)."""
    return xmlrpc.client.ServerProxy("http://localhost/RPC2", transport=_UnixTransport(str(sock)))


class Supervisord(Contender):
    """supervisord, as the issue configures it. ``warm``: the daemon is already
    running with ``autostart=false`` and ``supervisorctl start all`` is timed."""

    def __init__(self, key: str, venv: Path, session: str, *, warm: bool) -> None:
        self.key = key
        self.warm = warm
        self.supervisord = str(venv / "bin" / "supervisord")
        self.supervisorctl = str(venv / "bin" / "supervisorctl")
        self.env = {k: v for k, v in os.environ.items() if k not in ("HOLD_LEASE",)}
        self.env[TOOL_MARK] = session
        self.title = "supervisord, already running" if warm else "supervisord"
        self.up_means = (
            "`supervisorctl start all` returned: all RUNNING (startsecs=0: spawned)"
            if warm
            else "all RUNNING over XML-RPC, asked every 10 ms (startsecs=0: spawned)"
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def conf(self, run: RunDir) -> Path:
        return run.path / "supervisord.conf"

    def sock(self, run: RunDir) -> Path:
        return run.path / "s.sock"

    def setup(self, run: RunDir) -> None:
        d = run.path
        env = ",".join(f'{k}="{v}"' for k, v in run.unit_env().items())
        lines = [
            "[unix_http_server]",
            f"file={self.sock(run)}",
            "[supervisord]",
            f"logfile={d}/supervisord.log",
            f"pidfile={d}/supervisord.pid",
            f"childlogdir={d}",
            "loglevel=warn",
            "nodaemon=true",
            "[rpcinterface:supervisor]",
            "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface",
            "[supervisorctl]",
            f"serverurl=unix://{self.sock(run)}",
        ]
        for name, cmd in run.commands().items():
            lines += [
                f"[program:{name}]",
                "command=" + " ".join(cmd),
                f"directory={d}",
                f"environment={env}",
                f"autostart={'false' if self.warm else 'true'}",
                "autorestart=false",
                "startsecs=0",
                "startretries=0",
                "stopsignal=TERM",
                f"stopwaitsecs={GRACE_S:g}",
                "stopasgroup=true",
                "killasgroup=true",
                "redirect_stderr=true",
                f"stdout_logfile={d}/{name}.log",
            ]
        self.conf(run).write_text("\n".join(lines).replace("%", "%%") + "\n")
        if self.warm:
            self._launch(run)
            deadline = time.monotonic() + TOOL_TIMEOUT_S
            while True:
                try:
                    if rpc(self.sock(run)).supervisor.getState()["statename"] == "RUNNING":
                        break
                except (OSError, xmlrpc.client.Error, http.client.HTTPException):
                    pass
                if time.monotonic() > deadline:
                    raise BenchError(f"{self.key}: supervisord did not answer")
                time.sleep(POLL_S)

    def _launch(self, run: RunDir) -> None:
        self.proc = subprocess.Popen(
            [self.supervisord, "-n", "-c", str(self.conf(run))],
            env=self.env,
            cwd=run.path,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _all_running(self, run: RunDir) -> bool:
        try:
            info = rpc(self.sock(run)).supervisor.getAllProcessInfo()
        except (OSError, xmlrpc.client.Error, http.client.HTTPException):
            return False
        return len(info) == len(UNITS) and all(p["statename"] == "RUNNING" for p in info)

    def start(self, run: RunDir) -> None:
        if self.warm:
            _run(
                [self.supervisorctl, "-c", str(self.conf(run)), "start", "all"],
                self.env,
                run.path,
                f"{self.key}: supervisorctl start all",
            )
            return
        self._launch(run)
        assert self.proc is not None
        deadline = time.monotonic() + TOOL_TIMEOUT_S
        while not self._all_running(run):
            if self.proc.poll() is not None:
                raise BenchError(f"{self.key}: supervisord exited {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise BenchError(f"{self.key}: programs not RUNNING in {TOOL_TIMEOUT_S:g}s")
            time.sleep(POLL_S)

    def supervisor_pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def after_start(self, run: RunDir) -> None:
        if not self._all_running(run):
            raise BenchError(f"{self.key}: not all programs RUNNING after start")

    def stop(self, run: RunDir) -> None:
        _run(
            [self.supervisorctl, "-c", str(self.conf(run)), "stop", "all"],
            self.env,
            run.path,
            f"{self.key}: supervisorctl stop all",
        )

    def teardown(self, run: RunDir) -> list[str]:
        problems: list[str] = []
        if self.proc is None:
            return problems
        try:
            rpc(self.sock(run)).supervisor.shutdown()
        except (OSError, xmlrpc.client.Error, http.client.HTTPException) as e:
            problems.append(f"supervisord shutdown: {e}")
        try:
            self.proc.wait(10.0)
        except subprocess.TimeoutExpired:
            problems.append("supervisord still running 10 s after shutdown")
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        return problems

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# --------------------------------------------------------------------------
# One run of one contender.


class Sample(NamedTuple):
    up: float  # tool's answer, s from launch
    truth_up: float  # last unit's own announcement, s from launch
    stop: float  # stop command, s from launch to return
    units_gone: float | None  # last unit process exited, s from the stop's launch
    escapee_gone: float | None
    inner_stop: float | None  # hold: the stack's slowest stop_tree
    rss_kb: int | None  # the supervisor's VmRSS while the stack runs
    survivors: list[str]  # roles (or "holder PID" / "marked PID") alive at the return


def rss_kb(pid: int) -> int | None:
    """VmRSS of ``pid`` (kB), from /proc/PID/status."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def survivors_now(run: RunDir, procs: dict[str, Proc]) -> tuple[list[str], set[int]]:
    """What is still alive, by announced identity, by the device file and by the
    marker: e.g. ``["escapee holding the device file"]``; and their pids."""
    found: list[str] = []
    seen: set[int] = set()
    holders = set(holders_of(run.device))
    for p in procs.values():
        if alive(p):
            found.append(p.role + (" holding the device file" if p.pid in holders else ""))
            seen.add(p.pid)
    for pid in holders - seen:
        found.append("a process holding the device file")
        seen.add(pid)
    for pid in set(marked(MARK, run.mark)) - seen:
        found.append("a process with the run's marker")
        seen.add(pid)
    return found, seen


def one_run(c: Contender, run: RunDir) -> Sample:
    c.setup(run)
    t0 = time.monotonic()
    c.start(run)
    up = time.monotonic() - t0
    procs = run.wait_procs()
    truth_up = max(procs[u].up_at for u in UNITS) - t0
    c.after_start(run)
    pid = c.supervisor_pid()
    rss = rss_kb(pid) if pid is not None else None
    # Every unit asleep in pause() before the stop is timed (not still starting).
    deadline = time.monotonic() + 10
    while not all((stat_of(p.pid) or ("?", 0))[0] == "S" for p in procs.values()):
        if time.monotonic() > deadline:
            raise BenchError(f"{c.key}: units did not settle")
        time.sleep(0.005)
    watcher = Watcher(list(procs.values()))
    t1 = time.monotonic()
    c.stop(run)
    stop = time.monotonic() - t1
    found, pids_left = survivors_now(run, procs)
    gone = watcher.close()
    problems = c.teardown(run)
    # Clean up after the contender, then prove nothing is left.
    for p in procs.values():
        if alive(p):
            kill_pid(p.pid, p.starttime)
    for pid in pids_left:
        kill_pid(pid)
    left, _ = survivors_now(run, procs)
    if left:
        problems.append(f"still alive after the benchmark's own kill: {left}")
    if problems:
        raise BenchError(f"{c.key}, {run.path.name}: " + "; ".join(problems))
    units_gone = [gone[u] - t1 for u in UNITS if u in gone]
    return Sample(
        up=up,
        truth_up=truth_up,
        stop=stop,
        units_gone=max(units_gone) if len(units_gone) == len(UNITS) else None,
        escapee_gone=gone["escapee"] - t1 if "escapee" in gone else None,
        inner_stop=c.inner_stop_ms(),
        rss_kb=rss,
        survivors=found,
    )


# --------------------------------------------------------------------------
# The report.


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"


def stats(values: list[float]) -> dict[str, float]:
    return {"median": median(values), "p90": percentile(values, 90)}


def table(r: dict[str, Any]) -> str:
    m = r["machine"]
    out = [
        f"Machine: {m['cpu']}, {m['nproc']} CPUs, kernel {m['kernel']}, Python {m['python']}, "
        f"uid {m['uid']}; supervisor {r['supervisor_version']}; load {r['load_start']} -> "
        f"{r['load_end']}; {r['params']['runs']} interleaved runs each; grace {GRACE_S:g} s.",
        "",
        '**Up** (launch to "all three units up"), ms:',
        "",
        "| contender | up means | median | p90 | x supervisord | units really up: median | "
        "supervisor RSS, MB: median |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    res = r["results"]
    base = median(res["supervisord"]["up"]) if "supervisord" in res else None
    for v in res.values():
        ratio = f"{median(v['up']) / base:.2f}" if base else "-"
        rss = [k / 1024 for k in v["rss_kb"] if k is not None]
        out.append(
            f"| {v['title']} | {v['up_means']} | {ms(median(v['up']))} | "
            f"{ms(percentile(v['up'], 90))} | {ratio} | {ms(median(v['truth_up']))} | "
            f"{f'{median(rss):.1f}' if rss else '-'} |"
        )
    out += [
        "",
        f"**Stop** (launch of the stop command to its return, minus the {GRACE_S:g} s grace; "
        "one unit ignores TERM), ms, and **survivors** at the return:",
        "",
        "| contender | stop command | median | p90 | last unit gone: median | "
        "returned after the last unit was gone: median | p90 | inside the stack: median | "
        "survivors |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for key, v in res.items():
        over = [s - GRACE_S for s in v["stop"]]
        gone = [g - GRACE_S for g in v["units_gone"] if g is not None]
        lag = answer_lag(v)
        inner = [g - GRACE_S for g in v["inner_stop"] if g is not None]
        cmd = "`hold down NAME`" if key.startswith("hold") else "`supervisorctl stop all`"
        surv = v["survivors"]
        n_bad = sum(1 for s in surv if s)
        kinds = sorted({x for s in surv for x in s})
        text = "none" if not n_bad else f"{', '.join(kinds)} in {n_bad} of {len(surv)} runs"
        out.append(
            f"| {v['title']} | {cmd} | {ms(median(over))} | {ms(percentile(over, 90))} | "
            f"{ms(median(gone)) if gone else '-'} | {ms(median(lag)) if lag else '-'} | "
            f"{ms(percentile(lag, 90)) if lag else '-'} | {ms(median(inner)) if inner else '-'} | "
            f"{text} |"
        )
    out += ["", "Aims:"] + [f"- {a}" for a in r["aims"]]
    return "\n".join(out)


def answer_lag(v: dict[str, Any]) -> list[float]:
    """Per run: the stop command's return after the last of its processes died (the
    units, and the escapee where the stop took it too)."""
    out = []
    for stop, units, escapee in zip(v["stop"], v["units_gone"], v["escapee_gone"], strict=True):
        if units is not None:
            out.append(stop - max(units, escapee if escapee is not None else 0.0))
    return out


def aims(r: dict[str, Any]) -> list[str]:
    res = r["results"]
    out = []
    sd = res.get("supervisord")
    for key, v in res.items():
        if not key.startswith("hold"):
            continue
        line = f"{v['title']}: "
        parts = []
        if sd is not None:
            a, b, t = median(v["up"]), median(sd["up"]), median(sd["truth_up"])
            parts.append(
                f"up {'faster' if a < b else 'NOT faster'} than supervisord "
                f"({ms(a)} ms against {ms(b)} ms to RUNNING and {ms(t)} ms to its units "
                f"really up; {a / b:.2f}x)"
            )
        over = median(v["stop"]) - GRACE_S
        p90 = percentile(v["stop"], 90) - GRACE_S
        ok = over <= AIM_STOP_OVER_GRACE_S
        parts.append(
            f"stop {'within' if ok else 'NOT within'} 100 ms of the grace "
            f"(median +{ms(over)} ms, p90 +{ms(p90)} ms)"
        )
        lag = answer_lag(v)
        if lag:
            ok = median(lag) <= AIM_ANSWER_LAG_S
            parts.append(
                f"returned {'within' if ok else 'NOT within'} 20 ms of the last death "
                f"(median +{ms(median(lag))} ms, p90 +{ms(percentile(lag, 90))} ms)"
            )
        rss = [k / 1024 for k in v["rss_kb"] if k is not None]
        sd_rss = [k / 1024 for k in sd["rss_kb"] if k is not None] if sd is not None else []
        if rss:
            ok = median(rss) <= AIM_RSS_MB
            parts.append(
                f"supervisor RSS {'at most' if ok else 'OVER'} 25 MB ({median(rss):.1f} MB"
                + (f"; supervisord {median(sd_rss):.1f} MB)" if sd_rss else ")")
            )
        n_bad = sum(1 for s in v["survivors"] if s)
        sd_bad = sum(1 for s in sd["survivors"] if s) if sd is not None else 0
        parts.append(
            f"survivors {'none' if not n_bad else f'in {n_bad} runs'}"
            + (f" (supervisord: in {sd_bad} of {len(sd['survivors'])} runs)" if sd else "")
        )
        out.append(line + "; ".join(parts))
    return out


# --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.stack", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=7, help="timed runs per contender (7)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (1)")
    p.add_argument(
        "--only",
        help="comma-separated contenders (hold-cgroup, hold-started, hold-walk, "
        "supervisord, supervisord-warm)",
    )
    p.add_argument("--hold", help="the hold console script (default: next to this python)")
    p.add_argument(
        "--supervisord-venv",
        default=str(SUPERVISORD_VENV),
        help="venv with PyPI supervisor installed (.venv/supervisord)",
    )
    p.add_argument("--name", help="results/<name>.json (default: stack-date-time-host)")
    a = p.parse_args(argv)

    hold = a.hold or str(Path(sys.executable).parent / "hold")
    venv = Path(a.supervisord_venv)
    if not os.access(venv / "bin" / "supervisord", os.X_OK):
        p.error(
            f"no supervisord in {venv}: {sys.executable} -m venv {venv} && "
            f"{venv}/bin/pip install supervisor"
        )
    version = subprocess.run(
        [str(venv / "bin" / "supervisord"), "--version"], capture_output=True, text=True
    ).stdout.strip()
    try:
        hierarchy: Hierarchy | None = Hierarchy.find()
    except CgroupUnavailable as e:
        hierarchy = None
        print(f"no cgroup leaves here ({e}): hold runs without one", file=sys.stderr)

    session = os.urandom(4).hex()
    result: dict[str, Any] = {
        "machine": machine(),
        "load_start": loadavg(),
        "supervisor_version": version,
        "params": vars(a) | {"hold": hold, "grace_s": GRACE_S, "poll_s": POLL_S},
        "results": {},
    }
    t_begin = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="hold-bench-stack-"))
    # Byte-code caching on, as on an ordinary install, for every contender and
    # unit alike, even where the caller's environment says
    # PYTHONDONTWRITEBYTECODE (this project's sandbox does): otherwise each
    # run of a tool compiles every module that has no .pyc yet. The .pyc files
    # go to a temporary prefix, filled by the warm-up round, never into the tree.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    contenders: list[Contender] = []
    daemons: list[HoldDaemon] = []
    try:
        d_main = HoldDaemon(work, "cgroup" if hierarchy else "walk", hold, session)
        daemons.append(d_main)
        contenders += [
            Hold(
                "hold-cgroup" if hierarchy else "hold-walk", d_main, probe=True, hierarchy=hierarchy
            ),
            Hold("hold-started", d_main, probe=False, hierarchy=hierarchy),
        ]
        if hierarchy is not None:
            d_walk = HoldDaemon(work, "walk", hold, session)
            daemons.append(d_walk)
            contenders.append(Hold("hold-walk", d_walk, probe=True, hierarchy=None))
        contenders += [
            Supervisord("supervisord", venv, session, warm=False),
            Supervisord("supervisord-warm", venv, session, warm=True),
        ]
        if a.only:
            keep = set(a.only.split(","))
            unknown = keep - {c.key for c in contenders}
            if unknown:
                p.error(f"--only: unknown {sorted(unknown)}")
            contenders = [c for c in contenders if c.key in keep]
        samples: dict[str, list[Sample]] = {c.key: [] for c in contenders}
        total = a.warmup + a.runs
        for i in range(total):
            order = contenders[i % len(contenders) :] + contenders[: i % len(contenders)]
            what = "warm-up" if i < a.warmup else f"run {i - a.warmup + 1}/{a.runs}"
            print(f"{what}:", file=sys.stderr, end="", flush=True)
            for c in order:
                s = one_run(c, RunDir(work, session, c.key, i))
                print(
                    f" {c.key} {ms(s.up)}/{ms(s.stop - GRACE_S)}",
                    file=sys.stderr,
                    end="",
                    flush=True,
                )
                if i >= a.warmup:
                    samples[c.key].append(s)
            print(file=sys.stderr)
        for c in contenders:
            ss = samples[c.key]
            result["results"][c.key] = {
                "title": c.title,
                "up_means": c.up_means,
                **{f: [getattr(s, f) for s in ss] for f in Sample._fields},
            }
    except BenchError as e:
        print(f"\nbench.stack: FAILED: {e}", file=sys.stderr)
        return 1
    finally:
        for c in contenders:
            c.close()
        # Whatever a failure left: the units (by their marker), then the supervisors.
        for pid in marked(MARK, session, prefix=True):
            kill_pid(pid)
        for d in daemons:
            for name in ("bench-hold-cgroup", "bench-hold-started", "bench-hold-walk"):
                subprocess.run(
                    [hold, "down", name],
                    env=d.env,
                    capture_output=True,
                    timeout=TOOL_TIMEOUT_S,
                    check=False,
                )
            d.close()
        for pid in marked(TOOL_MARK, session):
            kill_pid(pid)
        left = marked(MARK, session, prefix=True) + marked(TOOL_MARK, session)
        if left:
            print(f"bench.stack: processes left behind: {left}", file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)

    result["load_end"] = loadavg()
    result["elapsed_s"] = round(time.monotonic() - t_begin, 1)
    result["aims"] = aims(result)
    text = table(result)
    result["table"] = text
    print(text)
    RESULTS.mkdir(exist_ok=True)
    name = a.name or time.strftime("stack-%Y%m%d-%H%M%S-") + socket.gethostname()
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written: {out.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
