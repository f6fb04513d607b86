"""Child subreaper: orphans of our trees are re-parented to us, not to init.

Without a cgroup, this is what keeps a double-forked grandchild findable: when
its parent exits, the kernel hands it to the nearest ancestor that declared
itself a subreaper. The price is that we must reap those orphans ourselves,
one pid at a time (see :func:`supervisor.stop.reap_adopted`).
"""

from __future__ import annotations

import ctypes
import os

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(err)}")
