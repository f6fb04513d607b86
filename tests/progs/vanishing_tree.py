"""A command whose descendant leaves every trace of the tree that a walk can follow.

Usage: vanishing_tree.py DIR

The main process forks; the child calls ``setsid`` and forks again, and exits
(so the grandchild is in no session or group of the tree, and its parent is
gone); the grandchild ignores INT, TERM, HUP and QUIT and execs ``sleep 600``
with an empty environment (so it no longer carries HOLD_TREE). Only a cgroup
leaf still knows it. DIR/pids gets "ROLE PID" for ``main`` and ``escapee``
(the latter before the exec, which keeps the pid). The main process then
sleeps until it is killed.
"""

import os
import signal
import sys
import time

base = sys.argv[1]


def note(role: str) -> None:
    fd = os.open(os.path.join(base, "pids"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"{role} {os.getpid()}\n".encode())
    os.close(fd)


if os.fork() == 0:
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(s, signal.SIG_IGN)  # an ignored signal stays ignored across exec
    note("escapee")
    os.execve("/bin/sleep", ["sleep", "600"], {})

os.wait()
note("main")
while True:
    time.sleep(1)
