"""The daemon survives any bytes on its socket (issue 9), and the strict decoder behind it.

Each daemon test starts one real daemon (a real ``hold run`` autostarts it and
holds a lease on ``fake:0``), then feeds hostile bytes to its socket, raw:
framing, encodings, JSON that Python's parser takes but JSON forbids, wrong
types in every field of every op, stalled and crowding connections, and a
seeded random fuzz. After each item: the daemon is the same process, the
lease is intact (its token, its holder, its command) and a fresh client is
served. A message that cannot be decoded is answered with
``{"ev": "error", "code": 2}`` and ends that connection only.

Every failure is collected, with the daemon's log of that moment (its
traceback, if it died), and reported together at the end of the test; a
daemon that died is replaced (the holder re-attaches to the one it starts)
so that the rest of the corpus is still tried.

The unit tests at the end cover :mod:`hold_supervisor.jsonlines` itself, the
stack's control socket and ``hold call --json-args``.
"""

from __future__ import annotations

import json
import os
import random
import resource
import select
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import HOLD, LOADED, alive, daemon_pid, wait_for

from hold.cli.call import parse_args
from hold.daemon.tokens import read_record
from hold.protocol import MAX_DEPTH, MAX_MESSAGE, LineBuffer, ProtocolError
from hold_supervisor import jsonlines
from hold_supervisor.jsonlines import BadJSON, strict_loads

# Seconds a healthy daemon may take to answer one exchange: it has no
# time-based cut-off, so what this separates is answered from never, on a
# machine under load.
ANSWER_WAIT = LOADED
TREE = "0123456789abcdef"  # a well-formed tree id that names no process anywhere
NO_PID = (1 << 22) + 1  # above any pid_max: never a process, let alone one of ours


def line(msg: Any) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode() + b"\n"


# --------------------------------------------------------------------------
# Talking to the daemon raw.


@dataclass
class Talk:
    """What one connection got back: the answers, whether the daemon closed it,
    whether our sending failed (it closed first), and whether it went quiet."""

    answers: list[dict[str, Any]] = field(default_factory=list)
    closed: bool = False
    send_failed: bool = False
    timed_out: bool = False
    bad_answer: str | None = None

    @property
    def served(self) -> bool:
        return any(a.get("ev") == "status" for a in self.answers)

    def first(self) -> dict[str, Any] | None:
        return self.answers[0] if self.answers else None

    def __str__(self) -> str:
        flags = [n for n in ("closed", "send_failed", "timed_out") if getattr(self, n)]
        answers = [json.dumps(a)[:200] for a in self.answers[:4]]
        extra = f" bad answer: {self.bad_answer}" if self.bad_answer else ""
        return f"answers {answers} {' '.join(flags)}{extra}"


def connect(path: str) -> socket.socket:
    """A connection as a client makes it: connect() waits while the daemon's
    backlog is full (a socket with a Python timeout would fail at once with
    EAGAIN), but here no longer than ANSWER_WAIT (SO_SNDTIMEO bounds that wait)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(ANSWER_WAIT), 0))
    s.connect(path)
    s.settimeout(ANSWER_WAIT)
    return s


def read_until(s: socket.socket, talk: Talk, done: Callable[[Talk], bool], wait: float) -> None:
    """Answers into ``talk`` until ``done``, end of file, or ``wait`` seconds."""
    lines = jsonlines.LineBuffer(1 << 24)
    poller = select.poll()  # not select(): a crowd of sockets goes past FD_SETSIZE
    poller.register(s, select.POLLIN)
    deadline = time.monotonic() + wait
    while not done(talk):
        left = deadline - time.monotonic()
        if left <= 0:
            talk.timed_out = True
            return
        if not poller.poll(left * 1000):
            continue
        try:
            data = s.recv(1 << 16)
        except (ConnectionResetError, TimeoutError):
            data = b""
        if not data:
            talk.closed = True
            return
        try:
            talk.answers += lines.feed(data)
        except BadJSON as e:  # the daemon's own answers must be strict JSON too
            talk.bad_answer = str(e)
            return


def converse(path: str, payload: bytes, prelude: list[dict[str, Any]] | None = None) -> Talk:
    """Send ``prelude`` (each answered before the next), then ``payload``, then a
    newline and a status request: the answers up to the status, or the close."""
    # A tree id is one tree, daemon-wide, until its session has ended: each
    # exchange names a fresh one wherever the corpus says TREE.
    fresh = os.urandom(8).hex().encode()
    payload = payload.replace(TREE.encode(), fresh)
    talk = Talk()
    with connect(path) as s:
        for msg in prelude or []:
            s.sendall(line(msg).replace(TREE.encode(), fresh))
            pre = Talk()
            read_until(s, pre, lambda t: bool(t.answers), ANSWER_WAIT)
            if not pre.answers or pre.answers[0].get("ev") == "error":
                raise AssertionError(f"prelude {msg} was not taken: {pre}")
        try:
            s.sendall(payload)
            s.sendall(b'\n{"op":"status"}\n')  # ends a partial line, then asks
        except OSError:
            talk.send_failed = True  # it closed on us: its answer may still be there
        read_until(s, talk, lambda t: t.served, ANSWER_WAIT)
    return talk


def raw_status(path: str) -> dict[str, Any]:
    """A fresh client's status request, answered within ANSWER_WAIT seconds."""
    talk = Talk()
    with connect(path) as s:
        s.sendall(b'{"op":"status"}\n')
        read_until(s, talk, lambda t: t.served, ANSWER_WAIT)
    if not talk.served:
        raise AssertionError(f"a fresh status request was not served: {talk}")
    return next(a for a in talk.answers if a.get("ev") == "status")


# --------------------------------------------------------------------------
# The lab: a daemon, a lease held on it by a real client, and the checks.


def configure(base: Path) -> None:
    nodes = base / "fake-nodes"
    nodes.mkdir()
    for i in range(2):
        (nodes / f"fakedev{i}").write_text("")
    (base / "config.yaml").write_text(
        f'cgroups: auto\ndevices:\n  fake: {{nodes: ["{nodes}/fakedev*"]}}\n'
    )


class Lab:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.state = Path(os.environ["HOLD_STATE_DIR"])
        self.sock = str(self.state / "daemon.sock")
        self.token = self.state / "fake-0.token"
        self.log = self.state / "daemon.log"
        self.holder: subprocess.Popen[bytes] | None = None
        self.record: dict[str, Any] = {}
        self.pid = 0
        self.failures: list[str] = []
        self.starts = 0

    # -- life

    def start(self) -> None:
        self.starts += 1
        err = open(self.base / f"holder{self.starts}.stderr", "wb")  # noqa: SIM115
        try:
            self.holder = subprocess.Popen(
                [
                    *HOLD,
                    "run",
                    "-d",
                    "fake:0",
                    "-l",
                    "keep",
                    "-t",
                    "5m",
                    "--grace",
                    "1s",
                    "--",
                    "sleep",
                    "300",
                ],
                stdin=subprocess.DEVNULL,
                stdout=err,
                stderr=err,
            )
        finally:
            err.close()
        holder = self.holder
        self.record = wait_for(
            lambda: (
                (r := read_record(str(self.token)))
                and r.get("holder_pid") == holder.pid
                and r.get("command_pid")
                and r
            ),
            20,
            0.02,
            "the holder's lease on fake:0",
        )
        pid = daemon_pid(self.state)
        assert pid is not None
        self.pid = pid

    def stop(self) -> None:
        h = self.holder
        if h is None:
            return
        self.holder = None
        if h.poll() is None:
            h.send_signal(signal.SIGTERM)
        try:
            h.wait(20)
        except subprocess.TimeoutExpired:
            h.kill()
            h.wait()

    # -- checks

    def problems(self) -> list[str]:
        """What is wrong with the daemon or the held lease now (empty: nothing)."""
        out = []
        now = daemon_pid(self.state)
        if now != self.pid or not alive(self.pid):
            out.append(f"the daemon (pid {self.pid}) is gone; now serving: {now}")
        rec = read_record(str(self.token))
        if rec is None or rec.get("lease") != self.record["lease"]:
            out.append(f"the lease's token changed: {rec}")
        if self.holder is None or self.holder.poll() is not None:
            out.append("the holder (hold run) has ended")
        if not alive(int(self.record["command_pid"])):
            out.append("the lease's command has ended")
        if not out:
            try:
                status = raw_status(self.sock)
            except (OSError, AssertionError) as e:
                out.append(f"a fresh client was not served: {e}")
            else:
                if self.record["lease"] not in json.dumps(status):
                    out.append(f"status no longer shows the lease: {status}")
        return out

    def log_size(self) -> int:
        try:
            return self.log.stat().st_size
        except OSError:
            return 0

    def log_since(self, offset: int) -> str:
        """The daemon's log from ``offset``: tracebacks and error events only."""
        try:
            with open(self.log, "rb") as f:
                f.seek(offset)
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return ""
        keep, in_tb = [], False
        for ln in text.splitlines():
            if ln.startswith("Traceback"):
                in_tb = True
            if in_tb or '"level": "error"' in ln:
                keep.append(ln)
            if in_tb and ln and not ln.startswith((" ", "Traceback")):
                in_tb = False  # the exception line ends the traceback
        return "\n".join(keep)[-4000:]

    def recover(self) -> None:
        """After a failure: the same lease on a live daemon again (the holder
        re-attaches to the daemon it starts), or a fresh lab."""

        def back() -> bool:
            pid = daemon_pid(self.state)
            rec = read_record(str(self.token))
            return (
                pid is not None
                and rec is not None
                and rec.get("lease") == self.record["lease"]
                and self.holder is not None
                and self.holder.poll() is None
            )

        try:
            wait_for(back, 20, 0.05, "the holder to re-attach")
            pid = daemon_pid(self.state)
            assert pid is not None
            self.pid = pid
            raw_status(self.sock)
        except (AssertionError, OSError):
            self.stop()
            from conftest import stop_daemon

            stop_daemon(self.state)
            self.start()

    # -- the corpus

    def item(self, name: str, run: Callable[[], str | None]) -> None:
        """Run one hostile item: ``run`` says what was wrong with the answer (or
        None); then the checks. A failure is recorded, and the lab recovered."""
        offset = self.log_size()
        try:
            wrong = run()
        except (OSError, AssertionError) as e:
            wrong = f"{type(e).__name__}: {e}"
        found = self.problems()
        if wrong is None and not found:
            return
        log = self.log_since(offset)
        text = f"[{name}] " + "; ".join(([wrong] if wrong else []) + found)
        if log:
            text += "\n    daemon log:\n    " + log.replace("\n", "\n    ")
        self.failures.append(text)
        if found:
            self.recover()

    def report(self, total: int) -> None:
        if self.failures:
            pytest.fail(
                f"{len(self.failures)} of {total} hostile items failed:\n\n"
                + "\n\n".join(self.failures),
                pytrace=False,
            )


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    configure(tmp_path)
    lb = Lab(tmp_path)
    lb.start()
    try:
        yield lb
    finally:
        lb.stop()


# --------------------------------------------------------------------------
# Expectations for one exchange.


def closes(talk: Talk) -> str | None:
    """Refused as undecodable: an error with code 2, then that connection closed."""
    first = talk.first()
    if talk.bad_answer or first is None or first.get("ev") != "error" or first.get("code") != 2:
        return f"expected an error (code 2) and the close, got {talk}"
    if talk.served or not talk.closed:
        return f"expected the connection closed after the error, got {talk}"
    return None


def errs(talk: Talk) -> str | None:
    """Refused: the first answer is an error (the connection may stay)."""
    first = talk.first()
    if talk.bad_answer or first is None or first.get("ev") != "error":
        return f"expected an error, got {talk}"
    return None


def serves(talk: Talk) -> str | None:
    """Taken: no error, and the status request after it is answered."""
    if talk.bad_answer or not talk.served or any(a.get("ev") == "error" for a in talk.answers):
        return f"expected to be served without an error, got {talk}"
    return None


def answers(talk: Talk) -> str | None:
    """Anything but silence: answered up to the status request, or closed."""
    if talk.bad_answer or talk.timed_out:
        return f"expected an answer or the close, got {talk}"
    return None


Expect = Callable[[Talk], "str | None"]
Item = tuple[str, bytes, list[dict[str, Any]], Expect]

OPEN: list[dict[str, Any]] = [{"op": "open"}]
WITH_TREE: list[dict[str, Any]] = [{"op": "open"}, {"op": "tree", "tree_id": TREE, "grace": 1}]
ACQUIRE: dict[str, Any] = {
    "op": "acquire",
    "cls": "fake",
    "count": 1,
    "label": "t",
    "ttl": 60,
    "grace": 1,
    "wait": False,
}


def acquire_text(**fields: str) -> bytes:
    """An acquire line with some fields given as raw JSON text."""
    parts = [f'"{k}":{json.dumps(v)}' for k, v in ACQUIRE.items() if k not in fields]
    parts += [f'"{k}":{v}' for k, v in fields.items()]
    return ("{" + ",".join(parts) + "}\n").encode()


def nested(depth: int) -> str:
    """A status request whose object nests ``depth`` deep in all (itself included)."""
    return '{"op":"status","x":' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


def framing_items() -> list[Item]:
    pad = MAX_MESSAGE - len('{"op":"status","pad":""}')
    return [
        ("10 MB without a newline", b'{"op":"status","pad":"' + b"a" * (10 << 20), [], closes),
        (
            "one byte over the limit, with its newline",
            b'{"op":"status","pad":"' + b"a" * (pad + 1) + b'"}\n',
            [],
            closes,
        ),
        ("exactly the limit", b'{"op":"status","pad":"' + b"a" * pad + b'"}\n', [], serves),
        ("an empty line", b"\n", [], serves),
        ("a line of JSON whitespace", b" \t\r \n", [], serves),
        ("100k empty lines", b"\n" * 100_000, [], serves),
        ("CRLF", b'{"op":"status"}\r\n', [], serves),
        ("two objects on one line", b'{"op":"status"}{"op":"status"}\n', [], closes),
        ("trailing garbage", b'{"op":"status"} x\n', [], closes),
        ("an array", b'[{"op":"status"}]\n', [], closes),
        ("a string", b'"status"\n', [], closes),
        ("a number", b"1\n", [], closes),
        ("null", b"null\n", [], closes),
        ("a vertical tab", b"\x0b\n", [], closes),
        ("an unterminated string full of brackets", b'{"op":"' + b"[" * 1000 + b"\n", [], closes),
        ("single quotes", b"{'op':'status'}\n", [], closes),
        ("a trailing comma", b'{"op":"status",}\n', [], closes),
        ("a comment", b'{"op":"status"} // hi\n', [], closes),
        ("a NUL after the object", b'{"op":"status"}\x00\n', [], closes),
        ("a raw NUL in a string", b'{"op":"status","x":"a\x00b"}\n', [], closes),
        ("a lone NUL", b"\x00\n", [], closes),
        ("a raw newline splitting a string", b'{"op":"status","x":"a\nb"}\n', [], closes),
    ]


def encoding_items() -> list[Item]:
    def status_with(raw: bytes) -> bytes:
        return b'{"op":"status","x":"' + raw + b'"}\n'

    def acq_label(escaped: str) -> bytes:
        return acquire_text(label=f'"{escaped}"')

    status = b'{"op":"status"}\n'
    return [
        ("an invalid byte", status_with(b"\xff"), [], closes),
        ("an overlong '/'", status_with(b"\xc0\xaf"), [], closes),
        ("an encoded surrogate", status_with(b"\xed\xa0\x80"), [], closes),
        ("a truncated sequence", status_with(b"\xe2\x82"), [], closes),
        ("beyond U+10FFFF", status_with(b"\xf4\x90\x80\x80"), [], closes),
        ("Latin-1", status_with("é".encode("latin-1")), [], closes),
        ("a UTF-8 byte order mark", b"\xef\xbb\xbf" + status, [], closes),
        ("UTF-16", '{"op":"status"}\n'.encode("utf-16-le"), [], closes),
        ("UTF-32", '{"op":"status"}\n'.encode("utf-32-le"), [], closes),
        ("a lone high surrogate in a label", acq_label("\\ud800"), OPEN, closes),
        ("a lone low surrogate in a label", acq_label("\\udfff"), OPEN, closes),
        ("a high surrogate before a letter", acq_label("a\\ud800\\u0041"), OPEN, closes),
        ("a reversed pair", acq_label("\\udc00\\ud800"), OPEN, closes),
        ("a lone surrogate in a key", b'{"\\ud800":1,"op":"status"}\n', [], closes),
        ("a lone surrogate as the op", b'{"op":"\\ud800"}\n', [], closes),
        ("a lone surrogate in a session", b'{"op":"attach","session":"\\udc80"}\n', [], closes),
        ("a lone surrogate in a lease", b'{"op":"release","lease":"\\udc80"}\n', [], closes),
        ("a lone surrogate in a class", b'{"op":"check","cls":"\\udc80"}\n', [], closes),
        ("a lone surrogate in a tree id", acquire_text(tree='{"tree_id":"\\udc80"}'), OPEN, closes),
        (
            "a lone surrogate in a leaf",
            b'{"op":"tree","tree_id":"' + TREE.encode() + b'","leaf":"/x/\\udc80"}\n',
            OPEN,
            closes,
        ),
        ("a lone surrogate in a nested list", b'{"op":"status","x":[["\\ud800"]]}\n', [], closes),
        ("a valid pair (an emoji) in a label", acq_label("\\ud83d\\ude00 ok"), OPEN, serves),
        ("raw UTF-8 in a label", acquire_text(label='"Grüße ✓"'), OPEN, serves),
        ("an escaped NUL in a label", acq_label("a\\u0000b"), OPEN, errs),
        ("an escaped NUL in the op", b'{"op":"sta\\u0000tus"}\n', [], errs),
        (
            "an escaped NUL in a leaf",
            b'{"op":"tree","tree_id":"' + TREE.encode() + b'","leaf":"/sys/\\u0000"}\n',
            OPEN,
            errs,
        ),
        ("a line separator in a label", acq_label("a\\u2028b"), OPEN, errs),
        ("an escaped newline in a label", acq_label("a\\nb"), OPEN, errs),
    ]


def json_items() -> list[Item]:
    big = "9" * 400
    return [
        ("arrays 5,000 deep", b"[" * 5000 + b"]" * 5000 + b"\n", [], closes),
        ("objects 5,000 deep", b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"\n", [], closes),
        ("60,000 unclosed brackets", b"[" * 60_000 + b"\n", [], closes),
        ("deep inside a field", nested(200).encode() + b"\n", [], closes),
        (f"nested {MAX_DEPTH} deep (the limit)", nested(MAX_DEPTH).encode() + b"\n", [], serves),
        (f"nested {MAX_DEPTH + 1} deep", nested(MAX_DEPTH + 1).encode() + b"\n", [], closes),
        ("a duplicate op", b'{"op":"status","op":"open"}\n', [], closes),
        (
            "a duplicate key spelled with an escape",
            b'{"op":"status","\\u006fp":"open"}\n',
            [],
            closes,
        ),
        ("a duplicate label", acquire_text(label='"a","label":"b"'), OPEN, closes),
        (
            "a duplicate key in the tree",
            acquire_text(tree=f'{{"tree_id":"{TREE}","tree_id":"{TREE}"}}'),
            OPEN,
            closes,
        ),
        ("NaN as the time limit", acquire_text(ttl="NaN"), OPEN, closes),
        ("Infinity as the time limit", acquire_text(ttl="Infinity"), OPEN, closes),
        ("-Infinity as the grace", acquire_text(grace="-Infinity"), OPEN, closes),
        ("1e400 as the time limit", acquire_text(ttl="1e400"), OPEN, closes),
        ("-1e400 as the grace", acquire_text(grace="-1e400"), OPEN, closes),
        ("NaN in a status request", b'{"op":"status","x":NaN}\n', [], closes),
        ("a 400-digit time limit", acquire_text(ttl=big), OPEN, closes),
        ("a 400-digit grace", acquire_text(grace=big), OPEN, closes),
        ("a 400-digit count", acquire_text(count=big), OPEN, closes),
        ("a 5,000-digit count", acquire_text(count="9" * 5000), OPEN, closes),
        ("a 400-digit index", acquire_text(indices=f"[{big}]"), OPEN, closes),
        (
            "a 400-digit pid",
            f'{{"op":"root","tree_id":"{TREE}","pid":{big}}}\n'.encode(),
            WITH_TREE,
            closes,
        ),
        (
            "a 400-digit tree grace",
            acquire_text(tree=f'{{"tree_id":"{TREE}","grace":{big}}}'),
            OPEN,
            closes,
        ),
        ("a count of 10**39", acquire_text(count=str(10**39)), OPEN, errs),
        ("a time limit of 1e308", acquire_text(ttl="1e308"), OPEN, errs),
        ("a 60,000-digit fraction", b'{"op":"status","x":0.' + b"1" * 60_000 + b"}\n", [], serves),
        (
            "5,000 keys",
            ("{" + ",".join(f'"k{i}":0' for i in range(5000)) + ',"op":"status"}\n').encode(),
            [],
            serves,
        ),
    ]


def field_items() -> list[Item]:
    """Wrong types (and values) for every field of every op."""
    items: list[Item] = []
    text: list[Any] = [1, None, True, 1.5, [], {}, ["x"], {"a": 1}, "", "x" * 10_000]

    def add(name: str, msg: dict[str, Any], prelude: list[dict[str, Any]], expect: Expect) -> None:
        items.append((name, line(msg), prelude, expect))

    for v in [1, None, True, [], {}, "OPEN", "open ", "", ["open"]]:
        add(f"op {v!r}", {"op": v}, [], errs)
    add("no op", {}, [], errs)
    add("no op, other fields", {"cls": "fake", "label": "x"}, [], errs)
    for op in ("attach", "release"):
        key = "session" if op == "attach" else "lease"
        add(f"{op} without its {key}", {"op": op}, [], errs)
        for v in text:
            add(f"{op} {key}={v!r:.20}", {"op": op, key: v}, [], errs)
    add("check without its class", {"op": "check"}, [], errs)
    for v in [1, None, True, [], {}, ["fake"], "", "nosuch"]:
        add(f"check cls={v!r}", {"op": "check", "cls": v}, [], errs)
    for op in ("open", "status", "end"):
        add(f"{op} with junk fields", {"op": op, "session": [1], "cls": {}, "x": None}, [], answers)
    add("open twice", {"op": "open"}, OPEN, errs)

    bad: dict[str, list[Any]] = {
        "cls": [1, None, True, [], {}, ["fake"], "", "nosuch", "FAKE"],
        "count": ["1", 1.5, -1, 0, True, [], {}, [1], 3, 2**63],
        "indices": [1, "0", ["0"], [-1], [2], [0.5], [None], [[0]], {"0": 1}, True, [2**63]],
        "label": [1, None, True, [], {}, ["a"], "", "a\nb", "x" * 201, "a\x7fb", "a\x85b"],
        "ttl": ["60", None, True, [], {}, -1, 0, 2**63],
        "grace": ["1", True, [], {}, -1, 2**63],
        "tree": [
            1,
            "x",
            [1],
            True,
            {"tree_id": 1},
            {"tree_id": "zz"},
            {"tree_id": TREE, "grace": "x"},
            {"tree_id": TREE, "grace": -1},
            {"tree_id": TREE, "leaf": 1},
            {"tree_id": TREE, "leaf": "/etc"},
            {"tree_id": TREE, "leaf": "../x"},
        ],
        "wait": ["no", [1], {"a": 1}, 2],
    }
    for key, values in bad.items():
        for v in values:
            add(f"acquire {key}={v!r:.20}", {**ACQUIRE, key: v}, OPEN, errs)
    for key in ("cls", "label", "ttl"):
        add(f"acquire without {key}", {k: v for k, v in ACQUIRE.items() if k != key}, OPEN, errs)
    add("acquire without a session", ACQUIRE, [], errs)

    tree = {"op": "tree", "tree_id": TREE, "grace": 1}
    for v in [1, None, [], {}, "", "zz", "0123", TREE.upper(), "../../x", TREE * 3]:
        add(f"tree tree_id={v!r:.20}", {**tree, "tree_id": v}, OPEN, errs)
    for v in ["x", -1, [], {}, 2**63, True]:
        add(f"tree grace={v!r:.20}", {**tree, "grace": v}, OPEN, errs)
    for v in [1, [], {}, "", "/", "/etc/passwd", "relative", "/sys/fs/cgroup/../../etc"]:
        add(f"tree leaf={v!r:.20}", {**tree, "leaf": v}, OPEN, errs)
    add("tree without a session", tree, [], errs)

    root = {"op": "root", "tree_id": TREE, "pid": NO_PID}
    for v in [1, None, [], {}]:
        add(f"root tree_id={v!r:.20}", {**root, "tree_id": v}, WITH_TREE, errs)
    for v in ["x", None, True, 1.5, [], {}, str(NO_PID), 2**63]:
        add(f"root pid={v!r:.20}", {**root, "pid": v}, WITH_TREE, errs)
    for v in [-1, 0, NO_PID]:
        add(f"root pid={v!r} (no such process)", {**root, "pid": v}, WITH_TREE, answers)
    add("root without a session", root, [], answers)
    add("root of an unknown tree", {**root, "tree_id": "f" * 16}, WITH_TREE, answers)
    add("a valid acquire of the free device", ACQUIRE, OPEN, serves)
    return items


def run_items(lab: Lab, items: list[Item], budget: float = 40.0) -> None:
    start = time.monotonic()
    for n, (name, payload, prelude, expect) in enumerate(items):
        if time.monotonic() - start > budget:
            lab.failures.append(f"[time budget] {len(items) - n} items not run, from {name!r}")
            break

        def run(
            payload: bytes = payload,
            prelude: list[dict[str, Any]] = prelude,
            expect: Expect = expect,
        ) -> str | None:
            return expect(converse(lab.sock, payload, prelude))

        lab.item(name, run)
    lab.report(len(items))


# --------------------------------------------------------------------------
# The corpus, against a real daemon.


@pytest.mark.timeout(120)
def test_framing(lab: Lab) -> None:
    run_items(lab, framing_items())


@pytest.mark.timeout(120)
def test_encoding(lab: Lab) -> None:
    run_items(lab, encoding_items())


@pytest.mark.timeout(120)
def test_json(lab: Lab) -> None:
    run_items(lab, json_items())


@pytest.mark.timeout(120)
def test_wrong_fields_of_every_op(lab: Lab) -> None:
    run_items(lab, field_items(), budget=80.0)


def test_a_half_line_and_stalled_clients_block_no_one(lab: Lab) -> None:
    """Half a line, then nothing; and 50 clients each 60 KiB into a line:
    everyone else is served at once, and the half line, completed later, too."""
    half = connect(lab.sock)
    stalled = []
    try:
        half.sendall(b'{"op":"sta')
        for _ in range(50):
            s = connect(lab.sock)
            stalled.append(s)
            s.sendall(b'{"op":"status","pad":"' + b"a" * (60 << 10))

        def fresh() -> str | None:
            t0 = time.monotonic()
            res = subprocess.run(
                [*HOLD, "status", "--json"], capture_output=True, text=True, timeout=30
            )
            took = time.monotonic() - t0
            if res.returncode != 0 or lab.record["lease"] not in res.stdout:
                return f"hold status --json failed: {res.returncode} {res.stderr}"
            return None if took < 10 else f"hold status --json took {took:.1f}s"

        lab.item("hold status beside stalled clients", fresh)

        def complete() -> str | None:
            half.sendall(b'tus"}\n')
            talk = Talk()
            read_until(half, talk, lambda t: t.served, ANSWER_WAIT)
            return None if talk.served else f"the completed half line was not served: {talk}"

        lab.item("the half line completed", complete)
    finally:
        half.close()
        for s in stalled:
            s.close()
    lab.item("after the stalled clients left", lambda: None)
    lab.report(3)


def test_many_connections_at_once(lab: Lab) -> None:
    """500 clients connected at once, each asking for the status: all are served."""
    n = 500
    socks: list[socket.socket] = []

    def crowd() -> str | None:
        for _ in range(n):
            socks.append(connect(lab.sock))  # past the backlog (128), each waits its turn
        for s in socks:
            s.sendall(b'{"op":"status"}\n')
        poller = select.poll()
        for s in socks:
            poller.register(s, select.POLLIN)
        bufs = {s.fileno(): b"" for s in socks}
        by_fd = {s.fileno(): s for s in socks}
        deadline = time.monotonic() + 30
        pending = len(socks)
        while pending and time.monotonic() < deadline:
            for fd, _ in poller.poll(1000):
                data = by_fd[fd].recv(1 << 16)
                bufs[fd] += data
                if not data or b"\n" in bufs[fd]:
                    poller.unregister(fd)
                    pending -= 1
        unserved = [fd for fd, b in bufs.items() if b'"ev":"status"' not in b]
        return f"{len(unserved)} of {n} clients were not served" if unserved else None

    try:
        lab.item(f"{n} connections at once", crowd)
    finally:
        for s in socks:
            s.close()
    lab.item("after the crowd left", lambda: None)
    lab.report(2)


def test_running_out_of_descriptors(lab: Lab) -> None:
    """More connections than the daemon has descriptors for (its limit lowered
    to what it uses now plus a few; both parities, since a served client takes
    two, its socket and its pidfd): the ones beyond wait or are dropped, the
    daemon lives, and once they leave it serves again."""

    def fd_count() -> int:
        try:
            return len(os.listdir(f"/proc/{lab.pid}/fd"))
        except FileNotFoundError:
            return 0

    def flood(headroom: int | None) -> str | None:
        old = resource.prlimit(lab.pid, resource.RLIMIT_NOFILE)
        # None: a limit of 1, below every descriptor it has (RLIMIT_NOFILE bounds
        # a new descriptor's number, so a count plus nothing may still leave
        # holes below it): accept(2) itself fails (EMFILE) for every client.
        limit = 1 if headroom is None else fd_count() + headroom
        socks: list[socket.socket] = []
        try:
            resource.prlimit(lab.pid, resource.RLIMIT_NOFILE, (limit, old[1]))
            for _ in range(200):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
                s.setblocking(False)
                socks.append(s)
                try:
                    s.connect(lab.sock)
                except (BlockingIOError, ConnectionRefusedError):
                    pass  # the backlog is full: that is the point
            # The daemon takes connections while it has descriptors for them
            # (a kept one holds two, and its check needs a third for a moment);
            # then the rest wait in the backlog, or are taken and dropped.
            # Nothing to wait on but its descriptor table, and its death.
            wait_for(
                lambda: not alive(lab.pid) or fd_count() >= limit - 2,
                10,
                0.01,
                "the daemon's descriptors to run out",
            )
            t0 = time.monotonic()
            while alive(lab.pid) and time.monotonic() - t0 < 0.5:
                time.sleep(0.01)  # no event says "it did not die"
            return None if alive(lab.pid) else "the daemon died out of descriptors"
        finally:
            for s in socks:
                s.close()
            if alive(lab.pid):
                resource.prlimit(lab.pid, resource.RLIMIT_NOFILE, old)

    # None: not one descriptor for the next client, so accept(2) itself fails
    # (EMFILE): the daemon stops listening for a moment instead of dying.
    for headroom in (None, 15, 16):
        lab.item(f"200 connections, {headroom} descriptors to spare", lambda h=headroom: flood(h))
    lab.report(3)


@pytest.mark.timeout(120)
def test_a_client_that_never_reads_blocks_no_one(lab: Lab) -> None:
    """A client sends thousands of status requests and never reads the
    answers: it may be cut off, but a fresh client is served meanwhile."""

    def flood() -> str | None:
        with connect(lab.sock) as s:
            s.setblocking(False)
            sent = 0
            chunk = b'{"op":"status"}\n' * 4096
            for _ in range(64):  # as much as the socket takes, up to 4 MiB
                try:
                    sent += s.send(chunk)
                except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                    break
            # The daemon answers the flood until the socket is full; a fresh
            # client must not wait behind that.
            t0 = time.monotonic()
            try:
                raw_status(lab.sock)
            except (AssertionError, OSError) as e:
                return f"with {sent} bytes of requests unread: {e}"
            took = time.monotonic() - t0
            return (
                None if took < 2 else f"with {sent} bytes unread, a fresh client waited {took:.1f}s"
            )

    lab.item("a client that never reads", flood)
    lab.item("after it left", lambda: None)
    lab.report(2)


# --------------------------------------------------------------------------
# The fuzz: seeded mutations of valid messages, bounded in number and time.

SEEDS: list[dict[str, Any]] = [
    {"op": "status"},
    {"op": "open"},
    {"op": "end"},
    {"op": "check", "cls": "fake"},
    {"op": "attach", "session": "0123456789abcdef"},
    {"op": "release", "lease": "00000000"},
    {"op": "tree", "tree_id": TREE, "grace": 1},
    {"op": "root", "tree_id": TREE, "pid": NO_PID},
    ACQUIRE,
    {**ACQUIRE, "indices": [1], "count": None},
    {**ACQUIRE, "tree": {"tree_id": TREE, "grace": 1}},
]
WEIRD: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1.5,
    -0.0,
    2**31,
    2**63,
    10**39,
    1e308,
    "",
    "x" * 300,
    "\x00",
    "\u2028",
    "\U0001f600",
    [],
    {},
    [[]],
    {"a": {}},
    [0, 0],
    [-1],
    ["0"],
    "fake",
    "npu",
    TREE,
    [[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]],
]
JUNK = [
    b"\x00",
    b"\xff",
    b"\n",
    b'"',
    b"\\",
    b"[",
    b"]",
    b"{",
    b"}",
    b",",
    b":",
    b"\\ud800",
    b"NaN",
    b"1e999",
    b"9" * 50,
    b"\xed\xa0\x80",
    b" ",
    b"\r",
]


def mutate(rng: random.Random) -> bytes:
    msg = json.loads(json.dumps(rng.choice(SEEDS)))
    msg = {k: v for k, v in msg.items() if v is not None}
    how = rng.randrange(8)
    if how == 0:  # a field's value replaced
        key = rng.choice(list(msg))
        msg[key] = rng.choice(WEIRD)
    elif how == 1:  # a field dropped, or a junk one added
        if rng.random() < 0.5 and len(msg) > 1:
            del msg[rng.choice(list(msg))]
        else:
            msg[rng.choice(["cls", "pid", "x", "tree", "leaf", "count"])] = rng.choice(WEIRD)
    text = line(msg)[:-1]
    if how >= 2:  # bytes mangled: flipped, inserted, cut, repeated
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(text) + 1)
            kind = rng.randrange(5)
            if kind == 0 and text:
                j = min(i, len(text) - 1)
                text = text[:j] + bytes([rng.randrange(256)]) + text[j + 1 :]
            elif kind == 1:
                text = text[:i] + rng.choice(JUNK) + text[i:]
            elif kind == 2:
                text = text[:i] + text[i + rng.randint(1, 8) :]
            elif kind == 3:
                j = rng.randrange(len(text) + 1)
                a, b = min(i, j), max(i, j)
                text = text[:b] + text[a:b] * rng.randint(1, 3) + text[b:]
            else:
                text = text[:i]
    return text + (b"\n" if rng.random() < 0.9 else b"")


def could_name_a_process(payload: bytes) -> bool:
    """Whether some line of ``payload`` is a message whose ``pid`` the daemon
    would read as a pid that may exist (such a case is skipped: a fuzz must
    never register, and then stop, a real process)."""
    for ln in payload.split(b"\n"):
        try:
            msg = json.loads(ln)
        except (ValueError, RecursionError):
            continue
        if isinstance(msg, dict) and "pid" in msg:
            try:
                pid = int(msg["pid"])
            except (TypeError, ValueError, OverflowError):
                continue
            if 1 < pid <= 1 << 22:
                return True
    return False


@pytest.mark.timeout(120)
def test_fuzz(lab: Lab) -> None:
    rng = random.Random(9)
    cases, skipped = 1000, 0
    seen = {"refused and closed": 0, "served after": 0, "other": 0}
    start = time.monotonic()
    done = 0
    for n in range(cases):
        if time.monotonic() - start > 60:
            lab.failures.append(f"[time budget] {cases - n} fuzz cases not run")
            break
        payload = mutate(rng)
        while could_name_a_process(payload):
            skipped += 1
            payload = mutate(rng)
        prelude = OPEN if rng.random() < 0.5 else []

        def run(payload: bytes = payload, prelude: list[dict[str, Any]] = prelude) -> str | None:
            talk = converse(lab.sock, payload, prelude)
            kind = "served after" if talk.served else "other"
            if closes(talk) is None:
                kind = "refused and closed"
            seen[kind] += 1
            return answers(talk)

        lab.item(f"fuzz #{n}: {payload[:120]!r}", run)
        done += 1
    lab.item("hold status after the fuzz", lambda: _hold_status(lab))
    lab.report(done + 1)
    # The fuzz reached both sides: messages refused, and messages taken.
    assert skipped < cases and seen["refused and closed"] > 30 and seen["served after"] > 30, seen


def _hold_status(lab: Lab) -> str | None:
    res = subprocess.run([*HOLD, "status", "--json"], capture_output=True, text=True, timeout=30)
    if res.returncode != 0 or lab.record["lease"] not in res.stdout:
        return f"hold status --json: exit {res.returncode}: {res.stderr}"
    return None


# --------------------------------------------------------------------------
# hold_supervisor.jsonlines itself.


@pytest.mark.parametrize(
    "text",
    [
        '{"a":1,"a":2}',
        '{"x":{"b":[{"c":1,"c":1}]}}',
        '{"op":1,"\\u006fp":2}',
        "[NaN]",
        "[Infinity]",
        "[-Infinity]",
        "[1e400]",
        "[-1e999]",
        '"\\ud800"',
        '"\\udfff"',
        '"a\\ud800b"',
        '"\\udc00\\ud800"',
        '{"\\ud800":1}',
        '[["\\udc80"]]',
        "1" + "0" * 40,
        "-1" + "0" * 40,
        "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1),
        '{"a":' * (MAX_DEPTH + 1) + "1" + "}" * (MAX_DEPTH + 1),
        "[" * 100_000,
        "[1,]",
        "{'a':1}",
        "",
        "\ufeff{}",
        '"\ud800"',  # a raw lone surrogate in a str
    ],
)
def test_strict_loads_refuses(text: str) -> None:
    with pytest.raises(BadJSON):
        strict_loads(text)
    with pytest.raises(BadJSON):
        strict_loads(text.encode("utf-8", "surrogatepass"))


@pytest.mark.parametrize(
    "data",
    [
        b"\xff",
        b'"\xc0\xaf"',
        b'"\xed\xa0\x80"',
        b'"\xe2\x82"',
        b'"\xf4\x90\x80\x80"',
        b"\xef\xbb\xbf{}",
        '{"a":1}'.encode("utf-16"),
        '{"a":1}'.encode("utf-16-le"),
        '{"a":1}'.encode("utf-32"),
    ],
)
def test_strict_loads_refuses_what_is_not_utf8(data: bytes) -> None:
    with pytest.raises(BadJSON):
        strict_loads(data)


def test_strict_loads_takes_what_json_allows() -> None:
    assert strict_loads('"\\ud83d\\ude00"') == "\U0001f600"
    assert strict_loads('"Grüße"'.encode()) == "Grüße"
    assert strict_loads('{"a":"[[[{{{\\"","b":[1,2.5,-0,1e308]}') == {
        "a": '[[[{{{"',
        "b": [1, 2.5, 0, 1e308],
    }
    limit = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert strict_loads(limit) is not None
    assert strict_loads("9" * 40) == int("9" * 40)
    assert strict_loads(' {"a": {"a": 1}} \r\n') == {"a": {"a": 1}}
    # Brackets inside strings do not count, escaped quotes do not end them.
    deep_text = '["' + "[" * 1000 + '\\"' + "{" * 1000 + '"]'
    assert strict_loads(deep_text) == ["[" * 1000 + '"' + "{" * 1000]


def test_check_depth_needs_no_recursion() -> None:
    # Far beyond the recursion limit, without RecursionError, and linear: in
    # well under a second on an idle machine (a quadratic check would take hours).
    t0 = time.monotonic()
    for text in ("[" * 1_000_000, '{"a":' * 200_000, '["' * 100_000):
        with pytest.raises(BadJSON):
            strict_loads(text)
    assert time.monotonic() - t0 < LOADED


def test_dumps_line_is_always_strict() -> None:
    msg = {"a": "x\ud800y\nz", "b": "\U0001f600", "c": [1, 2.5]}
    data = jsonlines.dumps_line(msg)
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    assert strict_loads(data) == {"a": "x?y\nz", "b": "\U0001f600", "c": [1, 2.5]}


def test_line_buffer_frames_and_bounds() -> None:
    buf = jsonlines.LineBuffer(max_size=100)
    assert buf.feed(b'{"a":1}\n\n  \r\n{"b"') == [{"a": 1}]
    assert buf.feed(b":2}\n") == [{"b": 2}]
    assert buf.feed(b"x" * 100) == []  # at the limit, its newline may still come
    with pytest.raises(BadJSON, match="at most 100 bytes"):
        buf.feed(b"x")
    buf = jsonlines.LineBuffer(max_size=100)
    with pytest.raises(BadJSON, match="at most 100 bytes"):
        buf.feed(b'{"a":"' + b"x" * 200 + b'"}\n')  # too long even with its newline
    buf = jsonlines.LineBuffer(max_size=1000, max_depth=3)
    assert buf.feed(b'{"a":[[1]]}\n') == [{"a": [[1]]}]
    with pytest.raises(BadJSON, match="nested more than 3 deep"):
        buf.feed(b'{"a":[[[1]]]}\n')
    # One at a time: the messages before a bad line are taken first.
    buf = jsonlines.LineBuffer()
    buf.push(b'{"a":1}\n[1]\n{"b":2}\n')
    assert buf.next() == {"a": 1}
    with pytest.raises(BadJSON, match="a JSON object"):
        buf.next()


def test_hold_protocol_keeps_its_names() -> None:
    buf = LineBuffer()
    assert buf.feed(b'{"op":"status"}\n') == [{"op": "status"}]
    for bad in (
        b'{"a":1,"a":2}\n',
        b"[" * 5000 + b"\n",
        b'"\\ud800"\n',
        b"\xff\n",
        b"x" * (MAX_MESSAGE + 1),
    ):
        with pytest.raises(ProtocolError):
            LineBuffer().feed(bad)
    assert MAX_MESSAGE == 64 * 1024


# --------------------------------------------------------------------------
# The stack's control socket, and hold call --json-args.


def test_stack_control_socket_refuses_bad_lines(tmp_path: Path) -> None:
    from hold_supervisor.stack.controlsock import ControlServer, Reply, request

    seen: list[dict[str, Any]] = []

    def handler(msg: dict[str, Any], reply: Reply) -> None:
        seen.append(msg)
        reply.send({"ev": "ok", "got": msg}, done=True)

    path = str(tmp_path / "control.sock")
    server = ControlServer(path, handler)
    try:
        assert request(path, {"op": "ps", "x": "\U0001f600"})["got"] == {
            "op": "ps",
            "x": "\U0001f600",
        }
        for bad in (
            b'{"op":"ps","op":"down"}\n',
            b'{"op":"ps","x":NaN}\n',
            b"[" * 5000 + b"\n",
            b'{"op":"\\ud800"}\n',
            b'{"op":"ps","x":"\xff"}\n',
            b"[1]\n",
            b"x" * (1 << 20),
        ):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(LOADED)
                s.connect(path)
                try:
                    s.sendall(bad)
                except OSError:
                    pass
                talk = Talk()
                read_until(s, talk, lambda t: False, LOADED)
            assert talk.closed and not talk.timed_out, (bad[:40], talk)
            ans = talk.first()
            assert ans is not None and ans["ev"] == "error" and ans["code"] == 2, (bad[:40], talk)
            assert ans.get("done") is True
        assert seen == [{"op": "ps", "x": "\U0001f600"}]
    finally:
        server.close()


def test_json_args_refuses_duplicate_keys(tmp_path: Path) -> None:
    f = tmp_path / "args.json"
    f.write_text('{"n": 1, "n": 2}')
    with pytest.raises(ValueError, match="'n' is given twice"):
        parse_args([], str(f))
    for text in ('{"x": NaN}', '{"x": "\\ud800"}', "[" * 5000, '{"x": 1e400}'):
        f.write_text(text)
        with pytest.raises(ValueError, match="is not valid"):
            parse_args([], str(f))
    f.write_text('{"n": 1, "m": {"k": [1, 2]}}')
    assert parse_args(["s=x"], str(f)) == ({"n": 1, "m": {"k": [1, 2]}}, {"s": "x"})


def test_hold_call_json_args_duplicate_keys_exit_2() -> None:
    # Refused before any stack is asked (none runs here).
    res = subprocess.run(
        [*HOLD, "call", "nostack", "unit", "--json-args", "-"],
        input='{"n": 1, "n": 2}',
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 2, res.stderr
    assert "--json-args stdin is not valid: key 'n' is given twice" in res.stderr
