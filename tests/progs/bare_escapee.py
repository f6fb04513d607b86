"""A command whose escapee leaves no trace a walk of /proc could follow.

Usage: bare_escapee.py READY_FILE

The command forks a child that calls ``setsid`` and forks again (a double
fork: re-parented away from the command, out of its session and group), then
``execve``s ``sleep`` with an *empty* environment (no ``HOLD_TREE`` marker)
and no file open but what ``sleep`` needs. The command writes
``command PID`` and ``escapee PID`` to READY_FILE (atomically, once both are
in place) and sleeps. Only the subreaper the escapee is re-parented to knows it.
"""

import os
import sys
import time

ready = sys.argv[1]
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    os.close(r)
    os.write(w, f"{os.getpid()}\n".encode())
    os.close(w)
    os.execve("/bin/sleep", ["sleep", "300"], {})
os.close(w)
escapee = int(os.read(r, 64).decode().strip())
os.close(r)
os.wait()  # the first child, which exited at once
with open(ready + ".tmp", "w") as f:
    f.write(f"command {os.getpid()}\nescapee {escapee}\n")
os.rename(ready + ".tmp", ready)
time.sleep(300)
