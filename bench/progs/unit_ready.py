"""A unit that is ready at once and ends at once on SIGTERM (its default action).

Usage: unit_ready.py ROLE   (with $BENCH_ANNOUNCE set; see unitkit.py)
"""

import sys

from unitkit import ready, sleep_forever

ready(sys.argv[1] if len(sys.argv) > 1 else "ready")
sleep_forever()
