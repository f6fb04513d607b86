"""Runs ``hold check`` from a descendant that daemonised (setsid + double fork).

Usage: daemonized_check.py OUT CLASS

The grandchild, in a new session and re-parented away from us, waits until
its parent has exited, then runs ``python -m hold check --device CLASS`` and
writes "RC" then the pids of its ancestors (one line) then the check's output
to OUT. The main process waits (at most 30 s) for OUT before it exits, so the
lease stays live meanwhile.
"""

import os
import subprocess
import sys
import time

out, cls = sys.argv[1:3]


def ancestors() -> list[int]:
    chain = []
    pid = os.getpid()
    while pid > 1:
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
        chain.append(pid)
    return chain


if os.fork() == 0:
    os.setsid()
    middle = os.getpid()
    if os.fork() > 0:
        os._exit(0)
    deadline = time.monotonic() + 10
    while os.getppid() == middle and time.monotonic() < deadline:
        time.sleep(0.01)
    res = subprocess.run(
        [sys.executable, "-m", "hold", "check", "--device", cls], capture_output=True, text=True
    )
    with open(out + ".tmp", "w") as f:
        f.write(f"{res.returncode}\n{' '.join(map(str, ancestors()))}\n{res.stdout}{res.stderr}")
    os.rename(out + ".tmp", out)
    os._exit(0)
os.wait()
deadline = time.monotonic() + 30
while not os.path.exists(out) and time.monotonic() < deadline:
    time.sleep(0.01)
