"""``hold up / ps / logs / down / restart / validate``: stacks, composed with tickets.

:mod:`supervisor.stack` runs the units and knows nothing of devices. This
module adds what ``hold`` is for:

* with ``hold:`` in the file, the ticket is taken first (waiting in line as
  ``npu-hold`` does, through :func:`hold.lease.acquire_lease`), and every
  unit gets its variables (``HOLD_LEASE``, ``CUDA_VISIBLE_DEVICES``...) and
  runs inside it, so units pass ``hold check``;
* every unit's tree is registered with the daemon before anything is spawned
  (marker and cgroup leaf) and its root after each spawn, so a ``hold up``
  that is SIGKILLed leaves nothing: the daemon, the guardian, stops them;
* the stack's run directory lives in the state directory:
  ``HOLD_STATE_DIR/stacks/NAME/`` (``control.sock``, ``logs/UNIT.log``,
  ``stack.json``, ``supervisor.log`` for a detached stack).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from supervisor.exitcodes import EXPIRED, NO, OK, SURVIVORS, TOOL, UNIT_FAILED, USAGE, signalled
from supervisor.parse import BadValue, format_duration

if TYPE_CHECKING:
    from hold.client import Client
    from hold.config import Config
    from hold.statedir import StateDir
    from supervisor.cause import Cause
    from supervisor.cgroup import Leaf
    from supervisor.stack import Stack
    from supervisor.stackfile import StackSpec
    from supervisor.tree import Tree


def say(text: str, prog: str = "hold up") -> None:
    print(f"{prog}: {text}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- loading


def load_checked(path: str, cfg: Config | None = None) -> StackSpec:
    """The stack file, checked by the supervisor's rules and by ours (device, label).

    Raises :class:`~supervisor.stackfile.StackFileError` with every problem,
    or :class:`BadValue` for a bad configuration file.
    """
    from hold.config import load
    from hold.devices import classes_from_config, parse_device_spec
    from hold.protocol import check_label
    from supervisor.stackfile import load as load_stack

    cfg = load() if cfg is None else cfg
    classes = classes_from_config(cfg.devices, cfg.path)

    def check(data: dict[str, Any]) -> list[tuple[tuple[str | int, ...], str]]:
        out: list[tuple[tuple[str | int, ...], str]] = []
        hold = data.get("hold")
        if not isinstance(hold, dict):
            return out
        device = hold.get("device")
        if isinstance(device, str):
            try:
                parse_device_spec(device, classes, what="device")
            except BadValue as e:
                out.append((("hold", "device"), f"{device!r} is not valid: {e.accepted}"))
        label = hold.get("label")
        if isinstance(label, str):
            why = check_label(label)
            if why:
                out.append((("hold", "label"), f"{label!r} is not valid: {why}"))
        return out

    return load_stack(path, extra_check=check)


def run_dir_of(sd: StateDir, name: str) -> str:
    """The stack's directory; :class:`BadValue` for a name that is not one."""
    from supervisor.stackctl import check_stack_name

    return os.path.join(sd.stacks(), check_stack_name(name))


def _open_sd() -> StateDir:
    from hold.statedir import open_state_dir

    sd = open_state_dir()
    try:
        os.makedirs(sd.stacks(), mode=0o700, exist_ok=True)
    except OSError as e:
        raise BadValue("stack directory", sd.stacks(), f"a directory you may write "
                       f"({e.strerror})") from None  # fmt: skip
    return sd


# ---------------------------------------------------------------------- validate


def main_validate(path: str) -> int:
    from supervisor.stackfile import StackFileError

    try:
        spec = load_checked(path)
    except StackFileError as e:
        for line in e.errors:
            print(line, file=sys.stderr)
        return USAGE
    except BadValue as e:
        say(str(e), "hold validate")
        return USAGE
    hold = f", inside a {spec.hold.device} ticket" if spec.hold else ""
    print(
        f"{path}: stack {spec.name} is valid: {len(spec.units)} unit(s), started in the order "
        f"{', '.join(spec.order())}{hold}"
    )
    return 0


# ---------------------------------------------------------------------- up


def main_up(
    path: str, *, detach: bool = False, run_for: str | None = None, status_fd: int | None = None
) -> int:
    """``hold up``; the exit status (see the README's table)."""
    from hold.config import load
    from supervisor.parse import parse_duration
    from supervisor.stackfile import StackFileError

    try:
        seconds = (
            parse_duration(run_for, what="--for", plain_unit="seconds")
            if run_for is not None
            else None
        )
        cfg = load()  # once for the whole command, passed down
        spec = load_checked(path, cfg)
        sd = _open_sd()
    except StackFileError as e:
        for line in e.errors:
            print(line, file=sys.stderr)
        return USAGE
    except BadValue as e:
        say(str(e))
        return USAGE
    if detach:
        return _detach(path, spec, sd, run_for)
    # Until the stack's own loop takes the stop signals over, one ends this
    # run cleanly: it may be waiting for a ticket or making its trees, and
    # `hold down` of a stack that is starting sends exactly that.
    from hold.interrupt import Interrupted, interrupting

    try:
        with interrupting((signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)):
            return StackRun(spec, sd, cfg, seconds, status_fd).execute()
    except Interrupted as e:
        say(f"stack {spec.name} stopped while starting ({signal.Signals(e.signum).name}); "
            "nothing is left running")  # fmt: skip
        return signalled(e.signum)


class StatusPipe:
    """A detached ``hold up`` tells its starter what it says, then that it is ready,
    as JSON lines on an inherited descriptor; afterwards it talks to its log."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.lock = threading.Lock()
        # Ours alone: a daemon we autostart must not inherit it and keep the
        # starter waiting for an end of file that never comes.
        os.set_inheritable(fd, False)

    def write(self, text: str) -> None:
        with self.lock:
            if self.fd >= 0:
                try:
                    os.write(self.fd, json.dumps({"line": text}).encode() + b"\n")
                    return
                except OSError:
                    self._close()
        print(text, file=sys.stderr, flush=True)

    def ready(self) -> None:
        with self.lock:
            if self.fd >= 0:
                try:
                    os.write(self.fd, b'{"ready": true}\n')
                except OSError:
                    pass
                self._close()

    def close(self) -> None:
        with self.lock:
            if self.fd >= 0:
                self._close()

    def _close(self) -> None:
        os.close(self.fd)
        self.fd = -1


class StackRun:
    """One ``hold up`` in the foreground: daemon, ticket, then :class:`~supervisor.stack.Stack`."""

    def __init__(
        self,
        spec: StackSpec,
        sd: StateDir,
        cfg: Config,
        run_for: float | None,
        status_fd: int | None,
    ) -> None:
        self.spec = spec
        self.sd = sd
        self.cfg = cfg
        self.run_for = run_for
        self.status = StatusPipe(status_fd) if status_fd is not None else None
        self.client: Client | None = None
        self.send_lock = threading.Lock()
        self.leased = False

    def say(self, text: str) -> None:
        if self.status is not None:
            self.status.write(f"hold up: {text}")
        else:
            say(text)

    def execute(self) -> int:
        from supervisor.cgroup import CgroupUnavailable, hierarchy_for
        from supervisor.display import Display
        from supervisor.stack import Stack, StackError

        spec = self.spec
        cfg = self.cfg
        try:
            hierarchy = hierarchy_for(cfg.cgroups)
        except CgroupUnavailable as e:
            self.say(f"cgroups: required, but {e}")
            return USAGE
        display = Display(write=self.status.write, live=False) if self.status else Display()
        stack = Stack(
            spec,
            run_dir=run_dir_of(self.sd, spec.name),
            hierarchy=hierarchy,
            environ=os.environ,
            display=display,
            on_tree_prepared=self._on_tree_prepared,
            on_started=self._on_started,
            run_for=self.run_for,
            on_ready=self.status.ready if self.status else None,
        )
        try:
            stack.prepare()  # refusals (name taken, port taken...) before waiting for a device
        except StackError as e:
            for line in e.errors:
                self.say(line)
            return e.code

        with stack.until_run():  # its lock and logs let go on every way out, unless it ran
            return self._run(stack, cfg)

    def _run(self, stack: Stack, cfg: Config) -> int:
        """The daemon, the ticket, then the stack itself."""
        from hold.client import Client, ConfigMismatch, DaemonUnreachable
        from hold.config import fingerprint
        from supervisor.stack import StackError

        spec = self.spec
        # The daemon before the stack starts: if we have to start one, it must
        # not become our child while we are a subreaper (the stack may make us one).
        try:
            digest = fingerprint(cfg.path) if spec.hold is not None else None
            self.client = Client.with_session(self.sd, config=digest)
        except ConfigMismatch as e:
            self.say(str(e))
            return USAGE
        except (DaemonUnreachable, OSError, TimeoutError) as e:
            if spec.hold is not None:
                self.say(f"cannot reach the ticket daemon: {e}")
                return TOOL
            self.say(
                f"warning: no guardian for this stack ({e}); its units are stopped "
                "only while this process lives"
            )
            self.client = None
        try:
            env: dict[str, str] = {}
            if spec.hold is not None:
                code = self._acquire(env)
                if code is not None:
                    return code
            if self.client is not None:
                stack.extra[self.client.fileno()] = self._on_daemon
            try:
                result = stack.run(extra_env=env)
            except StackError as e:
                for line in e.errors:
                    self.say(line)
                return e.code
            return result.code
        finally:
            if self.client is not None:
                if self.leased:
                    self.client.end()  # the lease is over when `hold up` returns
                self.client.close()
            if self.status is not None:
                self.status.close()  # the starter reads its end of file: not ready

    def _acquire(self, env: dict[str, str]) -> int | None:
        from hold.devices import classes_from_config, parse_device_spec
        from hold.lease import DEFAULT_TTL, acquire_lease

        hold = self.spec.hold
        assert hold is not None
        if self.client is None:
            return TOOL
        cfg = self.cfg
        cls, indices = parse_device_spec(
            hold.device, classes_from_config(cfg.devices, cfg.path), what="device"
        )
        grace = max((u.stop.grace for u in self.spec.units.values()), default=10.0)
        got = acquire_lease(
            self.client,
            self.sd,
            self.say,
            cls=cls,
            indices=indices,
            count=len(indices) if indices else 1,
            label=hold.label or self.spec.name,
            ttl=hold.ttl or DEFAULT_TTL,
            grace=grace,
            wait=True,
            wait_timeout=None,
            tree=None,
            env=env,
        )
        if isinstance(got, int):
            return got
        self.leased = True
        self.say(
            f"inside lease {got.lease} ({env.get('HOLD_DEVICES')}) until "
            f"{time.strftime('%H:%M:%S', time.localtime(got.expires))}"
        )
        return None

    # Hooks called by the stack -----------------------------------------------

    def _on_tree_prepared(self, unit: str, tree_id: str, leaf: Leaf | None) -> None:
        from hold.client import DaemonUnreachable
        from hold.protocol import ProtocolError
        from supervisor.stack import StackError

        client = self.client
        if client is None:
            return
        try:
            # The unit's own grace: the daemon gives it when it stops the tree for us.
            grace = self.spec.units[unit].stop.grace
            ans = client.request_renewing(
                {
                    "op": "tree",
                    "tree_id": tree_id,
                    "leaf": leaf.path if leaf else None,
                    "grace": grace,
                }
            )
        except (OSError, TimeoutError, DaemonUnreachable, ProtocolError) as e:
            raise StackError(
                [f"lost the ticket daemon while registering {unit}: {e}"], TOOL
            ) from None
        if ans.get("ev") != "ok":
            msg = f"the daemon refused to guard unit {unit}: {ans.get('error')}"
            if self.spec.hold is not None:
                raise StackError([msg], TOOL)
            self.say(f"warning: {msg}")

    def _on_started(self, unit: str, tree: Tree) -> None:
        client = self.client
        if client is None or tree.root is None:
            return
        with self.send_lock:  # called from several start threads at once
            try:
                client.send({"op": "root", "tree_id": tree.tree_id, "pid": tree.root.pid})
            except OSError:
                pass

    def _on_daemon(self, fd: int) -> Cause | None:
        from hold.lease import daemon_event
        from supervisor.cause import Cause

        assert self.client is not None
        ev = daemon_event(self.client, self.say)
        if ev is None:
            return None
        kind, detail = ev
        code = {"expired": EXPIRED, "released": OK}.get(kind, TOOL)
        return Cause(kind, detail, code)


def _detach(path: str, spec: StackSpec, sd: StateDir, run_for: str | None) -> int:
    """Start ``hold up`` in the background; return once it is up (0) or with its failure."""
    from supervisor.safefile import UnsafePath, ensure_dir, open_for_append

    run_dir = run_dir_of(sd, spec.name)
    log_path = os.path.join(run_dir, "supervisor.log")
    try:  # never through a link planted at the directories or the log
        ensure_dir(os.path.dirname(run_dir), owned=False)
        ensure_dir(run_dir)
        log = open_for_append(log_path)
    except UnsafePath as e:
        say(str(e))
        return USAGE
    r, w = os.pipe()
    argv = [sys.executable, "-m", "hold", "up", "--status-fd", str(w)]
    if run_for is not None:
        argv += ["--for", run_for]
    argv.append(os.path.abspath(path))
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            pass_fds=(w,),
            start_new_session=True,
        )
    finally:
        os.close(log)
        os.close(w)
    with os.fdopen(r, "rb") as f:
        for raw in f:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            if msg.get("ready"):
                n = spec.name
                say(
                    f"stack {n} is up in the background (pid {proc.pid}); "
                    f"hold ps {n}, hold logs {n} UNIT, hold down {n}"
                )
                # It runs on without us: forget it without waiting (it is not ours to reap).
                proc.returncode = 0
                return 0
            if "line" in msg:
                print(msg["line"], file=sys.stderr, flush=True)
    return proc.wait()


# ---------------------------------------------------------------------- ps, logs, down, restart


def _request(name: str, msg: dict[str, Any], prog: str, **kw: Any) -> dict[str, Any] | None:
    """Ask the running stack ``name``; None if it is not running."""
    from supervisor.stackctl import request

    sd = _open_sd()
    sock = os.path.join(run_dir_of(sd, name), "control.sock")
    try:
        return request(sock, msg, **kw)
    except (FileNotFoundError, ConnectionRefusedError):
        return None


def _running_stacks() -> list[dict[str, Any]]:
    from supervisor.stackctl import request

    sd = _open_sd()
    base = sd.stacks()
    out = []
    for name in sorted(os.listdir(base)):
        try:
            ans = request(os.path.join(base, name, "control.sock"), {"op": "ps"}, timeout=5)
        except (OSError, TimeoutError, ValueError):
            continue
        out.append(ans)
    return out


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def main_ps(name: str | None, as_json: bool) -> int:
    try:
        if name is None:
            stacks = _running_stacks()
        else:
            ans = _request(name, {"op": "ps"}, "hold ps", timeout=5)
            stacks = [ans] if ans is not None else []
    except BadValue as e:
        say(str(e), "hold ps")
        return USAGE
    if as_json:
        print(json.dumps(stacks if name is None else (stacks[0] if stacks else None), indent=2))
        return 0 if stacks or name is None else NO
    if name is not None and not stacks:
        say(f"stack {name} is not running", "hold ps")
        return NO
    if name is None:
        if not stacks:
            print("no stack is running")
            return 0
        rows = [["STACK", "PID", "UNITS", "READY", "UPTIME", "FILE"]]
        for s in stacks:
            ready = sum(1 for u in s["units"] if u["state"] == "ready")
            rows.append(
                [
                    s["stack"],
                    str(s["pid"]),
                    str(len(s["units"])),
                    str(ready),
                    format_duration(s["uptime"]),
                    s["file"],
                ]
            )
        print(_table(rows))
        return 0
    s = stacks[0]
    print(
        f"stack {s['stack']} (pid {s['pid']}, {s['phase']}, up {format_duration(s['uptime'])}) "
        f"from {s['file']}"
    )
    rows = [["UNIT", "STATE", "PID", "PORT", "RESTARTS", "UPTIME", "CPUS", "READY"]]
    for u in s["units"]:
        rows.append(
            [
                u["unit"],
                u["state"],
                str(u["pid"] or "-"),
                str(u["port"] or "-"),
                str(u["restarts"]),
                format_duration(u["uptime"]),
                u["cpus"] or "-",
                u["ready"],
            ]
        )
    print(_table(rows))
    calls = s.get("calls") or []
    if calls:
        print()
        rows = [["CALL", "UNIT", "STATE", "PID", "RUNNING", "QUEUED", "CPUS"]]
        for c in calls:
            rows.append(
                [
                    c["call"],
                    c["unit"],
                    c["state"],
                    str(c["pid"] or "-"),
                    format_duration(c["running_s"]),
                    format_duration(c["queued_s"]),
                    c["cpus"],
                ]
            )
        print(_table(rows))
    return 0


def main_logs(name: str, unit: str, follow: bool, lines: int | None) -> int:
    from supervisor.unitlog import follow as follow_log
    from supervisor.unitlog import tail_lines

    try:
        sd = _open_sd()
    except BadValue as e:
        say(str(e), "hold logs")
        return USAGE
    run_dir = run_dir_of(sd, name)
    logs = os.path.join(run_dir, "logs")
    if not os.path.isdir(logs):
        say(f"no stack {name!r} has run here (nothing in {os.path.dirname(run_dir)})", "hold logs")
        return USAGE
    path = os.path.join(logs, f"{unit}.log")
    if "/" in unit or not os.path.isfile(path):
        units = sorted(f[:-4] for f in os.listdir(logs) if f.endswith(".log"))
        say(f"no unit {unit!r} in stack {name} (units: {', '.join(units)})", "hold logs")
        return USAGE
    text, ino, offset = tail_lines(path, lines)
    for line in text:
        print(line)
    sys.stdout.flush()
    if follow:
        sock = os.path.join(run_dir, "control.sock")

        def running() -> bool:
            import socket

            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                try:
                    s.connect(sock)
                except OSError:
                    return False
            return True

        try:
            for line in follow_log(path, ino, offset, keep_going=running):
                print(line, flush=True)
        except KeyboardInterrupt:
            return 0
    return 0


def main_down(name: str) -> int:
    def progress(msg: dict[str, Any]) -> None:
        if msg.get("ev") == "stopping":
            say(f"stopping stack {name}...", "hold down")

    try:
        # The stop takes up to the units' grace periods; each message resets the wait.
        ans = _request(name, {"op": "down"}, "hold down", timeout=3600, on_message=progress)
    except ConnectionResetError:
        ans = {"ev": "stopped", "code": 0, "survivors": []}  # it was already stopping
    except BadValue as e:
        say(str(e), "hold down")
        return USAGE
    if ans is None:
        return _down_starting(name)
    if ans.get("ev") == "error":
        say(str(ans.get("error")), "hold down")
        return int(ans.get("code", USAGE))
    # Return only once the stack's process has finished (it holds its lock
    # until then): after a reset connection we have no word of the stop, and
    # "stopped" must never be said while a unit may still be running.
    if not _wait_unlocked(os.path.join(run_dir_of(_open_sd(), name), "stack.lock"), 3600):
        say(f"stack {name} is still stopping after an hour; see hold ps {name}", "hold down")
        return TOOL
    for s in ans.get("survivors") or []:
        say(f"survivor pid {s['pid']} ({s['found_by']}): {s['command']}", "hold down")
    code = int(ans.get("code", 0))
    say(f"stack {name} stopped" + (" (with survivors)" if code == SURVIVORS else ""), "hold down")
    return SURVIVORS if code == SURVIVORS else OK


def _down_starting(name: str) -> int:
    """``hold down`` of a stack with no control socket: not running, or starting
    (its lock is held: waiting for a ticket, making its trees). A starting stack
    is stopped like a running one: its process is told (SIGTERM) and waited for."""
    lock = os.path.join(run_dir_of(_open_sd(), name), "stack.lock")
    pid = _lock_holder(lock)
    if pid is None:
        say(f"stack {name} is not running", "hold down")
        return 0
    say(f"stack {name} is starting (pid {pid}); stopping it", "hold down")
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    except PermissionError:
        say(f"stack {name} (pid {pid}) is not yours to stop", "hold down")
        return USAGE
    if not _wait_unlocked(lock, 3600):
        say(f"stack {name} is still stopping after an hour; see hold ps {name}", "hold down")
        return TOOL
    say(f"stack {name} stopped", "hold down")
    return 0


def _lock_holder(path: str) -> int | None:
    """The pid written in a held stack lock; None if nobody holds it."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None  # nobody holds it (closing fd lets go at once)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return int(text) if text.isdigit() else None
    finally:
        os.close(fd)


def _wait_unlocked(path: str, timeout: float) -> bool:
    """True once nobody holds ``path``'s flock (or it does not exist)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return True  # closing fd below lets go at once
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.002)
    finally:
        os.close(fd)


def main_restart(name: str, unit: str) -> int:
    try:
        ans = _request(name, {"op": "restart", "unit": unit}, "hold restart", timeout=3600)
    except BadValue as e:
        say(str(e), "hold restart")
        return USAGE
    if ans is None:
        say(f"stack {name} is not running", "hold restart")
        return NO
    if ans.get("ev") == "error":
        say(str(ans.get("error")), "hold restart")
        return int(ans.get("code", UNIT_FAILED))
    say(f"{unit} restarted (pid {ans.get('pid')})", "hold restart")
    return 0
