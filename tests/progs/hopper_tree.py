"""A process that never stays the same process: it forks and its parent exits, over and over.

Usage: hopper_tree.py DEVICE_FILE PORT_FILE READY_FILE

The main process ignores SIGTERM and starts the hopper, then sleeps. The
hopper ignores SIGTERM too; every few milliseconds it forks, and the parent
exits, so its pid keeps changing: a list of pids taken at one moment and
killed the next always misses the current one. Only stopping it from forking
(SIGSTOP, or cgroup.kill) ends it. READY_FILE gets "main PID" and "hopper PID"
(the first generation). PORT_FILE and DEVICE_FILE are not used.
"""

import os
import signal
import sys
import time

ready = sys.argv[3]
signal.signal(signal.SIGTERM, signal.SIG_IGN)


def note(what):
    with open(ready, "a") as f:
        f.write(f"{what} {os.getpid()}\n")


if os.fork() == 0:
    note("hopper")
    while True:
        time.sleep(0.005)
        if os.fork() > 0:
            os._exit(0)

note("main")
while True:
    time.sleep(1)
