"""``hold call NAME UNIT``: one call of a task unit, run by the stack's ``hold up``.

The client only asks: the running stack checks the arguments, runs the task
(isolated and bounded, :mod:`hold_supervisor.task.task`) and answers with the result
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

Deadlines: the stack answers (``accepted``, or a refusal: busy with
``--no-wait``) within :data:`ANSWER_WAIT` seconds; while the call waits for a
slot the stack says so every few seconds (``queued``); once it runs
(``running``), its result comes within the task's own timeout, its grace and
:data:`_RESULT_MARGIN`. A stack that misses a deadline is named with its
supervisor's pid, and the call ends 124 (the connection closed: a stack that
gets on again cancels the call).
"""

from __future__ import annotations

import base64
import json
import os
import select
import signal
import socket
import sys
import time
from typing import Any

from hold.client import waits
from hold.statedir import open_state_dir  # not hold.cli.stack: a call starts lean
from hold_supervisor.exitcodes import EXPIRED, NO, TOOL, USAGE, signalled
from hold_supervisor.jsonlines import BadJSON, LineBuffer, dumps_line, strict_loads
from hold_supervisor.parse import BadValue
from hold_supervisor.stack.controlsock import MAX_ANSWER, check_stack_name, connect
from hold_supervisor.stack.wire import StackEv, StackOp

PROG = "hold call"
_CANCEL_WAIT_MARGIN = 15.0  # beyond the task's grace, for the stop after a cancel
ANSWER_WAIT = waits.STACK  # the stack's first answer (as hold.cli.stackdir.ANSWER_WAIT)
_RESULT_MARGIN = 3 * waits.STACK  # beyond the task's timeout and grace (15 s): stop, check, answer
_BEATS = 4  # a queued call's stack is silent this many beats: stuck


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
    try:
        check_stack_name(name)
        args, text_args = parse_args(arg_pairs, json_args)
        sd = open_state_dir()
    except (ValueError, BadValue) as e:
        say(str(e))
        return USAGE
    path = os.path.join(sd.path, "stacks", name, "control.sock")  # as hold.cli.stack.run_dir_of
    # Connecting and sending are bounded too: a stuck stack's backlog fills up.
    try:
        sock = connect(path, ANSWER_WAIT, StackOp.CALL)
    except (FileNotFoundError, ConnectionRefusedError):
        from hold.cli.stackdir import no_such_stack  # only on this path: a call starts lean

        no_such_stack(name, PROG)
        return NO
    except TimeoutError:
        _say_silent(name, f"did not take the call in {ANSWER_WAIT:g} s")
        return EXPIRED
    except OSError as e:
        say(f"cannot reach stack {name}: {e}")
        return TOOL
    try:
        request = {
            "op": StackOp.CALL,
            "unit": unit,
            "args": args,
            "text_args": text_args,
            "no_wait": no_wait,
        }
        try:
            sock.sendall(dumps_line(request))
        except TimeoutError:
            _say_silent(name, f"did not take the call in {ANSWER_WAIT:g} s")
            return EXPIRED
        return _conversation(sock, name, unit, as_json)
    finally:
        sock.close()


def _conversation(sock: socket.socket, name: str, unit: str, as_json: bool) -> int:
    """Read the stack's answers until the result; a signal asks it to cancel."""
    old = {s: signal.signal(s, _raise) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    reader = _Lines(sock)
    accepted: dict[str, Any] = {}
    cancelled_by: int | None = None
    run_until: float | None = None  # the result's deadline, once the call runs
    try:
        while True:
            wait, silent = _wait(accepted, run_until)
            try:
                msg = reader.next(wait if cancelled_by is None else _cancel_wait(accepted))
            except _Interrupted as e:
                if cancelled_by is not None:
                    say("interrupted again: not waiting for the stop")
                    return signalled(e.signum)
                cancelled_by = e.signum
                say(f"{e}: cancelling the call...")
                try:
                    sock.sendall(dumps_line({"op": StackOp.CANCEL}))
                except OSError:
                    return signalled(e.signum)
                continue
            except TimeoutError:
                if cancelled_by is None:
                    _say_silent(name, silent)
                    return EXPIRED
                say("the stack did not confirm the stop in time")
                return signalled(cancelled_by or signal.SIGINT)
            except BadJSON as e:
                say(f"stack {name} sent an answer that is not valid: {e}")
                return TOOL
            if msg is None:
                say(f"stack {name} closed the connection without a result")
                return TOOL
            ev = msg.get("ev")
            if ev == StackEv.ACCEPTED:
                accepted = msg
                if not msg.get("beat") or msg.get("state") != "queued":
                    ev = StackEv.RUNNING  # no word of its start will come: counted from now
            if ev == StackEv.RUNNING and run_until is None and accepted:
                run_until = time.monotonic() + _run_limit(accepted)
            if ev in (StackEv.ACCEPTED, StackEv.RUNNING, StackEv.QUEUED):
                continue
            if ev == StackEv.ERROR:
                for line in msg.get("errors") or [str(msg.get("error"))]:
                    say(line)
                return int(msg.get("code", USAGE))
            if ev == StackEv.RESULT:
                code = _show(msg, name, as_json)
                if cancelled_by is not None and msg.get("outcome") == "cancelled":
                    return signalled(cancelled_by)
                return code
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _run_limit(accepted: dict[str, Any]) -> float:
    """How long a running call's result may take: the task's timeout and grace
    (as the stack said them) and a margin."""
    return (
        float(accepted.get("timeout", 60.0)) + float(accepted.get("grace", 10.0)) + (_RESULT_MARGIN)
    )


def _wait(accepted: dict[str, Any], run_until: float | None) -> tuple[float, str]:
    """How long to wait for the stack's next message now, and what its silence
    would mean."""
    if not accepted:
        return ANSWER_WAIT, f"did not take the call in {ANSWER_WAIT:g} s"
    call = f"call {accepted.get('call')} of {accepted.get('unit')}"
    if run_until is None:
        beats = _BEATS * float(accepted.get("beat") or 2.0)
        return beats, f"fell silent for {beats:g} s while {call} waited for a slot"
    timeout, grace = float(accepted.get("timeout", 60.0)), float(accepted.get("grace", 10.0))
    why = (
        f"gave no result for {call} in {_run_limit(accepted):g} s "
        f"(its timeout {timeout:g} s, grace {grace:g} s)"
    )
    return max(0.0, run_until - time.monotonic()), why


def _say_silent(name: str, what: str) -> None:
    from hold.cli.stackdir import stopped_text, supervisor_of  # only for a silent stack

    pid = supervisor_of(name)
    who = f"the supervisor of stack {name}" + (f" (pid {pid})" if pid is not None else "")
    say(f"{who} {what}{stopped_text(pid)}; see hold ps {name}")


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
        self.sock = sock
        self.lines = LineBuffer(MAX_ANSWER)

    def next(self, timeout: float | None) -> dict[str, Any] | None:
        """The next message; None at end of file; ``TimeoutError`` past ``timeout``;
        :class:`BadJSON` for a line that is not one."""
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
