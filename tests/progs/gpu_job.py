"""A job's program for the Slurm tests: says what it was given, holds it, waits.

Usage: gpu_job.py OUT DEVDIR [GATE]

Opens (``O_PATH``: the node's driver is never called, there is none) the
nodes ``DEVDIR/nvidiaN`` of the devices in ``HOLD_DEVICES`` (``gpu:N,...``),
then appends one JSON line to OUT: its pid, uid and the variables Slurm and
hold set. With GATE it then waits until GATE exists (two minutes at most, a
safety net should a test forget it), holding the nodes.
"""

import json
import os
import sys
import time

out, devdir = sys.argv[1:3]
gate = sys.argv[3] if len(sys.argv) > 3 else None
held = []
for dev in filter(None, os.environ.get("HOLD_DEVICES", "").split(",")):
    path = os.path.join(devdir, "nvidia" + dev.split(":")[1])
    os.open(path, os.O_PATH)  # kept open: the process holds the node
    held.append(path)
names = ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "SLURM_JOB_ID")
names += ("HOLD_DEVICES", "HOLD_LEASE", "GIVEN_CVD")
line = {"pid": os.getpid(), "uid": os.getuid(), "held": held}
line.update({n: os.environ.get(n) for n in names})
fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
os.write(fd, (json.dumps(line) + "\n").encode())
os.close(fd)
deadline = time.monotonic() + 120
while gate and not os.path.exists(gate) and time.monotonic() < deadline:
    time.sleep(0.05)
