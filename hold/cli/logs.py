"""``hold logs NAME [UNIT] [-f] [-n N] [--since DURATION|TIME] [--json]``: a stack's logs.

With UNIT, that unit's log as written (``STAMP STREAM | TEXT``, see
:mod:`hold_supervisor.unitlog`); without, every unit's interleaved by time, each
line with its unit after the stamp. ``-n`` keeps the last N lines (of the
whole view), ``--since`` those from a time on (the rotated files too), ``-f``
then follows while the stack runs (across rotations). A stack that never ran
here is exit 1, as for every stack command; a unit it does not have, exit 2
(naming its units, and the closest one).

``--json``: the same lines, chosen the same way, as JSON lines: one object per
log line, each whole (``version`` 1 in every object, as ``hold ps --json``
puts it in its document; no header line, so ``-f`` and ``tail`` of the
output need none): ``stack``, ``unit``, ``ts``, ``stream``, ``text`` (and a
task record's ``record``), see
:func:`hold_supervisor.stack.logread.as_record`.
"""

from __future__ import annotations

import json
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
    as_json: bool = False,
) -> int:
    # lazy: logread (datetime, heapq) only for hold logs; hold down NAME imports this module
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
            name if as_json else None,
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
    json_of: str | None = None,
) -> None:
    """Print the lines; as JSON lines of stack ``json_of`` when given."""
    # lazy: as in main_logs: off hold down NAME's path
    from hold_supervisor.stack.logread import (
        as_record,
        follow_all,
        merged,
        read_log,
        with_unit,
    )
    from hold_supervisor.unitlog import Follower

    texts: dict[str, list[str]] = {}
    followers: dict[str, Follower] = {}
    for u in units:
        path = os.path.join(logs, f"{u}.log")
        texts[u], ino, offset = read_log(path, None if together else n, since)
        followers[u] = Follower(path, ino, offset)
    width = max((len(u) for u in units), default=0)

    def line_of(u: str, line: str) -> str:
        if json_of is not None:
            return json.dumps(as_record(json_of, u, line))
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
