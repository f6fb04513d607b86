"""What the stack commands share: where a stack lives (``HOLD_STATE_DIR/stacks/NAME/``),
its file checked by our rules too, asking a running stack on its control socket,
and who its supervisor is (the holder of its ``stack.lock``) when it does not answer.

Deadlines (see docs/DESIGN.md, "Deadlines"): a stack's first answer comes within
:data:`ANSWER_WAIT` seconds (``hold ps`` waits :data:`PS_WAIT`, so that it is done
within 5 s); what takes longer (a stop, a restart, a call) is bounded by what the
stack says it may take once it has answered. A stack that does not answer in time
is named, with its supervisor's pid, never shown as "not running"."""

from __future__ import annotations

import os
import sys
import threading
from typing import TYPE_CHECKING, Any

from hold.client import waits
from hold.protocol import check_label
from hold_supervisor.parse import BadValue, did_you_mean

if TYPE_CHECKING:
    from hold.config import Config
    from hold.statedir import StateDir
    from hold_supervisor.stackfile.load import StackSpec


def say(text: str, prog: str = "hold up") -> None:
    print(f"{prog}: {text}", file=sys.stderr, flush=True)


def load_checked(path: str, cfg: Config | None = None) -> StackSpec:
    """The stack file, checked by the supervisor's rules and by ours (device, label).

    Raises :class:`~hold_supervisor.stackfile.load.StackFileError` with every problem,
    or :class:`BadValue` for a bad configuration file.
    """
    # lazy: reading a stack file is off hold down NAME's and the stack supervisor's paths
    from hold.config import load
    from hold.devices.classes import classes_from_config, parse_device_spec
    from hold_supervisor.stackfile.load import load as load_stack

    cfg = load() if cfg is None else cfg
    classes = classes_from_config(cfg.devices, cfg.path)

    def check(data: dict[str, Any]) -> list[tuple[tuple[str | int, ...], str]]:
        out: list[tuple[tuple[str | int, ...], str]] = []
        hold = data.get("hold")
        if not isinstance(hold, dict):
            return out
        device = hold.get("device")
        if isinstance(device, str):
            try:
                parse_device_spec(device, classes, what="device")
            except BadValue as e:
                out.append((("hold", "device"), f"{device!r} is not valid: {e.accepted}"))
        label = hold.get("label")
        if isinstance(label, str):
            why = check_label(label)
            if why:
                out.append((("hold", "label"), f"{label!r} is not valid: {why}"))
        return out

    return load_stack(path, extra_check=check)


def run_dir_of(sd: StateDir, name: str) -> str:
    """The stack's directory; :class:`BadValue` for a name that is not one."""
    # lazy: not before hold up --detach forks its supervisor (hold.cli.upchild)
    from hold_supervisor.stack.controlsock import check_stack_name

    return os.path.join(sd.stacks(), check_stack_name(name))


def open_sd() -> StateDir:
    """The state directory, with its ``stacks`` directory made."""
    # lazy: not before hold up --detach forks its supervisor (hold.cli.upchild)
    from hold.statedir import open_state_dir

    sd = open_state_dir()
    try:
        os.makedirs(sd.stacks(), mode=0o700, exist_ok=True)
    except OSError as e:
        raise BadValue(
            "stack directory", sd.stacks(), f"a directory you may write ({e.strerror})"
        ) from None
    return sd


ANSWER_WAIT = waits.STACK  # a stack's first answer (hold down, restart, call; 5 s)
PS_WAIT = waits.PS  # hold ps's (3 s: the command is done within 5 s)


def ask(name: str, msg: dict[str, Any], **kw: Any) -> dict[str, Any] | None:
    """Ask the running stack ``name``; None if it is not running.
    :class:`~hold_supervisor.stack.controlsock.NoAnswer` if it did not answer in time."""
    # lazy: not before hold up --detach forks its supervisor (hold.cli.upchild)
    from hold_supervisor.stack.controlsock import request

    sd = open_sd()
    sock = os.path.join(run_dir_of(sd, name), "control.sock")
    try:
        return request(sock, msg, **kw)
    except (FileNotFoundError, ConnectionRefusedError):
        return None


def known_stacks() -> list[str]:
    """The stacks that have run here (their directories), for a "did you mean"."""
    try:
        base = open_sd().stacks()
        return sorted(n for n in os.listdir(base) if os.path.isdir(os.path.join(base, n)))
    except (OSError, BadValue):
        return []


def no_such_stack(name: str, prog: str, *, ever: bool = False) -> None:
    """Say that no stack ``name`` is running (``ever``: has ever run here), with the
    closest name of the stacks that exist. The caller returns ``NO`` (exit 1)."""
    others = [n for n in known_stacks() if n != name]
    if ever:
        where = os.path.join(open_sd().stacks(), "")
        text = f"no stack {name!r} has run here (nothing in {where})"
    else:
        text = f"stack {name} is not running"
    say(text + did_you_mean(name, others), prog)


def lock_holder(path: str) -> int | None:
    """The pid written in a held stack lock (its supervisor); None if nobody holds it."""
    # lazy: only for a stack that did not answer; off hold down NAME's usual path
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None  # nobody holds it (closing fd lets go at once)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return int(text) if text.isdigit() else None
    finally:
        os.close(fd)


def supervisor_of(name: str) -> int | None:
    """The pid of stack ``name``'s supervisor while it holds the stack's name."""
    try:
        return lock_holder(os.path.join(run_dir_of(open_sd(), name), "stack.lock"))
    except BadValue:
        return None


def stopped_text(pid: int | None) -> str:
    """``" (its process is stopped: ...)"`` where the kernel says it is (``""`` else)."""
    # lazy: /proc's reader only for a stack that did not answer; this module is
    # loaded before hold up --detach forks
    from hold_supervisor.proc.scan import stall_hint

    return stall_hint(pid, waiting=False)


def not_answering(name: str, pid: int | None, waited: float) -> str:
    """Who did not answer, and for how long: the start of every such message."""
    who = f"the supervisor of stack {name}" + (f" (pid {pid})" if pid is not None else "")
    return f"{who} did not answer in {waited:g} s{stopped_text(pid)}"


def running_stacks(only: set[str] | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """The running stacks' ``ps`` answers, and the names of those that did not
    answer within :data:`~hold.cli.stackdir.PS_WAIT`; all asked at once (one stuck
    stack costs that wait once, not once per stack). ``only``: these names alone."""
    # lazy: not before hold up --detach forks its supervisor (hold.cli.upchild)
    from hold_supervisor.stack.controlsock import NoAnswer, request
    from hold_supervisor.stack.wire import StackOp

    base = open_sd().stacks()
    socks = {
        name: path
        for name in sorted(os.listdir(base))
        if (only is None or name in only)
        and os.path.exists(path := os.path.join(base, name, "control.sock"))
    }
    answers: dict[str, dict[str, Any] | None] = {}

    def one(name: str) -> None:
        try:
            answers[name] = request(socks[name], {"op": StackOp.PS}, timeout=PS_WAIT)
        except NoAnswer:
            answers[name] = None
        except (OSError, ValueError):
            pass  # not running (a dead stack's socket), or not a stack's answer

    threads = [threading.Thread(target=one, args=(n,), daemon=True) for n in socks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()  # each ends within its request's deadlines
    out = [a for n in socks if (a := answers.get(n)) is not None]
    silent = [n for n in socks if n in answers and answers[n] is None]
    return out, silent
