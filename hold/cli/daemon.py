"""``hold daemon``, the command's own parts: ``--install``, ``--reload``, and what a
daemon started in the foreground says before it serves.

In the foreground (not ``--detach``) the daemon first says on stderr where it
serves (its socket, and which arbiter it is: the machine's system daemon or
one user's own) and what it read (the configuration file, each class and its
devices), then echoes each event of its log there as a readable line
(structlog's console renderer, in colour at a terminal only); the log file
itself stays JSON lines (:class:`hold.daemon.records.Log`).
"""

from __future__ import annotations

import os
import pwd
import select
import subprocess
import sys
from collections.abc import Iterator
from typing import TextIO

from hold.client.autostart import IDLE_EXIT
from hold.config import Config, load
from hold.daemon.devlock import lock_dir
from hold.daemon.records import Log
from hold.daemon.server import Daemon
from hold.daemon.tokens import UnsafePath
from hold.devices.classes import DeviceClass, classes_from_config
from hold.errors import HoldError
from hold.protocol import Ev, Op
from hold.statedir import SYSTEM_DIR, StateDir, open_state_dir
from hold_supervisor.exitcodes import TOOL, USAGE
from hold_supervisor.parse import BadValue, parse_duration

PROG = "hold daemon"


class DaemonCommandError(HoldError):
    """What ``--install`` / ``--reload`` could not do, and the exit status for it."""

    def __init__(self, msg: str, code: int) -> None:
        super().__init__(msg)
        self.exit_code = code


def banner(sd: StateDir, cfg: Config, classes: dict[str, DeviceClass], system: bool) -> list[str]:
    """Where this daemon serves and what it read, a line each."""
    user = pwd.getpwuid(os.geteuid()).pw_name
    if system:
        who = "the system arbiter: every user of this machine"
    elif cfg.shared_state:
        who = f"a shared arbiter run by {user} (state: {{shared: true}})"
    else:
        who = f"a per-user arbiter: {user}'s own"
    lines = [
        f"socket {sd.socket} ({who}), pid {os.getpid()}",
        f"configuration {cfg.path}"
        if cfg.path
        else "configuration: the embedded defaults (no file)",
        f"busy devices: {cfg.busy_devices}; cgroups: {cfg.cgroups}",
    ]
    for name, c in sorted(classes.items()):
        lines.append(f"class {name}: {_devices(name, c)}")
    return [f"{PROG}: {line}" for line in lines]


def _devices(name: str, c: DeviceClass) -> str:
    nodes = c.device_nodes()
    if not nodes:
        return "no device nodes here (one logical device)"
    text = ", ".join(f"{name}:{i} {path}" for i, path in enumerate(nodes))
    if c.shared_nodes:
        text += f"; shared nodes {' '.join(c.shared_nodes)}"
    return text


def announce(
    sd: StateDir,
    cfg: Config,
    classes: dict[str, DeviceClass],
    system: bool,
    stream: TextIO = sys.stderr,
) -> None:
    """In the foreground: the banner on ``stream``, and every log event after it."""
    print("\n".join(banner(sd, cfg, classes, system)), file=stream, flush=True)
    Log.console = stream


def install(unit_dir: str, start: bool) -> Iterator[str]:
    """``--install``: the lines to say, as each step is done; :class:`DaemonCommandError`
    for a step that could not be."""
    # lazy: --install only; off the autostarted daemon's memory
    from hold.daemon.sysunit import install as install_unit

    if start and os.geteuid() != 0:
        why = "the system daemon is installed by root (or use --no-start --unit-dir DIR"
        raise DaemonCommandError(f"--install: {why} to write the unit only)", USAGE)
    try:
        yield from install_unit(unit_dir, start)
    except UnsafePath as e:
        raise DaemonCommandError(f"--install: {e}", USAGE) from None
    except (OSError, subprocess.CalledProcessError) as e:
        raise DaemonCommandError(f"--install: {e}", TOOL) from None


def reload(sd: StateDir) -> str:
    """``--reload``: what the running daemon answered; :class:`DaemonCommandError` if not."""
    # lazy: --reload only; the client is no part of a daemon's memory
    from hold.client.connection import Client, DaemonUnreachable

    try:
        ans = Client.connect(sd, autostart=False).request({"op": Op.RELOAD})
    except (DaemonUnreachable, OSError, TimeoutError) as e:
        raise DaemonCommandError(f"--reload: {e}", TOOL) from None
    if ans.get("ev") != Ev.RELOADED:
        raise DaemonCommandError(f"--reload: {ans.get('error')}", int(ans.get("code", TOOL)))
    classes = ", ".join(f"{k} ({v})" for k, v in sorted(ans["classes"].items()))
    return f"reloaded {ans.get('config') or 'the defaults'}: {classes}"


def serve(*, detach: bool, idle_exit: str | None = None, system: bool = False) -> int:
    """``hold daemon``: serve the state directory until SIGTERM; the exit status.

    ``detach`` (what autostart runs, without click: its imports are ~4 MB of
    an idle daemon's memory and part of the first ``npu-hold``'s wait): fork,
    and let the first process exit once the daemon serves (0), or another
    daemon does (3), or it failed (1).
    """
    try:
        idle: float | None = IDLE_EXIT if detach else None
        if idle_exit is not None:
            idle = parse_duration(idle_exit, what="--idle-exit", plain_unit="seconds")
        cfg = load()
        classes = classes_from_config(cfg.devices, cfg.path)
        lock_dir()  # before the fork: a bad one is the client's message, not a grant's
        if system:
            if os.geteuid() != 0:
                raise DaemonCommandError(
                    "--system: the system daemon runs as root (it serves every user)", USAGE
                )
            if os.environ.get("HOLD_STATE_DIR", SYSTEM_DIR) != SYSTEM_DIR:
                raise DaemonCommandError(
                    f"--system: the system daemon's state directory is {SYSTEM_DIR} "
                    "(unset HOLD_STATE_DIR)",
                    USAGE,
                )
        sd = open_state_dir(shared=cfg.shared_state or system)
    except BadValue as e:
        raise DaemonCommandError(str(e), USAGE) from None
    ready_fd = None
    if detach:
        # The first process waits until the daemon serves and says so by its
        # exit status (0: serving), so a client that started it learns of a
        # failure at once instead of at the end of its deadline.
        r, w = os.pipe()
        if os.fork() > 0:
            os.close(w)

            said = os.read(r, 1) if select.select([r], [], [], 30.0)[0] else b""
            os._exit({b"1": 0, b"2": 3}.get(said, 1))  # 3: another daemon serves
        os.close(r)
        ready_fd = w
    else:
        announce(sd, cfg, classes, system)
    daemon = Daemon(
        sd,
        classes,
        shared=cfg.shared_state,
        home_tokens=cfg.home_tokens,
        grant_busy=cfg.busy_devices,
        unreadable=cfg.unreadable_processes,
        limits=(cfg.limit_connections, cfg.limit_queued),
        idle_exit=idle,
        system=system,
        config_path=cfg.path,
    )
    return daemon.serve(ready_fd=ready_fd)
