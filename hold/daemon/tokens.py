"""Token files (written by :func:`hold_supervisor.safefile.write_atomic`, re-exported here).

A token records one held device. Its first line is the established one-line
form that existing scripts read (``head -1``)::

    npu-hold <label> pid <PID> <date>

(``gpu-hold ...`` for GPUs) where PID is the holder, an ancestor of the
command. The second line is the full record as JSON (:class:`hold.documents.TokenFile`,
a :class:`hold.leases.LeaseRecord` with its kind and version): lease id, holder
start time, uid, devices, granted, expires, the command's pid and its cgroup leaf.

``~/NPU-TOKEN`` (:meth:`hold.daemon.records.Records.write_tokens`) holds only first
lines: one per live lease of its user and class, the newest first.
"""

from __future__ import annotations

import os
import stat
import time
from typing import Any

from hold.documents import TokenFile
from hold.leases import LeaseRecord
from hold_supervisor.safefile import UnsafePath, write_atomic

# One class and one writer for every file we keep (hold_supervisor.safefile): an
# ``except UnsafePath`` here catches what any of them refuses.
__all__ = [
    "UnsafePath",
    "line_label",
    "read_record",
    "read_token",
    "remove_owned",
    "render",
    "token_line",
    "write_atomic",
]


def remove_owned(path: str, root: str) -> None:
    """Delete ``path`` if it is a regular file directly inside ``root``; never anything else."""
    real_root = os.path.realpath(root)
    if os.path.dirname(os.path.abspath(path)) != real_root or os.path.realpath(path) in (
        real_root,
        "/",
    ):
        raise UnsafePath(f"refusing to delete {path}: not a file directly in {root}")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(f"refusing to delete {path}: not a regular file")
    os.unlink(path)


# What a label's word may keep as it is in the first line; the rest is %XX.
_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:@+=,/-")


def line_label(label: str) -> str:
    """``label`` as one word of the token's first line, never mistaken for a field.

    Scripts in use read the first line as words and take the one after the
    first ``pid``: a label ``run pid 1 of 3`` would hand them pid 1. So
    spaces, ``%``, control and non-ASCII characters are written as ``%XX``
    (of their UTF-8 bytes, as in a URL), and a label that is the word ``pid``
    itself as ``%70id``. The JSON record keeps the label as given.
    """
    out = "".join(
        ch if ch in _PLAIN else "".join(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))
        for ch in label
    )
    return "%70id" if out == "pid" else out


def token_line(cls: str, label: str, holder_pid: int, granted: float) -> str:
    date = time.strftime("%a %b %d %H:%M:%S %Z %Y", time.localtime(granted))
    return f"{cls}-hold {line_label(label)} pid {holder_pid} {date}"


def render(cls: str, record: LeaseRecord) -> bytes:
    """A token file's bytes (:class:`hold.documents.TokenFile`): the first line people
    and old scripts read, and the record. A private lease's label is in neither (its
    record's ``label`` is None, the line says ``private``): token files are
    readable by everyone."""
    label = record.label if record.label is not None else "private"
    return TokenFile(token_line(cls, label, record.holder_pid, record.granted), record).encode()


def read_record(path: str) -> dict[str, Any] | None:
    """The lease record of a token file in its JSON form (for people and tests), or
    None if absent or unreadable as one."""
    got = read_token(path)
    return None if got is None else got.record.to_json()


def read_token(path: str) -> TokenFile | None:
    """A token file (its first line and record), or None if absent or unreadable as one
    (a link, a FIFO, not a token file of this or an older daemon)."""
    try:
        return TokenFile.read(path, owned=False)  # no link, no FIFO to hang on
    except (OSError, ValueError):  # UnsafePath and BadDocument among them
        return None
