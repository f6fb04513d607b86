"""A unit that leaves an escapee behind, as a program that daemonises a helper does.

Usage: unit_escaper.py DEVICE_FILE   (with $BENCH_ANNOUNCE set; see unitkit.py)

The unit forks; the child calls ``setsid`` (new session and process group)
and forks again, then exits: the grandchild -- the *escapee* -- has left the
unit's session, group and ancestry (it is re-parented to the nearest
subreaper, or init). It puts /dev/null on its descriptors 0-2 as a daemon
does, opens DEVICE_FILE (a stand-in for a device node that must be free
again after the stop) and sleeps; SIGTERM ends it. The unit says READY only
once the escapee is in place. Both announce themselves (roles ``escaper``
and ``escapee``), so the benchmark can look for each by pid after a stop, and
for whoever still holds DEVICE_FILE.
"""

import os
import sys

from unitkit import announce, ready, sleep_forever

device = sys.argv[1]
r, w = os.pipe()
middle = os.fork()
if middle == 0:
    os.close(r)
    os.setsid()
    if os.fork() == 0:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
        held = os.open(device, os.O_RDWR)  # kept open for its whole life
        announce("escapee")
        os.write(w, b"1")
        os.close(w)
        sleep_forever()
    os._exit(0)
os.close(w)
os.waitpid(middle, 0)
if os.read(r, 1) != b"1":
    sys.exit("escaper: the escapee did not start")
os.close(r)
ready("escaper")
sleep_forever()
