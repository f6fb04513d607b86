"""A guard written the way the field writes it (the seed's ``npu-hold``), in Python.

Read the first line of ``~/NPU-TOKEN`` (``~/CLASS-TOKEN`` for the class in
argv[1]), take the pid after the word ``pid``, and pass only if that pid is
an ancestor of this process (the parents in ``/proc/PID/stat``). Exit 0
inside, 1 outside.
"""

import os
import sys

cls = sys.argv[1] if len(sys.argv) > 1 else "NPU"
try:
    with open(os.path.expanduser(f"~/{cls}-TOKEN")) as f:
        words = f.readline().split()
    holder = int(words[words.index("pid") + 1])
except (OSError, ValueError, IndexError):
    sys.exit(1)
pid = os.getpid()
while pid > 1:
    if pid == holder:
        sys.exit(0)
    try:
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        sys.exit(1)
sys.exit(1)
