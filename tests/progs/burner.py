"""A process that uses CPU and memory, for the resource figures' tests.

Usage: burner.py DIR MB [CHILDREN]

Allocates MB mebibytes and writes to every page of them (so they are
resident), starts CHILDREN (default 0) copies of itself without children,
then writes DIR/burner.ready (its pid) and works: busy for 20 ms, asleep
for 20 ms (about half a CPU), until DIR/burner.stop exists (at most 60 s).
"""

import os
import subprocess
import sys
import time

base, mb = sys.argv[1], int(sys.argv[2])
children = int(sys.argv[3]) if len(sys.argv) > 3 else 0
block = bytearray(mb << 20)
for i in range(0, len(block), 4096):
    block[i] = 1
kids = [subprocess.Popen([sys.executable, __file__, "-", "0"]) for _ in range(children)]
if base != "-":
    with open(os.path.join(base, "burner.ready.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(base, "burner.ready.tmp"), os.path.join(base, "burner.ready"))
deadline = time.monotonic() + 60
stop = os.path.join(base, "burner.stop") if base != "-" else None
while time.monotonic() < deadline and not (stop and os.path.exists(stop)):
    busy = time.monotonic() + 0.02
    while time.monotonic() < busy:
        pass
    time.sleep(0.02)
    if stop is None and os.getppid() == 1:
        break  # a child whose parent is gone
for k in kids:
    k.terminate()
    k.wait()
