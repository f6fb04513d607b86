"""A tree two of whose processes leave its cgroup (as root may), for the stop tests.

Usage: leaver_tree.py DEVICE_FILE PORT_FILE READY_FILE --to CGROUP_DIR

* the main process ignores SIGTERM and sleeps;
* the "session leaver" double-forks (its parent exits, so it descends from
  nobody of the tree), moves itself into CGROUP_DIR by writing its pid to
  its ``cgroup.procs``, and execs ``sleep`` with an empty environment: it
  keeps the tree's group and session, and nothing else (no HOLD_TREE);
* the "marker leaver" double-forks with a ``setsid`` between (own session
  and group), moves itself into CGROUP_DIR, and keeps HOLD_TREE.

Both ignore SIGTERM (an ignored signal stays ignored across exec).
READY_FILE gets "main PID", "session-leaver PID", "marker-leaver PID", each
once the process is in place. DEVICE_FILE and PORT_FILE are not used.
"""

import os
import signal
import sys
import time

ready = sys.argv[3]
away = sys.argv[sys.argv.index("--to") + 1]
signal.signal(signal.SIGTERM, signal.SIG_IGN)


def note(what):
    with open(ready, "a") as f:
        f.write(f"{what} {os.getpid()}\n")


def leave():
    with open(os.path.join(away, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def double_fork(setsid):
    """True in the grandchild (the middle process exits at once); False in the caller."""
    if os.fork() > 0:
        os.wait()
        return False
    if setsid:
        os.setsid()
    if os.fork() > 0:
        os._exit(0)
    return True


if double_fork(setsid=False):
    leave()
    note("session-leaver")
    os.execve("/bin/sleep", ["sleep", "600"], {})

if double_fork(setsid=True):
    leave()
    note("marker-leaver")
    while True:
        time.sleep(1)

note("main")
while True:
    time.sleep(1)
