"""A critical section for the mutual-exclusion test: am I alone holding the device?

Usage: critical.py MARKER LOG NAME

Creates MARKER with O_CREAT|O_EXCL (it fails if another holder is inside its
critical section at the same time), holds it about 20 ms, removes it, and
appends "ok NAME" or "overlap NAME" to LOG.
"""

import os
import sys
import time

marker, log, name = sys.argv[1:4]
try:
    fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
except FileExistsError:
    outcome = "overlap"
else:
    os.write(fd, name.encode())
    time.sleep(0.02)
    os.close(fd)
    os.unlink(marker)
    outcome = "ok"
with open(log, "a") as f:
    f.write(f"{outcome} {name}\n")
