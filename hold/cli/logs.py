"""``hold logs NAME [UNIT] [-f] [-n N] [--since DURATION|TIME]``: a stack's logs.

With UNIT, that unit's log as written (``STAMP STREAM | TEXT``, see
:mod:`hold_supervisor.unitlog`); without, every unit's interleaved by time, each
line with its unit after the stamp. ``-n`` keeps the last N lines (of the
whole view), ``--since`` those from a time on (the rotated files too), ``-f``
then follows while the stack runs (across rotations). A stack that never ran
here is exit 1, as for every stack command; a unit it does not have, exit 2.
"""

from __future__ import annotations

import os
import socket
import sys

from hold.cli.stackdir import no_such_stack, open_sd, run_dir_of, say
from hold_supervisor.exitcodes import NO, OK, USAGE
from hold_supervisor.parse import BadValue, did_you_mean

PROG = "hold logs"


def main_logs(
    name: str,
    unit: str | None,
    follow: bool = False,
    lines: int | None = None,
    since: str | None = None,
) -> int:
    from hold_supervisor.stack.logread import parse_since

    try:
        run_dir = run_dir_of(open_sd(), name)
        since_stamp = parse_since(since) if since is not None else None
    except BadValue as e:
        say(str(e), PROG)
        return USAGE
    logs = os.path.join(run_dir, "logs")
    if not os.path.isdir(logs):
        no_such_stack(name, PROG, ever=True)
        return NO
    units = sorted(f[:-4] for f in os.listdir(logs) if f.endswith(".log") and len(f) > 4)
    if unit is not None and ("/" in unit or unit not in units):
        why = f"no unit {unit!r} in stack {name} (units: {', '.join(units) or 'none'})"
        say(why + did_you_mean(unit, units), PROG)
        return USAGE
    try:
        _show(
            logs,
            [unit] if unit is not None else units,
            unit is None,
            lines,
            since_stamp,
            follow,
            os.path.join(run_dir, "control.sock"),
        )
    except KeyboardInterrupt:
        return OK
    return OK


def _show(
    logs: str,
    units: list[str],
    together: bool,
    n: int | None,
    since: str | None,
    follow: bool,
    sock: str,
) -> None:
    from hold_supervisor.stack.logread import follow_all, merged, read_log, with_unit
    from hold_supervisor.unitlog import Follower

    texts: dict[str, list[str]] = {}
    followers: dict[str, Follower] = {}
    for u in units:
        path = os.path.join(logs, f"{u}.log")
        texts[u], ino, offset = read_log(path, None if together else n, since)
        followers[u] = Follower(path, ino, offset)
    width = max((len(u) for u in units), default=0)

    def line_of(u: str, line: str) -> str:
        return with_unit(u, line, width) if together else line

    shown = [(u, line) for _t, u, line in merged(texts)]
    if n is not None:
        shown = shown[-n:] if n > 0 else []
    out = sys.stdout
    out.writelines(line_of(u, line) + "\n" for u, line in shown)
    out.flush()
    if follow:

        def emit(u: str, line: str) -> None:
            print(line_of(u, line), flush=True)

        follow_all(followers, emit, keep_going=lambda: _running(sock))


def _running(sock: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(sock)
        except OSError:
            return False
    return True
