"""A task for the task-unit tests: reads its arguments (JSON) from stdin, acts by MODE.

Usage: task_prog.py DIR MODE

Every mode first appends "CALL PID" to DIR/started (CALL: its HOLD_CALL), so
a test can tell that nothing started.

  report   print JSON: the CPU mask and the descriptors it had at its start,
           the names in its environment, its arguments
  sleep    sleep args["s"] seconds, then exit args.get("n", 0)
  gate     wait until DIR/gate exists (at most 30 s), then exit 0
  nasty    ignore TERM; a child that ignores TERM, and a setsid double-forked
           escapee that ignores TERM; every pid goes to DIR/pids; then sleep
  overlap  append "start CALL T" and "end CALL T" (CLOCK_MONOTONIC) to
           DIR/times around a sleep of args["s"]
  flood    write args["n"] bytes to stdout and 100000 bytes to stderr
"""

import os

# Before anything else: what it was started with.
MASK = sorted(os.sched_getaffinity(0))
FDS = []
for fd in range(1024):
    try:
        os.fstat(fd)  # opens nothing, unlike listing /proc/self/fd
    except OSError:
        continue
    FDS.append(fd)

import json  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

base, mode = sys.argv[1], sys.argv[2]
call = os.environ.get("HOLD_CALL", "?")


def append(name: str, text: str) -> None:
    fd = os.open(os.path.join(base, name), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    os.write(fd, (text + "\n").encode())
    os.close(fd)


append("started", f"{call} {os.getpid()}")
args = json.load(sys.stdin)

if mode == "report":
    env = sorted(os.environ)
    print(json.dumps({"mask": MASK, "fds": FDS, "env": env, "args": args}))
elif mode == "sleep":
    time.sleep(float(args.get("s", 0)))
    sys.exit(int(args.get("n", 0)))
elif mode == "gate":
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(base, "gate")) and time.monotonic() < deadline:
        time.sleep(0.02)
elif mode == "nasty":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    append("pids", f"root {os.getpid()}")
    if os.fork() == 0:
        append("pids", f"child {os.getpid()}")
        if os.fork() == 0:
            os.setsid()
            if os.fork() > 0:
                os._exit(0)
            append("pids", f"escapee {os.getpid()}")
            while True:
                time.sleep(1)
        while True:
            time.sleep(1)
    while True:
        time.sleep(1)
elif mode == "overlap":
    append("times", f"start {call} {time.monotonic():.6f}")
    time.sleep(float(args["s"]))
    append("times", f"end {call} {time.monotonic():.6f}")
elif mode == "flood":
    n = int(args["n"])
    chunk = b"x" * 65536
    while n > 0:
        n -= os.write(1, chunk[: min(n, len(chunk))])
    os.write(2, b"e" * 99999 + b"\n")
else:
    sys.exit(f"unknown mode {mode}")
