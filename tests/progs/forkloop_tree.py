"""A tree that is nothing but fork loops: no process of it lives for long.

Usage: forkloop_tree.py DEVICE_FILE PORT_FILE READY_FILE [--loops N] [--setsid]
                        [--interval SECONDS]

The main process starts N loops (default 1) and exits at once, so the tree's
root is gone before any stop. Each loop ignores SIGTERM; every INTERVAL
seconds (default 0.001) it forks, and the parent exits: a process of the tree
lives about a millisecond, so a walk of /proc that lists the pids and then
reads them one by one often finds the listed one gone and the new one
unlisted. ``--setsid``: every new generation starts a session of its own, so
neither the tree's group nor its session holds it (nor can ``kill(-pgid)``
stop it).

Every generation appends one byte to DEVICE_FILE (opened O_APPEND once, by
the main process): the file grows for exactly as long as a loop runs, which
is how a test tells, without walking /proc itself, that the loops have ended.
READY_FILE gets "main PID" and "loop PID" (each loop's first generation).
PORT_FILE is not used.
"""

import os
import signal
import sys
import time

device, _port_file, ready = sys.argv[1:4]
opts = sys.argv[4:]
loops = int(opts[opts.index("--loops") + 1]) if "--loops" in opts else 1
interval = float(opts[opts.index("--interval") + 1]) if "--interval" in opts else 0.001
setsid = "--setsid" in opts
signal.signal(signal.SIGTERM, signal.SIG_IGN)
beat = os.open(device, os.O_WRONLY | os.O_APPEND)


def note(what):
    with open(ready, "a") as f:
        f.write(f"{what} {os.getpid()}\n")


def loop():
    note("loop")
    while True:
        os.write(beat, b".")
        time.sleep(interval)
        if os.fork() > 0:
            os._exit(0)
        if setsid:
            os.setsid()


for _ in range(loops):
    if os.fork() == 0:
        loop()

note("main")
os._exit(0)
