"""A command for the ``hold run`` exit-path tests: a small tree with an escapee.

Usage: run_tree.py DIR [--exit N | --kill N | --stay] [--handle]

* a child that ignores INT, TERM, HUP and QUIT and sleeps;
* an escapee (the child forks, the grandchild calls setsid and forks again),
  also ignoring INT, TERM, HUP and QUIT, that holds DIR/device open and listens on a
  TCP port it writes to DIR/port;
* DIR/pids gets "ROLE PID" per process; DIR/ready appears once all are in place.

Then the main process exits with N (``--exit``), kills itself with signal N
(``--kill``), or stays (``--stay``, the default). With ``--handle`` it writes
the number of the first INT, TERM, HUP or QUIT it gets to DIR/got and exits with
100 + that number, so a test can see which signal reached the command.
"""

import os
import signal
import socket
import sys
import time

base = sys.argv[1]
opts = sys.argv[2:]
POLITE = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def note(role: str) -> None:
    with open(os.path.join(base, "pids"), "a") as f:
        f.write(f"{role} {os.getpid()}\n")


def ignore_polite() -> None:
    for s in POLITE:
        signal.signal(s, signal.SIG_IGN)


def sleep_forever() -> None:
    while True:
        time.sleep(1)


def on_signal(signum: int, frame: object) -> None:
    with open(os.path.join(base, "got"), "w") as f:
        f.write(f"{signum}\n")
    os._exit(100 + signum)


if "--handle" in opts:
    for s in POLITE:
        signal.signal(s, on_signal)

if os.fork() == 0:
    ignore_polite()
    middle = os.fork()
    if middle == 0:
        os.setsid()
        if os.fork() > 0:
            os._exit(0)
        fd = os.open(os.path.join(base, "device"), os.O_RDWR | os.O_CREAT, 0o666)
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        with open(os.path.join(base, "port"), "w") as f:
            f.write(str(s.getsockname()[1]))
        note("escapee")
        sleep_forever()
    # The middle process is reaped before the child says it is in place, so the
    # tree is exactly main, child and escapee once DIR/ready appears: under load
    # the middle could still be alive (not yet run to its _exit) when the
    # command ended, and a stop then counted three members it left.
    os.waitpid(middle, 0)
    note("child")
    sleep_forever()

deadline = time.monotonic() + 20
while True:
    try:
        with open(os.path.join(base, "pids")) as f:
            text = f.read()
    except FileNotFoundError:
        text = ""
    if "escapee" in text and "child" in text:
        break
    if time.monotonic() > deadline:
        sys.exit("run_tree: the tree did not come up in 20 s")
    time.sleep(0.01)
note("main")
with open(os.path.join(base, "ready.tmp"), "w") as f:
    f.write("ready\n")
os.rename(os.path.join(base, "ready.tmp"), os.path.join(base, "ready"))

if "--exit" in opts:
    os._exit(int(opts[opts.index("--exit") + 1]))
if "--kill" in opts:
    os.kill(os.getpid(), int(opts[opts.index("--kill") + 1]))
    time.sleep(5)
    sys.exit("run_tree: still alive after killing myself")
sleep_forever()
