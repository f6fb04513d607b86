"""``hold top``: the live view (curses), or plain frames when not at a terminal.

Three sources, each the command's own document: the daemon's ``status``
answer (``hold status``), the running stacks' ``ps`` answers (``hold ps``,
handed in by the command line, which owns the stacks' directory), and the
stray scan (``hold audit``'s report). They are asked from two threads of their
own, so that a stopped daemon or a slow scan never freezes the screen: every
ask has its deadline (the client's answer wait; ``hold ps``'s), and until it
answers the view says so and shows what it had. The scan reads every process
of the machine, so it runs at its own, slower period (:func:`stray_period`).

Never starts a daemon (a view left open must not keep one alive, as ``hold
web``'s polls): with none, the view says so and asks again each period.

curses, from the standard library, paints the frame: it reads the keys, follows
a resize, draws red and puts the terminal back however the view ends (its
import costs about 1.5 ms; ``rich`` would cost 47 ms and read no keys).
"""

from __future__ import annotations

import curses
import locale
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hold.client.connection import Client
from hold.devices.classes import DeviceClass
from hold.errors import HoldError
from hold.protocol import Op
from hold.statedir import StateDir
from hold.views.audit import build_report
from hold.views.status import with_gpu
from hold.views.topframe import DIM, HEAD, RED, Line, Snapshot, frame
from hold_supervisor.parse import BadValue, parse_duration

if TYPE_CHECKING:
    import curses

DEFAULT_DELAY = 2.0  # seconds between frames, as nvitop
MIN_DELAY = 0.1  # below this the daemon would be asked for little gain
STRAY_MIN = 10.0  # the scan of every process: at most this often
KEY_WAIT_MS = 100  # how long a key is waited for before the loop looks again

# What an ask that failed raises: the daemon unreachable or silent (HoldError,
# TimeoutError), a socket's error, a refused answer or path (ValueError: BadValue,
# UnsafePath; ProtocolError is a HoldError). Said in the view, never a traceback.
FAILED = (OSError, ValueError, HoldError)

# stacks: the running stacks' ps answers and the names of those that did not answer
StacksOf = Callable[[], tuple[list[dict[str, Any]], list[str]]]


def parse_delay(text: str) -> float:
    """``-d``/``--delay`` in seconds (``2``, ``0.5``, ``500ms``, ``1m``): at least 100 ms."""
    seconds = parse_duration(text, what="--delay", plain_unit="seconds")
    if seconds < MIN_DELAY:
        raise BadValue("--delay", text, "at least 100ms (0.1 seconds)")
    return seconds


def stray_period(delay: float) -> float:
    """How often the strays are scanned for: every 5 frames, at most every 10 s."""
    return max(STRAY_MIN, 5 * delay)


class Sources:
    """Where a frame's parts come from, each asked within its deadline."""

    def __init__(self, sd: StateDir, classes: dict[str, DeviceClass], stacks: StacksOf) -> None:
        self.sd, self.classes, self.stacks_of = sd, classes, stacks

    def status(self) -> dict[str, Any]:
        """The daemon's ``status`` answer (none is started), with each NVIDIA GPU's
        utilisation and memory (:func:`hold.views.status.with_gpu`); one of
        :data:`FAILED` if none."""
        client = Client.connect(self.sd, autostart=False)
        try:
            ans: dict[str, Any] = client.request({"op": Op.STATUS})
        finally:
            client.close()
        return with_gpu(ans)

    def audit(self) -> dict[str, Any]:
        """``hold audit --json``'s report (every class; nothing is stopped)."""
        return build_report(self.sd, self.classes, None)

    def stacks(self) -> tuple[list[dict[str, Any]], list[str]]:
        return self.stacks_of()


class Feed:
    """The snapshot the frames are made of, and the asks that keep it fresh."""

    def __init__(self, sources: Sources, delay: float) -> None:
        self.sources, self.delay = sources, delay
        self.stray_every = stray_period(delay)
        self.snap = Snapshot()
        self.lock = threading.Lock()  # snap is replaced part by part under it
        self.version = 0  # bumped at each change: the screen is redrawn
        self.polls = 0  # the daemon and the stacks asked so many times (frames, for -n)
        self.stop = threading.Event()
        self.wake = threading.Event()  # space: ask everything now
        self.wake_scan = threading.Event()

    def poll_status(self) -> None:
        """Ask the daemon and the stacks once (each within its deadline)."""
        try:
            ans, err = self.sources.status(), None
        except FAILED as e:
            ans, err = None, str(e) or type(e).__name__
        try:
            stacks, silent = self.sources.stacks()
            stacks_err = None
        except FAILED as e:
            stacks, silent, stacks_err = [], [], str(e) or type(e).__name__
        with self.lock:
            if ans is not None:
                self.snap.status, self.snap.status_at = ans, time.time()
            self.snap.status_error = err
            self.snap.stacks, self.snap.stacks_silent = stacks, silent
            self.snap.stacks_error = stacks_err
            self.version += 1
            self.polls += 1

    def poll_audit(self) -> None:
        """Scan for strays once."""
        try:
            doc, err = self.sources.audit(), None
        except FAILED as e:
            doc, err = None, str(e) or type(e).__name__
        with self.lock:
            if doc is not None:
                self.snap.audit, self.snap.audit_at = doc, time.time()
            self.snap.audit_error = err
            self.version += 1

    def start(self) -> None:
        """The two asking threads (daemon threads: a quit never waits for an ask)."""
        for target in (self._status_loop, self._audit_loop):
            threading.Thread(target=target, daemon=True).start()

    def refresh(self) -> None:
        self.wake.set()
        self.wake_scan.set()

    def _status_loop(self) -> None:
        while not self.stop.is_set():
            self.poll_status()
            self.wake.wait(self.delay)
            self.wake.clear()

    def _audit_loop(self) -> None:
        while not self.stop.is_set():
            self.poll_audit()
            self.wake_scan.wait(self.stray_every)
            self.wake_scan.clear()

    def lines(self, width: int | None, height: int | None) -> list[Line]:
        with self.lock:
            return frame(self.snap, width, height, time.time(), self.delay, self.stray_every)


def main_top(
    sd: StateDir,
    classes: dict[str, DeviceClass],
    stacks: StacksOf,
    delay: float,
    iterations: int | None,
) -> int:
    """Run the view: live at a terminal until ``q`` (or ``iterations`` frames), else
    ``iterations`` plain frames (one by default). 0."""
    feed = Feed(Sources(sd, classes, stacks), delay)
    if not (os.isatty(sys.stdin.fileno()) and os.isatty(sys.stdout.fileno())):
        try:
            return _plain(feed, 1 if iterations is None else iterations)
        except KeyboardInterrupt:
            return 0
        except BrokenPipeError:  # its reader is gone (| head): nothing more to say
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
            return 0

    locale.setlocale(locale.LC_ALL, "")  # curses writes non-ASCII text by the locale's encoding
    # The screen's own size, not LINES/COLUMNS (which ncurses would prefer and never
    # change): the view fills the terminal and follows its resizes.
    os.environ.pop("LINES", None)
    os.environ.pop("COLUMNS", None)
    feed.start()
    try:
        curses.wrapper(_live, feed, iterations)
    except KeyboardInterrupt:  # Ctrl-C: as q (curses.wrapper has put the terminal back)
        pass
    finally:
        feed.stop.set()
    return 0


def _plain(feed: Feed, iterations: int) -> int:
    """``iterations`` frames as plain lines, ``delay`` apart, a blank line between."""
    next_scan = 0.0
    for n in range(iterations):
        if n:
            time.sleep(feed.delay)
            print(flush=True)
        feed.poll_status()
        if time.monotonic() >= next_scan:
            feed.poll_audit()
            next_scan = time.monotonic() + feed.stray_every
        print("\n".join(line.text for line in feed.lines(None, None)), flush=True)
    return 0


def _live(scr: curses.window, feed: Feed, iterations: int | None) -> None:
    """Paint until ``q`` (or the frame after the ``iterations``-th, each shown a period)."""
    try:
        curses.curs_set(0)
    except curses.error:
        pass  # a terminal that cannot hide its cursor shows it
    styles = {HEAD: curses.A_BOLD, DIM: curses.A_DIM, RED: curses.A_BOLD}
    if curses.has_colors():
        curses.use_default_colors()
        curses.init_pair(1, curses.COLOR_RED, -1)
        styles[RED] = curses.color_pair(1) | curses.A_BOLD
    scr.timeout(KEY_WAIT_MS)
    shown_version, shown_at = -1, 0.0
    while True:
        key = scr.getch()
        if key in (ord("q"), ord("Q")):
            return
        if key == ord(" "):
            feed.refresh()
        if iterations is not None and feed.polls > iterations:
            return
        # A new answer, a resize, or the clock (the time left counts down): redraw.
        stale = time.monotonic() - shown_at >= min(feed.delay, 1.0)
        if feed.version != shown_version or key == curses.KEY_RESIZE or stale:
            shown_version, shown_at = feed.version, time.monotonic()
            _paint(scr, feed, styles)


def _paint(scr: curses.window, feed: Feed, styles: dict[str, int]) -> None:
    height, width = scr.getmaxyx()
    scr.erase()
    for y, line in enumerate(feed.lines(width, height)):
        try:  # the bottom-right cell cannot be written without an error: fit() leaves it
            scr.addstr(y, 0, line.text, styles.get(line.style, curses.A_NORMAL))
        except curses.error:
            pass
    scr.refresh()
