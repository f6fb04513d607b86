"""A lease holder's command for the daemon tests.

Usage: gated.py DIR NAME [--wait]

Appends NAME to DIR/order (the order in which holders got the device), writes
its environment to DIR/NAME.env (JSON) and then DIR/NAME.ready (its pid). With
--wait it then stays until DIR/NAME.go exists (at most 60 s, then exits 3).
"""

import json
import os
import sys
import time

base, name = sys.argv[1:3]
with open(os.path.join(base, "order"), "a") as f:
    f.write(name + "\n")
with open(os.path.join(base, name + ".env"), "w") as f:
    json.dump(dict(os.environ), f)
with open(os.path.join(base, name + ".ready.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.rename(os.path.join(base, name + ".ready.tmp"), os.path.join(base, name + ".ready"))
if "--wait" in sys.argv:
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(base, name + ".go")):
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.01)
