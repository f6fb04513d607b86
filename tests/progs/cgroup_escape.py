"""A process that leaves its tree every way root can at once (issue 24): it moves
itself into a cgroup it makes, calls ``setsid``, re-executes itself with an empty
environment (no HOLD_TREE), ignores SIGTERM and sleeps.

Usage: cgroup_escape.py MODE CGROUP_DIR READY_FILE

MODE ``self``: the root itself escapes. MODE ``child``: the root forks the
escapee and waits (ignoring SIGTERM too: it is killed, and the escapee orphaned).
READY_FILE gets "escaped PID" once the escapee is in CGROUP_DIR, in its own
session, with its environment cleared.
"""

import os
import signal
import sys
import time

mode, away, ready = sys.argv[1], sys.argv[2], sys.argv[3]
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stays ignored across exec

if mode == "escaped":
    assert "HOLD_TREE" not in os.environ and os.getsid(0) == os.getpid()
    with open(ready, "a") as f:
        f.write(f"escaped {os.getpid()}\n")
    time.sleep(300)
    sys.exit(0)


def escape() -> None:
    os.makedirs(away, exist_ok=True)
    with open(os.path.join(away, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    try:
        os.setsid()
    except PermissionError:
        pass  # the root of `hold run`: a session leader already, its own session
    os.execve(sys.executable, [sys.executable, sys.argv[0], "escaped", away, ready], {})


if mode == "self":
    escape()
if os.fork() == 0:
    escape()
time.sleep(300)
