"""The lease conversation with the daemon: ask, wait in line, hear what ends it.

Shared by ``hold run``/``npu-hold`` (:mod:`hold.cli.run`) and ``hold up``
(:mod:`hold.cli.stack`). On the hot path of ``npu-hold``: nothing heavy
(click, yaml, structlog) is imported here at module level.

Exit statuses it returns: :data:`BUSY` (75: taken, or not granted within the
wait timeout), :data:`TOOL` (125: the daemon is gone, or is there and does
not answer), or the daemon's own refusal code.

Deadlines: the wait in line lasts as long as the caller asked
(``--wait-timeout``; without one, until granted), but never on a daemon that
has stopped reading: after :data:`~hold.client.connection.ANSWER_TIMEOUT` without a word
from it, it is asked whether it still reads (:meth:`hold.client.connection.Client.ping`,
answered from its event loop even while it checks a device), and one that
does not answer within as long ends the wait with 125 and a message naming
it. The caller's own deadline passing first (the daemon answered, the device
is taken) stays 75. A holder whose lease ``hold release`` ended exits
:data:`~hold_supervisor.exitcodes.RELEASED` (6), whatever its command made of the polite signal.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, NamedTuple

from hold.client.connection import ANSWER_TIMEOUT, DaemonSilent, DaemonUnreachable
from hold.protocol import Ev, Op
from hold_supervisor.exitcodes import BUSY, TOOL, USAGE
from hold_supervisor.parse import format_duration, format_until, format_when, time_left
from hold_supervisor.width import shown

if TYPE_CHECKING:
    from hold.client.connection import Client
    from hold.client.waitline import WaitLine
    from hold.devices.classes import DeviceClass
    from hold.protocol import Message
    from hold.statedir import StateDir

DEFAULT_TTL = 24 * 3600.0  # a lease without -t; shown by `hold status`


class Granted(NamedTuple):
    lease: str
    expires: float  # wall clock
    devices: list[int]


def acquire_lease(
    client: Client,
    sd: StateDir,
    say: Callable[[str], None],
    *,
    cls: str,
    indices: tuple[int, ...] | None,
    count: int,
    label: str,
    ttl: float,
    grace: float,
    wait: bool,
    wait_timeout: float | None,
    tree: Mapping[str, object] | None,
    env: dict[str, str],
    private: bool = False,
    live: WaitLine | None = None,
    meanwhile: Callable[[], object] | None = None,
) -> Granted | int:
    """Ask for a lease and wait in line (saying who holds the device after 1 s:
    on ``live``, a line redrawn in place, where given; else a line per change).

    Returns the grant, with the lease's variables added to ``env``
    (``HOLD_LEASE``, ``HOLD_DEVICES``, the class's visible-devices
    variables), or an exit status: 75 (busy, or not granted within
    ``wait_timeout``), 125 (daemon gone), or the daemon's refusal code.
    Shared by ``hold run``/``npu-hold`` and ``hold up``. ``meanwhile`` is
    called once the request is sent, before the first wait for an answer:
    work the caller needs only once granted, done while the daemon checks the
    device (or while in line) instead of after the grant.
    """
    # lazy: the device modules only once a device is asked for (hold run -- true asks none)
    from hold.devices.gpuids import usable_indices

    klass = _device_class(client, cls)
    # Inside an allocation (a Slurm job, a container) only the devices this
    # caller can use are asked for; the daemon grants from those alone.
    allowed = usable_indices(klass, os.environ) if klass is not None else None
    wanted = len(indices) if indices else count
    short = allowed is not None and len(set(allowed) & set(indices or allowed)) < wanted
    if klass is not None and short:
        # Refused here, saying why (a Slurm job given no GPU must not wait in line).
        from hold.devices.gpuids import why_unusable  # lazy: as above

        say(why_unusable(klass, os.environ, wanted))
        return USAGE
    ask = {
        "op": Op.ACQUIRE,
        "cls": cls,
        "indices": indices,
        "count": count,
        "label": label,
        "ttl": ttl,
        "grace": grace,
        "wait": wait,
        "tree": tree,
        "private": private,
        "allowed": allowed,
    }
    line = _Line(client, say, cls, ask, wait_timeout, live, meanwhile)
    try:
        return line.wait(sd, klass, env)
    finally:
        if live is not None:
            live.clear()


def _device_class(client: Client, cls: str) -> DeviceClass | None:
    """The daemon's definition of the class, where it sent one (it grants the
    devices, so its nodes are the ones the command is told about); else ours."""
    # lazy: the device modules only once a device is asked for (a stack may ask none)
    from hold.devices.classes import classes_from_defs

    theirs = classes_from_defs(client.info.get("class_defs") or {}).get(cls)
    if theirs is not None:
        return theirs
    from hold.config import load  # only for a daemon that sent no classes
    from hold.devices.classes import classes_from_config

    cfg = load()
    return classes_from_config(cfg.devices, cfg.path).get(cls)


class _Line:
    """One request's wait in line: the daemon's messages read until an answer."""

    def __init__(
        self,
        client: Client,
        say: Callable[[str], None],
        cls: str,
        ask: Message,
        wait_timeout: float | None,
        live: WaitLine | None = None,
        meanwhile: Callable[[], object] | None = None,
    ) -> None:
        self.client = client
        self.meanwhile = meanwhile
        self._say = say
        self.live = live
        self.cls = cls
        self.ask = ask
        self.wait_timeout = wait_timeout
        self.start = 0.0
        self.deadline: float | None = None
        self.heard = 0.0  # when the daemon last said something (monotonic)
        self.shown: object = None  # the last waiting message said
        self.latest: Message | None = None  # the last "queued" message heard

    def say(self, text: str) -> None:
        """A message of its own line (the live line, if drawn, makes way)."""
        if self.live is not None:
            self.live.clear()
        self._say(text)

    def _show(self, msg: Message | None) -> None:
        """Say where we stand: the live line redrawn, or a line (once per change)."""
        if self.live is not None:
            # lazy: only for a live line at a terminal
            from hold.client.waitline import summary

            self.shown = msg if msg is not None else True
            waited = time.monotonic() - self.start
            self.live.draw(summary(self.cls, msg, waited, self.live.width()))
        elif msg is not None and msg != self.shown:
            self.shown = msg
            self._say(describe_wait(self.cls, msg))

    def wait(self, sd: StateDir, klass: DeviceClass | None, env: dict[str, str]) -> Granted | int:
        """Send the request and wait: the grant (``env`` filled in), or an exit status."""
        try:
            self.client.send(self.ask)
        except OSError:  # the daemon went away since the session was opened
            if not self._ask_a_new_daemon():
                return TOOL
        if self.meanwhile is not None:
            self.meanwhile()
        self.start = self.heard = time.monotonic()
        self.deadline = None if self.wait_timeout is None else self.start + self.wait_timeout
        while True:
            try:
                msg = self.client.recv(self._wake())
            except TimeoutError:
                code = self._on_timeout()
                if code is not None:
                    return code
                continue
            self.heard = time.monotonic()
            if msg is None:
                # The daemon died before granting anything (it keeps no waiting
                # requests): start one and ask again, at the end of the line.
                self.say(
                    "the ticket daemon went away; asking a new one (the place in line is lost)"
                )
                if not self._ask_a_new_daemon():
                    return TOOL
                continue
            if msg.get("ev") == Ev.GRANTED:
                return self._granted(msg, sd, klass, env)
            code = self._on_message(msg)
            if code is not None:
                return code

    def _wake(self) -> float:
        """When to stop reading: at the 1 s mark to say who holds the device, and
        then each second for the live line; at the deadline; and after
        :data:`~hold.client.connection.ANSWER_TIMEOUT` without a word, to ask whether the
        daemon still reads."""
        # lazy: only while waiting in line; off hold run -- true's path
        from hold.client.waitline import REFRESH

        marks = [self.heard + ANSWER_TIMEOUT]
        if self.live is not None:
            waited = time.monotonic() - self.start
            marks.append(self.start + max(1.0, (int(waited / REFRESH) + 1) * REFRESH))
        elif self.shown is None and self.latest is not None:
            marks.append(self.start + 1.0)
        if self.deadline is not None:
            marks.append(self.deadline)
        return min(marks)

    def _ask_a_new_daemon(self) -> bool:
        """A new session (a daemon started if need be) and the request again."""
        try:
            self.client.reopen()
            self.client.send(self.ask)
        except (DaemonUnreachable, OSError, TimeoutError) as e:
            self.say(f"cannot reach the ticket daemon: {e}")
            return False
        return True

    def _on_timeout(self) -> int | None:
        """Nothing heard by the wake time: give up at the deadline; ask a daemon
        silent for too long whether it still reads (125 if not); else say who
        holds the device."""
        now = time.monotonic()
        if self.deadline is not None and now >= self.deadline:
            self.say(f"{self.cls} not granted within {self.wait_timeout:g}s; giving up")
            return BUSY
        if now >= self.heard + ANSWER_TIMEOUT:
            left = None if self.deadline is None else self.deadline - now
            try:
                # Within our own deadline: past it, the wait is over (75) whatever the daemon.
                self.client.ping(ANSWER_TIMEOUT if left is None else min(ANSWER_TIMEOUT, left))
            except DaemonSilent as e:
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    self.say(f"{self.cls} not granted within {self.wait_timeout:g}s; giving up")
                    return BUSY
                self.say(f"{e}; giving up the wait in line")
                return TOOL
            except OSError:
                pass  # the daemon went away: the next read says so
            self.heard = time.monotonic()
        if self.live is not None or self.latest is not None:
            self._show(self.latest)
        return None

    def _on_message(self, msg: Message) -> int | None:
        """A message other than the grant: an exit status if it ends the wait."""
        ev = msg.get("ev")
        if ev == Ev.QUEUED:
            self.latest = msg
            if time.monotonic() - self.start >= 1.0:
                self._show(msg)
        elif ev == Ev.BUSY:
            self.say(describe_wait(self.cls, msg, busy=True))
            return BUSY
        elif ev == Ev.WARNING:
            self.say("warning: granted although " + describe_wait(self.cls, msg, busy=True))
        elif ev == Ev.ERROR:
            self.say(str(msg.get("error")))
            return int(msg.get("code", TOOL))
        return None

    def _granted(
        self, msg: Message, sd: StateDir, klass: DeviceClass | None, env: dict[str, str]
    ) -> Granted:
        """The grant: the lease's variables into ``env``."""
        # lazy: the device modules only once a device is granted
        from hold.devices.gpuids import visible_env

        cls = self.cls
        lease = str(msg["lease"])
        devices = [int(i) for i in msg["devices"]]
        env["HOLD_LEASE"] = lease
        env["HOLD_DEVICES"] = ",".join(f"{cls}:{i}" for i in devices)
        # `hold check` inside the lease must ask this state directory
        # (and know this configuration's classes): the allowlist drops
        # HOLD_STATE_DIR, HOLD_CONFIG and XDG_RUNTIME_DIR, and without
        # them it would look in the default place and answer "no".
        env.setdefault("HOLD_STATE_DIR", sd.path)
        if os.environ.get("HOLD_CONFIG"):
            env.setdefault("HOLD_CONFIG", os.environ["HOLD_CONFIG"])
        if klass is not None:
            env.update(visible_env(klass, devices))
        if self.shown is not None:
            self.say(f"granted {env['HOLD_DEVICES']} (lease {lease})")
        return Granted(lease, float(msg["expires"]), devices)


def daemon_event(client: Client, say: Callable[[str], None]) -> tuple[str, str] | None:
    """What a message from the daemon means for a running lease holder:
    ``("expired" | "released" | "lost", detail)``, or None (nothing to do).

    If the daemon went away (crashed, restarted), one is started and the
    session re-attached; "lost" if that fails.
    """
    msgs = client.read_available()
    if msgs is None:
        try:
            ans = client.reattach()
        except (DaemonUnreachable, OSError, TimeoutError) as e:
            return ("lost", f"lost the ticket daemon and could not re-attach: {e}")
        if ans.get("ev") != Ev.ATTACHED:
            return ("lost", f"the daemon no longer knows this lease: {ans.get('error')}")
        say("re-attached to a restarted ticket daemon")
        msgs = [ans]
    for msg in msgs:
        if msg.get("ev") == Ev.EXPIRED:
            return ("expired", "the lease's time limit was reached")
        if msg.get("ev") == Ev.RELEASED:
            return ("released", f"lease released by {msg.get('by')}")
    return None


def describe_wait(cls: str, note: dict[str, object], busy: bool = False) -> str:
    holders = note.get("holders") or []
    assert isinstance(holders, list)
    now = time.time()
    parts = []
    for h in holders:
        since = now - float(h["since"])
        until = format_until(float(h["expires"]), now)
        devs = ",".join(str(d) for d in h["devices"])
        label = repr(h["label"]) if h.get("label") is not None else "a private lease"
        parts.append(
            f"{cls}:{devs} held by {label} (lease {h['lease']}, pid {h['pid']}, "
            f"user {h['user']}) for {format_duration(since)}, {until}"
        )
    blocked = note.get("blocked") or []
    assert isinstance(blocked, list)
    for b in blocked:
        for h in b["holders"]:
            mem = h.get("memory_bytes")
            used = f", {mem / 2**30:.1f} GiB on the device" if mem else ""
            # lazy: only for a refusal that names a stray
            from hold_supervisor.proc.origin import words

            whose = words(h.get("origin"))
            whose = f", {whose}" if whose else ""
            parts.append(
                f"{cls}:{b['index']} held OUTSIDE any lease by pid {h['pid']} (user "
                f"{h['user']}{whose}: {h['command']}{used})"
            )
    elsewhere = note.get("elsewhere") or []
    assert isinstance(elsewhere, list)
    for e in elsewhere:
        if "error" in e:
            parts.append(f"{cls}:{e['index']} cannot be locked ({e['error']})")
            continue
        if e.get("foreign") and e.get("record_by"):
            parts.append(
                f"{cls}:{e['index']} is locked by pid {e.get('pid', '?')} (user "
                f"{e.get('user', '?')}); whose lease it is cannot be told: its record "
                f"beside {e.get('path', '?')} was made by user {e['record_by']}"
            )
            continue
        if e.get("foreign"):
            parts.append(
                f"{cls}:{e['index']} is locked by pid {e.get('pid', '?')} (user "
                f"{e.get('user', '?')}), which is no ticket daemon: its lock file "
                f"{e.get('path', '?')} is held outside any lease"
            )
            continue
        when = ""
        if isinstance(e.get("since"), float) and isinstance(e.get("until"), float):
            when = (
                f", since {format_when(e['since'], now)}, until "
                f"{format_when(e['until'], now)}, {time_left(e['until'], now)}"
            )
        label = f" {e['label']!r}" if e.get("label") else ""
        parts.append(
            f"{cls}:{e['index']} held by user {e.get('user', '?')}'s lease"
            f"{label} (pid {e.get('pid', '?')}{when}) through another "
            "ticket daemon"
        )
    # Labels, users and commands come from other users and from lock files anyone
    # may write: never raw to a terminal (hold_supervisor.width.shown).
    who = shown("; ".join(parts)) or f"{cls} is being checked for the next holder"
    if busy:
        return f"{cls} is taken: {who}"
    pos = note.get("position")
    return f"waiting for {cls}, number {pos} in line: {who}"
