"""Text someone else controls never reaches a terminal raw (issue 24): a lock
file's record (anyone may write one), another user's label, a process's
command line. Escape sequences and characters that reorder text are written
as escapes (``hold_supervisor.width.shown``) in the waiting line, the refusal
of ``--no-wait`` and ``hold status``."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import HOLD

from hold.daemon import devlock
from hold.devices.classes import node_key
from hold_supervisor.width import fit, shown, table

NPU_HOLD = str(Path(sys.executable).parent / "npu-hold")
EVIL = "\x1b]0;pwned\x07\x1b[2J\u202eevil\x9b31m"


def test_shown_escapes_what_hides_or_moves_text() -> None:
    assert shown(EVIL) == "\\x1b]0;pwned\\x07\\x1b[2J\\u202eevil\\x9b31m"
    assert shown("plain text, déjà vu: 漢字") == "plain text, déjà vu: 漢字"
    assert shown(shown(EVIL)) == shown(EVIL)  # printable already: stays as it is
    assert "\x1b" not in fit(EVIL, None) and "\x1b" not in fit(EVIL, 40)
    assert all("\x1b" not in line for line in table(["A"], [[EVIL]], None))


def test_a_hostile_lock_record_is_shown_escaped(isolated_hold: Path) -> None:
    """Another arbiter (this test, holding the flock) wrote a record full of
    escape sequences: the waiter's refusal and hold status show it escaped."""
    node = next((isolated_hold / "dev").glob("accel*"))
    key = node_key(str(node))
    assert key is not None
    path = devlock.lock_path(os.environ["HOLD_LOCK_DIR"], key)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # Every field a record has (one with a field missing is no record at all,
        # hold.documents.LockRecord), its texts hostile.
        now = time.time()
        record = {"user": EVIL, "label": EVIL, "pid": 1, "lease": EVIL, "cls": "npu"}
        record |= {"uid": 0, "start": 1, "since": now, "until": now + 60, "arbiter": EVIL}
        record["daemon_pid"] = os.getpid()  # the kernel's holder: the record is believed
        Path(devlock.record_path(path, os.geteuid())).write_text(json.dumps(record))
        res = subprocess.run(
            [NPU_HOLD, "--no-wait", "--", "true"], capture_output=True, text=True, timeout=60
        )
        assert res.returncode == 75, res.stderr
        assert "through another ticket daemon" in res.stderr, res.stderr
        assert "\x1b" not in res.stderr and "\u202e" not in res.stderr, repr(res.stderr)
        assert "\\x1b]0;pwned" in res.stderr, res.stderr
        status = subprocess.run([*HOLD, "status"], capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        assert "\x1b" not in status.stdout and "\x9b" not in status.stdout, repr(status.stdout)
    finally:
        os.close(fd)
