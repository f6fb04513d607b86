"""What the daemon writes down: its log (JSON lines), the token files people
and old scripts read, and the leases that ended (for the audit).

None of it authorises anything; the state that does is :mod:`hold.ledger`.
"""

from __future__ import annotations

import json
import os
import pwd
import time
from collections.abc import Callable
from typing import Any

from hold.ledger import SessionRec
from hold.statedir import StateDir
from hold.tokens import UnsafePath, remove_owned, render, write_atomic

ENDED_KEPT = 200  # ended leases remembered for the audit


class Log:
    """JSON lines in the state directory, one per event, with the lease id where there is one."""

    def __init__(self, path: str) -> None:
        import structlog

        from supervisor.safefile import open_for_append

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

    def info(self, event: str, **kw: Any) -> None:
        self._log.info(event, **kw)

    def error(self, event: str, **kw: Any) -> None:
        self._log.error(event, **kw)


class Records:
    """Token files, the home-directory mirror and ended.json, for one state directory."""

    def __init__(self, sd: StateDir, home_tokens: bool,
                 log_for: Callable[..., None]) -> None:  # fmt: skip
        self.sd = sd
        self.home_tokens = home_tokens
        self.log_for = log_for  # (event, session, **fields)
        self.ended: list[dict[str, Any]] | None = None  # ended.json, once read

    def record(self, s: SessionRec) -> dict[str, Any]:
        lease = s.lease
        assert lease is not None
        roots = [t.root_pid for t in s.trees.values() if t.root_pid]
        return {
            "lease": lease.lease_id, "cls": lease.cls, "devices": lease.devices,
            "label": lease.label, "holder_pid": s.owner_pid, "holder_start": s.owner_start,
            "uid": s.uid, "user": s.user, "granted": lease.granted, "expires": lease.expires,
            "command_pid": roots[0] if roots else None,
            "leaves": [t.leaf for t in s.trees.values() if t.leaf],
            "trees": list(s.trees),
        }  # fmt: skip

    def remember(self, s: SessionRec) -> None:
        """Keep the last leases that ended, so the audit can say whose a stray was."""
        assert s.lease is not None
        path = os.path.join(self.sd.path, "ended.json")
        if self.ended is None:  # read once; from then on this daemon writes it
            from supervisor.safefile import UnsafePath, open_for_read

            try:
                with os.fdopen(open_for_read(path), "rb") as f:
                    past = json.loads(f.read())
                self.ended = past[-ENDED_KEPT:] if isinstance(past, list) else []
            except (OSError, ValueError, UnsafePath):
                self.ended = []
        self.ended.append({**self.record(s), "ended": time.time()})
        del self.ended[:-ENDED_KEPT]
        try:
            write_atomic(path, json.dumps(self.ended).encode(), 0o644)
        except (UnsafePath, OSError) as e:
            self.log_for("history_not_written", s, error=str(e))

    def write_tokens(self, s: SessionRec) -> None:
        assert s.lease is not None
        data = render(s.lease.cls, self.record(s))
        for i in s.lease.devices:
            write_atomic(self.sd.token(s.lease.cls, i), data, 0o644)
        if self.home_tokens:
            self._home_token(s, data.split(b"\n", 1)[0] + b"\n")

    def remove_tokens(self, s: SessionRec) -> None:
        assert s.lease is not None
        for i in s.lease.devices:
            try:
                remove_owned(self.sd.token(s.lease.cls, i), self.sd.path)
            except UnsafePath as e:
                self.log_for("token_not_removed", s, error=str(e))
        if self.home_tokens:
            self._home_token(s, None)

    def _home_token(self, s: SessionRec, line: bytes | None) -> None:
        """Mirror the token line to ~/NPU-TOKEN (as scripts of old expect), as that user."""
        assert s.lease is not None
        if os.geteuid() not in (0, s.uid):
            return
        try:
            home = pwd.getpwuid(s.uid).pw_dir
        except KeyError:
            return
        path = os.path.join(home, f"{s.lease.cls.upper()}-TOKEN")
        try:
            if line is None:
                remove_owned(path, home)
            else:
                write_atomic(path, line, 0o644)
                if os.geteuid() == 0:
                    os.chown(path, s.uid, -1, follow_symlinks=False)
        except (UnsafePath, OSError) as e:
            self.log_for("home_token_failed", s, error=str(e))
