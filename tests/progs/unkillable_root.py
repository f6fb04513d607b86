"""Become root for good, write our pid to PIDFILE (atomically), then sleep.

Usage: <setuid-root python> -I unkillable_root.py PIDFILE

Run through a setuid-root copy of Python from a tree of an ordinary user, it
stays in that tree (group, session, descent) but the user may no longer
signal it: a survivor that a stop cannot kill.
"""

import os
import sys
import time

os.setresgid(0, 0, 0)
os.setresuid(0, 0, 0)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(120)
