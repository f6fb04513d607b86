"""Child subreaper: orphans of our trees are re-parented to us, not to init.

Without a cgroup, this is what keeps a double-forked grandchild findable: when
its parent exits, the kernel hands it to the nearest ancestor that declared
itself a subreaper. The price is that we must reap those orphans ourselves,
one pid at a time (see :func:`hold_supervisor.proc.stop.reap_adopted`).
"""

from __future__ import annotations

import ctypes
import os

PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37


def become_subreaper(on: bool = True) -> None:
    """Declare this process a child subreaper (``on=False``: stop being one)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(err)}")


def is_subreaper() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    flag = ctypes.c_int(0)
    if libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_GET_CHILD_SUBREAPER): {os.strerror(err)}")
    return bool(flag.value)
