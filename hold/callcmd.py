"""``hold call NAME UNIT``: one call of a task unit, run by the stack's ``hold up``.

The client only asks: the running stack checks the arguments, runs the task
(isolated and bounded, :mod:`supervisor.task`) and answers with the result
over its control socket. The call lives as long as this client's connection:
Ctrl-C (or SIGTERM, SIGHUP) asks the stack to cancel it and waits for the
stop; if the client dies without asking (SIGKILL), the closed connection
cancels the call all the same.

Exit status: the task's own (128+N if signal N ended it), 124 at its
timeout, 130 if it was cancelled, 3 if something survived its stop, 2 for
refused arguments or bad usage, 75 with ``--no-wait`` when every slot is
taken (or while the stack starts or stops), 1 when no such stack runs (as
for every stack command; the task's own status 1 is told apart by the summary
line on stderr).
"""

from __future__ import annotations

import base64
import json
import os
import select
import signal
import socket
import sys
from typing import Any

from supervisor.exitcodes import NO, TOOL, USAGE, signalled
from supervisor.jsonlines import BadJSON, LineBuffer, dumps_line, strict_loads

PROG = "hold call"
_CANCEL_WAIT_MARGIN = 15.0  # beyond the task's grace, for the stop after a cancel


def say(text: str) -> None:
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(signum: int, frame: object) -> None:
    raise _Interrupted(signum)


def parse_args(pairs: list[str], json_args: str | None) -> tuple[dict[str, Any], dict[str, str]]:
    """``--json-args`` as a JSON object, and ``--arg KEY=VALUE`` as text (each value is
    read by its declared type in the stack). Raises ``ValueError`` naming the bad value."""
    text: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--arg {pair!r} is not valid: KEY=VALUE")
        if key in text:
            raise ValueError(f"--arg {key} is given twice")
        text[key] = value
    obj: dict[str, Any] = {}
    if json_args is not None:
        where = "stdin" if json_args == "-" else json_args
        try:
            if json_args == "-":
                raw = sys.stdin.buffer.read()
            else:
                with open(json_args, "rb") as f:
                    raw = f.read()
        except OSError as e:
            raise ValueError(f"--json-args {where}: cannot read: {e.strerror}") from None
        try:
            data = strict_loads(raw)  # no key twice: which value was meant is not ours to guess
        except BadJSON as e:
            raise ValueError(f"--json-args {where} is not valid: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(
                f"--json-args {where} is not valid: a JSON object of argument names to values"
            )
        obj = data
    return obj, text


def main_call(
    name: str,
    unit: str,
    arg_pairs: list[str],
    json_args: str | None,
    no_wait: bool,
    as_json: bool,
) -> int:
    from hold.statedir import open_state_dir  # not hold.stackcmd: a call starts lean
    from supervisor.parse import BadValue
    from supervisor.stackctl import check_stack_name

    try:
        check_stack_name(name)
        args, text_args = parse_args(arg_pairs, json_args)
        sd = open_state_dir()
    except (ValueError, BadValue) as e:
        say(str(e))
        return USAGE
    path = os.path.join(sd.path, "stacks", name, "control.sock")  # as hold.stackcmd.run_dir_of
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            from hold.stackdir import no_such_stack  # only on this path: a call starts lean

            no_such_stack(name, PROG)
            return NO
        request = {
            "op": "call",
            "unit": unit,
            "args": args,
            "text_args": text_args,
            "no_wait": no_wait,
        }
        sock.sendall(dumps_line(request))
        return _conversation(sock, name, unit, as_json)
    finally:
        sock.close()


def _conversation(sock: socket.socket, name: str, unit: str, as_json: bool) -> int:
    """Read the stack's answers until the result; a signal asks it to cancel."""
    old = {s: signal.signal(s, _raise) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    reader = _Lines(sock)
    accepted: dict[str, Any] = {}
    cancelled_by: int | None = None
    try:
        while True:
            try:
                msg = reader.next(None if cancelled_by is None else _cancel_wait(accepted))
            except _Interrupted as e:
                if cancelled_by is not None:
                    say("interrupted again: not waiting for the stop")
                    return signalled(e.signum)
                cancelled_by = e.signum
                say(f"{e}: cancelling the call...")
                try:
                    sock.sendall(b'{"op": "cancel"}\n')
                except OSError:
                    return signalled(e.signum)
                continue
            except TimeoutError:
                say("the stack did not confirm the stop in time")
                return signalled(cancelled_by or signal.SIGINT)
            except BadJSON as e:
                say(f"stack {name} sent an answer that is not valid: {e}")
                return TOOL
            if msg is None:
                say(f"stack {name} closed the connection without a result")
                return TOOL
            ev = msg.get("ev")
            if ev == "accepted":
                accepted = msg
                continue
            if ev == "error":
                for line in msg.get("errors") or [str(msg.get("error"))]:
                    say(line)
                return int(msg.get("code", USAGE))
            if ev == "result":
                code = _show(msg, name, as_json)
                if cancelled_by is not None and msg.get("outcome") == "cancelled":
                    return signalled(cancelled_by)
                return code
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _cancel_wait(accepted: dict[str, Any]) -> float:
    return float(accepted.get("grace", 10.0)) + _CANCEL_WAIT_MARGIN


def _show(msg: dict[str, Any], name: str, as_json: bool) -> int:
    out = base64.b64decode(msg.pop("stdout_b64", "") or "")
    code = int(msg["exit"])
    if as_json:
        msg.pop("ev", None)
        msg.pop("done", None)
        msg["stdout"] = out.decode("utf-8", "replace")
        msg["stack"] = name
        msg["version"] = 1
        sys.stdout.write(json.dumps(msg, indent=2) + "\n")
        sys.stdout.flush()
        return code
    sys.stdout.buffer.write(out)
    sys.stdout.buffer.flush()
    tail = msg.get("stderr_tail") or ""
    if tail:
        sys.stderr.write(tail if tail.endswith("\n") else tail + "\n")
    what = {
        "exited": f"exited {msg.get('returncode')}",
        "timeout": "TIMED OUT",
        "cancelled": "cancelled",
        "failed": "could not start",
    }.get(str(msg.get("outcome")), str(msg.get("outcome")))
    text = (
        f"{msg.get('unit')} call {msg.get('call')}: {what} in {float(msg['wall_s']):.3f}s "
        f"on CPUs {msg.get('cpus')} (exit {code})"
    )
    if msg.get("detail"):
        text += f": {msg['detail']}"
    if msg.get("stdout_truncated"):
        text += f"; stdout cut to {len(out)} of {msg.get('stdout_bytes')} bytes"
    for s in msg.get("survivors") or []:
        text += f"\n  SURVIVOR pid {s['pid']} ({s['found_by']}): {s['command']}"
    say(text)
    return code


class _Lines:
    """JSON lines from the stack, each read within an optional time limit."""

    def __init__(self, sock: socket.socket) -> None:
        from supervisor.stackctl import MAX_ANSWER

        self.sock = sock
        self.lines = LineBuffer(MAX_ANSWER)

    def next(self, timeout: float | None) -> dict[str, Any] | None:
        """The next message; None at end of file; ``TimeoutError`` past ``timeout``;
        :class:`BadJSON` for a line that is not one."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while (msg := self.lines.next()) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError
            if not select.select([self.sock], [], [], left)[0]:
                continue
            try:
                data = self.sock.recv(1 << 20)
            except ConnectionResetError:
                data = b""
            if not data:
                return None
            self.lines.push(data)
        return msg
