"""A tree that shuts down cleanly when asked (the counterpart of nasty_tree.py).

Usage: polite_tree.py DEVICE_FILE PORT_FILE READY_FILE [--exit-at-once]

* the main process keeps the default SIGTERM action (dies at once);
* a child takes a moment to clean up on SIGTERM, then exits 0;
* a grandchild double-forks and calls setsid (an escapee), holds DEVICE_FILE
  open and listens on a TCP port (written to PORT_FILE); on SIGTERM it closes
  both, writes "bye escapee PID" to READY_FILE and exits 0.
READY_FILE gets one line per process once everything is in place.
With --exit-at-once it starts nothing and exits 0 (a tree that is already gone).
"""

import os
import signal
import socket
import sys
import time

device, port_file, ready = sys.argv[1:4]
if "--exit-at-once" in sys.argv:
    sys.exit(0)


def note(what):
    with open(ready, "a") as f:
        f.write(f"{what} {os.getpid()}\n")


def leave_after(seconds, last_words=None):
    def handler(signum, frame):
        time.sleep(seconds)
        if last_words:
            note(last_words)
        os._exit(0)

    signal.signal(signal.SIGTERM, handler)


def escapee():
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    fd = os.open(device, os.O_RDWR)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    with open(port_file + ".tmp", "w") as f:
        f.write(str(s.getsockname()[1]))
    os.rename(port_file + ".tmp", port_file)

    def handler(signum, frame):
        s.close()
        os.close(fd)
        time.sleep(0.1)
        note("bye escapee")
        os._exit(0)

    signal.signal(signal.SIGTERM, handler)
    note("escapee")
    while True:
        time.sleep(1)


if os.fork() == 0:
    if os.fork() == 0:
        escapee()
    leave_after(0.1)
    note("child")
    while True:
        time.sleep(1)

note("main")
while True:
    time.sleep(1)
