"""``hold audit``, the command: options checked, the report, ``--kill``, the exit status.

Its options are :data:`hold.cli.options.AUDIT_OPTIONS`: click's declaration in
:mod:`hold.cli.group` is made from them (``--help`` and every error are click's),
and :mod:`hold.cli.entry` reads a plainly valid line by them without click
(:func:`main_plain`): importing click and the group is a third of ``hold
audit``'s time.
"""

from __future__ import annotations

import os
import pwd
import re
import sys
from typing import TYPE_CHECKING, Any

from hold.config import load
from hold.devices.classes import DeviceClass, classes_from_config, parse_device_spec
from hold.statedir import StateDir, open_state_dir
from hold_supervisor.exitcodes import CANCELLED, INCOMPLETE, NO, SURVIVORS, USAGE
from hold_supervisor.parse import BadValue, did_you_mean, parse_duration
from hold_supervisor.safefile import open_for_append
from hold_supervisor.width import columns, fit

if TYPE_CHECKING:
    from hold.devices.nvml import Prefetch
    from hold.views.audit import Only

ANSI = re.compile(r"\033\[[;?0-9]*[a-zA-Z]")  # what click.echo strips where not a terminal


def main_plain(opts: dict[str, Any]) -> int:
    """:func:`run_audit` without click, ending as click's ``main`` would."""
    try:
        return run_audit(**opts)
    except (EOFError, KeyboardInterrupt):
        print(file=sys.stderr)  # the blank line after ^C
        return CANCELLED
    except BrokenPipeError:
        # A reader that went away: quiet, exit 1 (click's rule); stdout to
        # /dev/null so the flush at exit cannot complain again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def run_audit(
    cls: str | None,
    as_json: bool,
    kill: bool,
    yes: bool,
    grace: str,
    user: str | None = None,
    log: str | None = None,
) -> int:
    """``hold audit`` once its options are read: checked, then :func:`main_audit`."""
    try:
        cfg = load()
        classes = classes_from_config(cfg.devices, cfg.path)
    except BadValue as e:
        return _usage(str(e))
    units: tuple[int, ...] | None = None
    if cls is not None and cls.partition(":")[0] not in classes:
        known = sorted(classes)
        return _usage(
            f"--device {cls!r} is not valid: one of {', '.join(known)}" + did_you_mean(cls, known)
        )
    if yes and not kill:
        return _usage("--yes only goes with --kill")
    try:
        if cls is not None:
            cls, units = parse_device_spec(cls, classes)
        uid = None if user is None else _uid_of(user)
        grace_s = parse_duration(grace, what="--grace", plain_unit="seconds", allow_zero=True)
        log_fd = None if log is None else _open_log(log)
        sd = open_state_dir(shared=False)
    except BadValue as e:
        return _usage(str(e))
    nvml = None
    if cls in (None, "gpu") and "gpu" in classes and os.path.exists("/dev/nvidiactl"):
        # The driver is here: NVML's figures asked for now, in a thread, so
        # that its ~16 ms pass during the imports and the scan (issue 13).
        from hold.devices.nvml import Prefetch  # lazy: only where a GPU driver is

        nvml = Prefetch()
    # lazy, as main_audit's: imported while NVML's prefetch runs, not before it starts
    from hold.views.audit import Only

    only = Only(cls, units, uid)
    try:
        return main_audit(sd, classes, only, as_json, kill, yes, grace_s, nvml, log_fd)
    finally:
        if log_fd is not None:
            os.close(log_fd)


def _uid_of(user: str) -> int:
    """``--user``: a user name, or a uid (one without an account too: its processes
    may outlive the account)."""
    if user.isascii() and user.isdigit() and len(user) <= 10:
        return int(user)
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        raise BadValue("--user", user, "a user name of this machine, or a uid") from None


def _open_log(path: str) -> int:
    """``--log``: appended to (made 0640 where missing), never through a symlink,
    never a FIFO or someone else's file (:mod:`hold_supervisor.safefile`)."""
    try:
        return open_for_append(path, 0o640)
    except OSError as e:
        raise BadValue("--log", path, f"a file this user may append to ({e.strerror})") from None


def _usage(msg: str) -> int:
    echo(f"hold audit: {msg}", err=True)
    return USAGE


def echo(text: str, err: bool = False) -> None:
    """``click.echo``'s output without click: ANSI sequences dropped where not a terminal."""
    stream = sys.stderr if err else sys.stdout
    if not stream.isatty():
        text = ANSI.sub("", text)
    print(text, file=stream, flush=True)


def main_audit(
    sd: StateDir,
    classes: dict[str, DeviceClass],
    only: Only,
    as_json: bool,
    kill: bool,
    yes: bool,
    grace: float,
    nvml: Prefetch | None = None,
    log_fd: int | None = None,
) -> int:
    """Scan, attribute, print (and with ``kill``, stop the strays; with ``log_fd``,
    a JSON line per stray appended there); the exit status: 0 all covered, 1 a
    stray, 3 a stop left survivors, 7 nothing stray (or all stopped) among the
    processes read, but some could not be read."""
    # lazy: the scan's and the table's modules load while NVML's prefetch runs
    from hold.views.audit import build_report, kill_strays, stray_lines
    from hold.views.audittable import render_table

    doc = build_report(sd, classes, only, nvml)
    strays = [r for r in doc["holders"] if not r["covered"]]
    width = columns(sys.stdout)
    asked = kill and strays and not yes
    if asked:
        if not sys.stdin.isatty():
            echo("hold audit: --kill without --yes needs a terminal to ask at", err=True)
            return USAGE
        echo(render_table(doc, width))
        answer = _confirm(f"Stop the trees of {len(strays)} stray holder(s)?")
        if not answer:
            return CANCELLED if answer is None else NO
    if kill and strays:
        doc["killed"] = kill_strays(doc, sd, grace)
    if log_fd is not None and strays:
        os.write(log_fd, "".join(stray_lines(doc)).encode())
    if as_json:
        import json  # lazy: only for --json, the table needs none

        echo(json.dumps(doc, indent=2, sort_keys=True))
    else:
        if not asked:
            echo(render_table(doc, width, notes=[] if kill else adopt_hints(doc)))
        for line in _killed_lines(doc):
            echo(fit(line, width))
    if any(k.get("survivors") or not k.get("stopped") for k in doc.get("killed", [])):
        return SURVIVORS
    if strays and not kill:
        return NO
    # Every stray found was stopped, or none was found (issue 25): clean only
    # where every process could be read (issue 45).
    return INCOMPLETE if doc["not_inspected"] else 0


def _confirm(question: str) -> bool | None:
    """Yes or no at the terminal (click's prompt); None: ^C or end of input."""
    import click  # lazy: only to ask at a terminal (the plain path runs without click)

    try:
        return click.confirm(question)
    except click.exceptions.Abort:
        return None


def _killed_lines(doc: dict[str, Any]) -> list[str]:
    out = []
    for k in doc.get("killed", []):
        state = "stopped" if k.get("stopped") else "NOT stopped"
        out.append(f"pid {k['pid']}: {state} {k.get('why') or k.get('outcome', '')}")
        for s in k.get("survivors", []):
            out.append(f"  survivor pid {s['pid']} ({s['found_by']}): {s['command']}")
    return out


def adopt_hints(doc: dict[str, Any]) -> list[str]:
    """For each stray process of the caller's (root: anyone's) on a device (not only
    its class's shared nodes) that no lease holds, the command that gives it a lease
    (``--adopt``); not for one below another such stray (that one's tree has it)."""
    from hold_supervisor.proc.scan import ancestors  # lazy: loaded by the scan already

    uid = os.geteuid()
    rows = {
        r["pid"]: r
        for r in doc["holders"]
        if not r["covered"]
        and r["lease"] is None
        and r["index"] is not None
        and uid in (0, r["uid"])
    }
    out: list[str] = []
    for pid, r in rows.items():
        if any(a.pid in rows for a in ancestors(pid)):
            continue
        cls = r["cls"]
        prog = f"{cls}-hold" if cls in ("npu", "gpu") else f"hold run --device {cls}"
        # The pid last: a line with " PID " in it is that process's row.
        out.append(f"to lease a stray of yours: {prog} -t DURATION --adopt {pid}")
    return out
