"""A process tree built to be hard to stop (used by the tests and the benchmark).

Usage: nasty_tree.py DEVICE_FILE PORT_FILE READY_FILE [--forkers N] [--sleepers N]

* the main process ignores SIGTERM;
* a child ignores SIGTERM too;
* a grandchild double-forks and calls setsid (an escapee: no longer in our
  session or group, and re-parented away from us), holds DEVICE_FILE open and
  listens on a TCP port it writes to PORT_FILE;
* N "forkers" keep forking short-lived children for as long as they live;
* N sleepers, also ignoring TERM.
READY_FILE gets one line per process once everything is in place.
"""

import os
import signal
import socket
import sys
import time

device, port_file, ready = sys.argv[1:4]
forkers = int(sys.argv[sys.argv.index("--forkers") + 1]) if "--forkers" in sys.argv else 1
sleepers = int(sys.argv[sys.argv.index("--sleepers") + 1]) if "--sleepers" in sys.argv else 0

signal.signal(signal.SIGTERM, signal.SIG_IGN)


def note(what):
    with open(ready, "a") as f:
        f.write(f"{what} {os.getpid()}\n")


def escapee():
    # First fork already happened; now setsid and fork again (double fork).
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fd = os.open(device, os.O_RDWR)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    with open(port_file + ".tmp", "w") as f:
        f.write(str(s.getsockname()[1]))
    os.rename(port_file + ".tmp", port_file)
    note("escapee")
    while True:
        time.sleep(1)
    os.close(fd)


def forker():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    note("forker")
    while True:
        pid = os.fork()
        if pid == 0:
            time.sleep(0.05)
            os._exit(0)
        os.waitpid(pid, 0)


pid = os.fork()
if pid == 0:
    # The child: ignores TERM, starts the escapee, then sleeps.
    if os.fork() == 0:
        escapee()
    note("child")
    while True:
        time.sleep(1)

for _ in range(forkers):
    if os.fork() == 0:
        forker()
for _ in range(sleepers):
    if os.fork() == 0:
        note("sleeper")
        while True:
            time.sleep(1)
note("main")
while True:
    time.sleep(1)
