"""Autostart: a client that finds no daemon takes ``start.lock`` (so only one
client starts one), starts ``hold daemon --detach`` and waits for the socket
to answer, with a deadline. The daemon refuses to run twice for one state
directory, so a race past the lock still leaves exactly one.

Apart from :mod:`hold.client.connection` (which loads it only when no daemon
answered); it probes the socket through :mod:`hold.client.reach`.
"""

from __future__ import annotations

import os
import sys
import time

from hold.client.reach import DaemonUnreachable, UnsafeStateFile, try_connect
from hold.statedir import StateDir
from hold_supervisor.safefile import UnsafePath, check_file, open_for_append, open_for_read
from hold_supervisor.spawn.child import close_actions


def start_daemon(sd: StateDir, timeout: float) -> None:
    """Start a daemon for ``sd`` unless one answers; wait until it does (or raise)."""
    import filelock  # lazy: only to start one; the daemon imports this module too

    deadline = time.monotonic() + timeout
    try:
        with filelock.FileLock(sd.start_lock, timeout=timeout):
            probe = try_connect(sd.socket, sd)
            if probe is not None:
                probe.close()
                return
            _check_state_files(sd)
            started = _spawn_daemon(sd, timeout)
            while time.monotonic() < deadline:
                probe = try_connect(sd.socket, sd)
                if probe is not None:
                    probe.close()
                    _say_started(sd)
                    return
                if not started:
                    break  # it said it failed: no point waiting out the deadline
                time.sleep(0.01)
        if not started:
            raise DaemonUnreachable(
                f"the ticket daemon for {sd.path} failed to start: {_last_line(sd.log)} "
                f"(its log: {sd.log}; `hold daemon` in the foreground says the same)"
            )
    except filelock.Timeout:
        pass
    raise DaemonUnreachable(
        f"started a daemon for {sd.path}, but it did not answer within {timeout:g}s (see {sd.log})"
    )


IDLE_EXIT = 600.0  # seconds an autostarted daemon waits with nothing to do, then leaves


def _say_started(sd: StateDir) -> None:
    """At a terminal, one line: a daemon now runs that the person did not start by
    hand (as root, the machine's: in /run/hold), and when it goes (issue 25)."""
    if not sys.stderr.isatty():
        return
    pid = sd.daemon_pid()
    prog = os.path.basename(sys.argv[0])
    print(
        f"{prog if prog in ('hold', 'npu-hold', 'gpu-hold') else 'hold'}: started the "
        f"ticket daemon for {sd.path} (pid {pid if pid else '?'}); it "
        f"leaves after {IDLE_EXIT / 60:g} minutes with nothing to do",
        file=sys.stderr,
        flush=True,
    )


def _check_state_files(sd: StateDir) -> None:
    """Refuse (before a daemon is spawned, so that the user hears why) the files a
    daemon would write through or read: its log (our descriptor becomes its
    stderr), its lock (emptied and written) and its state (read at start)."""
    try:
        check_file(sd.log)
        check_file(sd.lock)
        check_file(sd.state, "read")
    except UnsafePath as e:
        raise UnsafeStateFile(f"no ticket daemon started: {e}", e.path) from None


def _last_line(path: str) -> str:
    try:
        fd = open_for_read(path, owned=False)
    except (OSError, UnsafePath):
        return "(no log)"
    with os.fdopen(fd, "rb") as f:
        f.seek(max(0, os.fstat(fd).st_size - 2000))
        lines = f.read().decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else "(nothing in its log)"


def _spawn_daemon(sd: StateDir, timeout: float) -> bool:
    """Start ``hold daemon --detach``; True once it says it serves, False if it failed."""
    # Not through hold_supervisor.spawn.child: the daemon must carry no HOLD_TREE marker
    # (it would be stopped with the tree of whoever started it), and it keeps
    # the variables that locate its state and configuration.
    # Nor the caller's NOTIFY_SOCKET: under systemd, `hold up` is the service
    # that says READY=1, not a daemon it happened to start.
    env = {k: v for k, v in os.environ.items() if k not in ("HOLD_TREE", "NOTIFY_SOCKET")}
    env["HOLD_STATE_DIR"] = sd.path
    try:
        log = open_for_append(sd.log)  # the daemon's stderr: never through a planted link
    except UnsafePath as e:
        raise UnsafeStateFile(f"no ticket daemon started: {e}", e.path) from None
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    # A client that re-attaches while it runs a command without a cgroup is a
    # child subreaper: the daemon, orphaned by --detach, would be re-parented
    # to it, taken for an adopted orphan of the command's tree, and stopped
    # with it. So it is no subreaper until the daemon has left (an orphan of
    # the tree in that instant is still found by its marker).
    # (Imported here: the daemon imports this module, for IDLE_EXIT, and needs no reaper.)
    from hold_supervisor.proc.reaper import become_subreaper, is_subreaper

    was_subreaper = is_subreaper()
    if was_subreaper:
        become_subreaper(False)
    try:
        pid = os.posix_spawn(
            sys.executable,
            [sys.executable, "-m", "hold", "daemon", "--detach"],
            env,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, devnull, 0),
                (os.POSIX_SPAWN_DUP2, devnull, 1),
                (os.POSIX_SPAWN_DUP2, log, 2),
                # Nothing else of ours: the daemon outlives us, and a pipe of
                # ours held open by it would never see its end of file.
                *close_actions({log, devnull}),
            ],
            setsid=True,
        )
        # The first process forks the daemon, waits until it serves (or
        # fails, or `timeout` passes), says which by its exit status, and is
        # reaped here; the daemon itself is orphaned and nobody's zombie.
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status) in (0, 3)  # 3: another one serves
    finally:
        os.close(log)
        os.close(devnull)
        if was_subreaper:
            become_subreaper(True)
