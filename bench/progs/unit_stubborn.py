"""A unit that is ready at once and ignores SIGTERM: a stop must wait out the
grace period and kill it.

Usage: unit_stubborn.py ROLE   (with $BENCH_ANNOUNCE set; see unitkit.py)
"""

import signal
import sys

from unitkit import ready, sleep_forever

signal.signal(signal.SIGTERM, signal.SIG_IGN)  # before it says it is up
ready(sys.argv[1] if len(sys.argv) > 1 else "stubborn")
sleep_forever()
