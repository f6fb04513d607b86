"""Demo: a command that leaves an escapee behind, the way a careless launcher does.

It starts a "model server" that calls setsid and double-forks (so it is no
longer in the command's session, group, or even its descendants), prints the
escapee's pid, and exits. Under ``hold run`` the escapee is found and stopped
anyway, and the stop report says so.
"""

import os
import sys
import time

if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        print(f"escapee {os.getpid()}: started, detached from its launcher", flush=True)
        time.sleep(3600)
        os._exit(0)
    os._exit(0)
os.wait()
time.sleep(0.2)
print("launcher: exiting, leaving the server running", flush=True)
sys.exit(0)
