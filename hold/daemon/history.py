"""The daemon's history (``history.jsonl`` beside its state): what ``hold report`` reads.

One JSON object per line (a document of :mod:`hold.documents`, its ``kind``
and ``version`` in it; an older daemon's lines, without the version, are
read as version 0), of two kinds:

* ``{"kind": "lease", ...}`` (:class:`hold.documents.HistoryLease`) when a lease
  ends: lease id, user, uid, class, devices, label, private, requested (when its
  request arrived; None after a daemon restart), granted, ended, ``end``
  (``ended``: its holder ended it; ``expired``: its time limit did;
  ``released``: ``hold release``, ``by`` whom; ``lifeline``: its client's
  connection dropped; ``owner_exited``, ``recovered``), and ``held`` (seconds a
  scan saw its nodes held; None where nothing was scanned, see
  :mod:`hold.daemon.usage`).
* ``{"kind": "stray", ...}`` (:class:`hold.documents.HistoryStray`) the first
  time a scan of the daemon saw a process outside any lease hold a device node:
  class, device, pid, uid, user, command, memory_bytes, seen.

Bounded: past :data:`MAX_BYTES` the file is renamed ``history.jsonl.1``
(replacing the older one) and a new one begun, so at most twice that is kept.
Opened only through :mod:`hold_supervisor.safefile` (no link, ours).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from hold.documents import BadDocument, HistoryLease, HistoryStray
from hold_supervisor.safefile import UnsafePath, open_for_read
from hold_supervisor.unitlog import RotatingLog

NAME = "history.jsonl"
MAX_BYTES = 2 * 1024 * 1024  # about 6,000 leases per file; two files kept
MAX_ENTRY = 4096  # a line longer than this is not ours: skipped when read


class History:
    """Appends entries to ``history.jsonl`` in ``state_dir``, rotated by size."""

    def __init__(self, state_dir: str, max_bytes: int = MAX_BYTES) -> None:
        self.path = os.path.join(state_dir, NAME)
        self.max_bytes = max_bytes
        self._log: RotatingLog | None = None
        self.failed: str | None = None  # why entries are not written

    def append(self, entry: HistoryLease | HistoryStray) -> None:
        line = entry.text()
        try:
            if self._log is None:  # opened at the first entry: no file for a daemon unused
                self._log = RotatingLog(self.path, max_bytes=self.max_bytes, keep=1)
            self._log.write(line)
            self.failed = self._log.refused
        except (UnsafePath, OSError) as e:
            self.failed = str(e)


def read(state_dir: str, since: float = 0.0) -> list[dict[str, Any]]:
    """Every well-formed entry of the history (older file first) that ended or was seen
    at or after ``since``; a missing file is an empty history. UnsafePath: a planted link."""
    path = os.path.join(state_dir, NAME)
    out = []
    for name in (path + ".1", path):
        for entry in _entries(name):
            when = entry.get("ended", entry.get("seen"))
            if isinstance(when, (int, float)) and when >= since:
                out.append(entry)
    return out


def _entries(path: str) -> Iterator[dict[str, Any]]:
    try:
        fd = open_for_read(path)
    except FileNotFoundError:
        return
    with os.fdopen(fd, "rb") as f:
        for n, raw in enumerate(f, 1):
            if len(raw) > MAX_ENTRY:
                continue
            try:
                value = HistoryLease.parse(raw, f"{path}:{n}")
                kind = value.get("kind") if isinstance(value, dict) else None
                doc = (HistoryStray if kind == HistoryStray.KIND else HistoryLease).from_value(
                    value, f"{path}:{n}"
                )
            except BadDocument:
                continue  # a line cut by a crash mid-write, or not ours
            yield doc.to_json()
