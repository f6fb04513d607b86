"""Token files, and the atomic, symlink-refusing writes that the state uses too.

A token records one held device. Its first line is the established one-line
form that existing scripts read (``head -1``)::

    npu-hold <label> pid <PID> <date>

(``gpu-hold ...`` for GPUs) where PID is the holder, an ancestor of the
command. The second line is the full record as JSON: lease id, holder start
time, uid, devices, granted, expires, the command's pid and its cgroup leaf.
"""

from __future__ import annotations

import json
import os
import stat
import time
from typing import Any


class UnsafePath(Exception):
    """A path we were about to write or delete is not what we expected (e.g. a symlink)."""


def write_atomic(path: str, data: bytes, mode: int = 0o600) -> None:
    """Write ``path`` whole or not at all: a temp file beside it, then rename.

    No fsync, on purpose: what this protects against is the death of the
    writer (a SIGKILLed daemon), and the page cache outlives any process. A
    machine crash loses the last write, but it also ends every process the
    record could be about (and /run is wiped at boot). An fsync would cost a
    few milliseconds in every grant and release, for nothing.

    Refuses if ``path`` is a symlink or not a regular file; the temp file is
    created with ``O_EXCL|O_NOFOLLOW``, so nothing is ever written through a
    link someone planted.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{path} is a symlink or not a regular file; refusing to replace it")
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.write(fd, data)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.rename(tmp, path)


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


def render(cls: str, record: dict[str, Any]) -> bytes:
    line = token_line(cls, record["label"], record["holder_pid"], record["granted"])
    return (line + "\n" + json.dumps(record, sort_keys=True) + "\n").encode()


def read_record(path: str) -> dict[str, Any] | None:
    """The JSON record of a token file, or None if absent or unreadable as one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        lines = f.read().split(b"\n")
    if len(lines) < 2:
        return None
    try:
        rec = json.loads(lines[1])
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None
