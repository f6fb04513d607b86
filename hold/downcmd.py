"""``hold down`` and ``hold restart``: asking a running stack to stop, or to restart
a unit; ``hold down`` of a stack that is still starting (no control socket yet,
its lock held) signals its process. Both return only once it is done: ``hold down``
as soon as the stack answers ``stopped`` (sent once the survivor check is done and
the stack has let go of its name), or, with no answer, once its lock is free.

No such stack running: exit 1 (``NO``, as ``hold ps``, ``logs`` and ``call``),
with the closest name of the stacks that exist; but ``hold down`` of a stack that
has run here and is stopped already is 0, as ``systemctl stop`` of an inactive
unit: what was asked holds, and a script's cleanup may say it twice."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from hold.stackdir import ask, no_such_stack, open_sd, run_dir_of, say
from supervisor.exitcodes import NO, OK, SURVIVORS, TOOL, UNIT_FAILED, USAGE
from supervisor.parse import BadValue


def main_down(name: str) -> int:
    def progress(msg: dict[str, Any]) -> None:
        if msg.get("ev") == "stopping":
            say(f"stopping stack {name}...", "hold down")

    heard = True
    try:
        # The stop takes up to the units' grace periods; each message resets the wait.
        ans = ask(name, {"op": "down"}, timeout=3600, on_message=progress)
    except ConnectionResetError:
        ans = {"ev": "stopped", "code": 0, "survivors": []}  # it was already stopping
        heard = False
    except BadValue as e:
        say(str(e), "hold down")
        return USAGE
    if ans is None:
        return _down_starting(name)
    if ans.get("ev") == "error":
        say(str(ans.get("error")), "hold down")
        return int(ans.get("code", USAGE))
    # Its answer comes once every unit is proven gone and the name is free. After
    # a reset connection we have no word of the stop, and "stopped" must never be
    # said while a unit may still be running: then its lock says when it is over.
    lock = os.path.join(run_dir_of(open_sd(), name), "stack.lock")
    if not heard and not _wait_unlocked(lock, 3600):
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
    run_dir = run_dir_of(open_sd(), name)
    lock = os.path.join(run_dir, "stack.lock")
    pid = _lock_holder(lock)
    if pid is None:
        # As systemctl stop: a stack that has run here and is stopped is already
        # what was asked (0); a name that never ran here is a mistake (1).
        if not os.path.isdir(run_dir):
            no_such_stack(name, "hold down", ever=True)
            return NO
        say(f"stack {name} is not running (nothing to stop)", "hold down")
        return OK
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
    """True once nobody holds ``path``'s flock (or it does not exist). Woken by the
    kernel when the holder lets go (a blocking flock in a thread), not by polling."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True
    got = threading.Event()

    def take() -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            got.set()
        except OSError:
            pass

    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        os.close(fd)  # free already: closing lets go at once
        return True
    except BlockingIOError:
        pass
    # The thread may outlive a timeout (blocked in flock): a daemon thread, and its
    # descriptor left to the process's exit.
    threading.Thread(target=take, name="wait-unlocked", daemon=True).start()
    if got.wait(timeout):
        os.close(fd)
        return True
    return False


def main_restart(name: str, unit: str) -> int:
    try:
        ans = ask(name, {"op": "restart", "unit": unit}, timeout=3600)
    except BadValue as e:
        say(str(e), "hold restart")
        return USAGE
    if ans is None:
        no_such_stack(name, "hold restart")
        return NO
    if ans.get("ev") == "error":
        say(str(ans.get("error")), "hold restart")
        return int(ans.get("code", UNIT_FAILED))
    say(f"{unit} restarted (pid {ans.get('pid')})", "hold restart")
    return 0
