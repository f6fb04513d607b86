"""What the daemon writes down: its log (JSON lines), the token files people
and old scripts read, and the leases that ended (for the audit).

None of it authorises anything; the state that does is :mod:`hold.daemon.ledger`.
"""

from __future__ import annotations

import io
import os
import pwd
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar, TextIO, cast

from hold.daemon.ledger import SessionRec
from hold.daemon.tokens import UnsafePath, read_token, remove_owned, render, write_atomic
from hold.documents import EndedLease, EndedLeases
from hold.leases import LeaseRecord
from hold.statedir import StateDir
from hold_supervisor.safefile import open_for_append, remove_in_dir, write_in_dir

ENDED_KEPT = 200  # ended leases remembered for the audit


class Log:
    """JSON lines in the state directory, one per event, with the lease id where there is one."""

    # ``hold daemon`` in the foreground: each event also as a readable line here
    # (colours at a terminal); see :mod:`hold.cli.daemon`.
    console: ClassVar[TextIO | None] = None

    def __init__(self, path: str) -> None:
        # lazy: structlog (~66 modules) after the daemon's fork, not in its first process
        import structlog

        # Never through a link someone planted (UnsafePath: the daemon refuses to start).
        self._file = open(open_for_append(path), "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._log = structlog.wrap_logger(
            structlog.PrintLogger(self._file),
            processors=[
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.JSONRenderer(sort_keys=True),
            ],
        )
        self._echo = (
            None
            if Log.console is None
            else structlog.wrap_logger(
                structlog.PrintLogger(cast(TextIO, _Echo(Log.console))),
                processors=[
                    structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False),
                    structlog.dev.ConsoleRenderer(colors=Log.console.isatty()),
                ],
            )
        )

    def info(self, event: str, **kw: Any) -> None:
        self._log.info(event, **kw)
        if self._echo is not None:
            self._echo.info(event, **kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._log.warning(event, **kw)
        if self._echo is not None:
            self._echo.warning(event, **kw)

    def error(self, event: str, **kw: Any) -> None:
        self._log.error(event, **kw)
        if self._echo is not None:
            self._echo.error(event, **kw)


class _Echo(io.TextIOBase):
    """A console the daemon's loop never waits on: lines go through a bounded queue
    to a writer thread, and are dropped (and counted) when it is full -- a pipe
    nobody reads must not stop the granting of devices."""

    def __init__(self, stream: TextIO, depth: int = 1000) -> None:
        super().__init__()
        self.stream = stream
        self.dropped = 0
        self._q: queue.Queue[str] = queue.Queue(depth)
        threading.Thread(target=self._write, name="console", daemon=True).start()

    def write(self, text: str) -> int:
        try:
            self._q.put_nowait(text)
        except queue.Full:
            self.dropped += 1
        return len(text)

    def flush(self) -> None:
        pass  # the writer thread flushes each line

    def _write(self) -> None:
        while True:
            text = self._q.get()
            if self.dropped:
                text = f"({self.dropped} lines dropped: nobody was reading)\n" + text
                self.dropped = 0
            try:
                self.stream.write(text)
                self.stream.flush()
            except (OSError, ValueError):
                return  # the console is gone; the log file has every event


class Records:
    """Token files, the home-directory mirror and ended.json, for one state directory."""

    def __init__(self, sd: StateDir, home_tokens: bool, log_for: Callable[..., None]) -> None:
        self.sd = sd
        self.home_tokens = home_tokens
        self.log_for = log_for  # (event, session, **fields)
        self.ended: list[EndedLease] | None = None  # ended.json, once read
        self.on_end: Callable[[SessionRec], None] | None = None  # the history's line

    def record(self, s: SessionRec) -> LeaseRecord:
        lease = s.lease
        assert lease is not None
        roots = [t.root_pid for t in s.trees.values() if t.root_pid]
        # Every tree's root known by (pid, start): for an adopted job the only
        # link to the lease; for the others, a second proof beside the holder.
        tree_roots = tuple(
            (t.root_pid, t.root_start)
            for t in s.trees.values()
            if t.root_pid is not None and t.root_start is not None
        )
        return LeaseRecord(
            lease.lease_id,
            lease.cls,
            tuple(lease.devices),
            lease.label,
            s.owner_pid,
            s.owner_start,
            s.uid,
            s.user,
            lease.granted,
            lease.expires,
            roots[0] if roots else None,
            tuple(t.leaf for t in s.trees.values() if t.leaf),
            tuple(s.trees),
            tree_roots,
        )

    def remember(self, s: SessionRec) -> None:
        """Keep the last leases that ended, so the audit can say whose a stray was."""
        assert s.lease is not None
        if self.on_end is not None:
            self.on_end(s)
        path = os.path.join(self.sd.path, "ended.json")
        if self.ended is None:  # read once; from then on this daemon writes it
            try:
                self.ended = list(EndedLeases.read(path).leases[-ENDED_KEPT:])
            except (OSError, ValueError):  # absent; UnsafePath, BadDocument: begun again
                self.ended = []
        self.ended.append(EndedLease(self.record(s), time.time()))
        del self.ended[:-ENDED_KEPT]
        try:
            write_atomic(path, EndedLeases(tuple(self.ended)).encode(), 0o644)
        except (UnsafePath, OSError) as e:
            self.log_for("history_not_written", s, error=str(e))

    def write_tokens(self, s: SessionRec) -> None:
        assert s.lease is not None
        record = self.record(s)
        if s.lease.private:  # the files are everyone's to read: no label of it there
            record = record._replace(label=None)
        data = render(s.lease.cls, record)
        for i in s.lease.devices:
            write_atomic(self.sd.token(s.lease.cls, i), data, 0o644)
        if self.home_tokens:
            self._home_token(s)

    def remove_tokens(self, s: SessionRec) -> None:
        assert s.lease is not None
        for i in s.lease.devices:
            try:
                remove_owned(self.sd.token(s.lease.cls, i), self.sd.path)
            except UnsafePath as e:
                self.log_for("token_not_removed", s, error=str(e))
        if self.home_tokens:
            self._home_token(s)

    def _home_token(self, s: SessionRec) -> None:
        """``~/NPU-TOKEN`` (``~/GPU-TOKEN``; ``~/CLASS-TOKEN``) of the lease's user, as
        the live leases of that user and class are now (from the token files, so a
        restarted daemon's recovered leases count): one first line per lease, the
        newest first; removed when none is left.

        Newest first: a guard reads the first line when its command starts, just
        after its grant, when its lease is its user's newest. Written in the
        holder's own home, as that user's file (:func:`write_in_dir`).
        """
        assert s.lease is not None
        where = home_of(s.uid)
        if where is None:
            return
        home, gid = where
        name = f"{s.lease.cls.upper()}-TOKEN"
        lines = self._user_lines(s.lease.cls, s.uid)
        try:
            if lines:
                write_in_dir(home, name, b"".join(lines), uid=s.uid, gid=gid)
            else:
                remove_in_dir(home, name, uid=s.uid)
        except (UnsafePath, OSError) as e:
            self.log_for("home_token_failed", s, path=os.path.join(home, name), error=str(e))

    def _user_lines(self, cls: str, uid: int) -> list[bytes]:
        """The first lines of ``uid``'s live leases of ``cls`` (a lease's files, one per
        device, counted once), the newest lease first."""
        found: dict[str, tuple[float, bytes]] = {}
        prefix = f"{cls}-"
        with os.scandir(self.sd.path) as entries:
            for e in entries:
                if not (e.name.startswith(prefix) and e.name.endswith(".token")):
                    continue
                if not e.name[len(prefix) : -len(".token")].isdigit():
                    continue
                got = read_token(e.path)
                if got is not None and got.record.uid == uid and got.record.cls == cls:
                    rec = got.record
                    found[rec.lease] = (rec.granted, got.line.encode("utf-8", "replace") + b"\n")
        ordered = sorted(found.items(), key=lambda kv: (-kv[1][0], kv[0]))
        return [line for _, (_, line) in ordered]


def home_of(uid: int) -> tuple[str, int] | None:
    """Where ``uid``'s home tokens go, and the group they get; None where this
    process may not write for ``uid`` (neither root nor that user).

    For its own user (a per-user daemon, started from that user's session) the
    daemon's ``$HOME``, which is what ``~`` is in the commands it guards; for
    another (the system daemon, root) that user's home in the password database.
    """
    me = os.geteuid()
    if me not in (0, uid):
        return None
    if uid == me:
        env_home = os.environ.get("HOME", "")
        if os.path.isabs(env_home):
            return env_home, os.getegid()
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        return None
    return (pw.pw_dir, pw.pw_gid) if os.path.isabs(pw.pw_dir) else None
