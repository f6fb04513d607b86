"""``hold top``: the live view, through a real terminal (tmux), and its plain frames.

The scene: ``npu`` is a class of two regular files (so that a process can
hold a node); a real ``npu-hold`` lease on npu:0 runs a holder of npu:0, and a
plain process holds npu:1 outside any lease (a stray). ``hold top`` runs in a
detached tmux session of a fixed size, on a tmux server of the test's own
(``-L``, killed at the end); the test reads the screen with ``capture-pane``
(``-e``: with its colours) and types with ``send-keys``.

The renderer's tests feed it documents with the resource figures (a lease
holder's and a stack unit's ``usage``, a device's ``gpu``) that the daemon
may or may not carry: shown where present, ``-`` where not.
"""

from __future__ import annotations

import itertools
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from conftest import HOLD, PROGS, alive, daemon_pid, holder_roles, update_config, wait_for
from test_multiuser import system, world  # noqa: F401 (fixtures: the system daemon, two users)

from hold.views.topframe import HEAD, PLAIN, RED, Line, Snapshot, frame

PY = sys.executable
BIN = Path(sys.executable).parent
HOLDER = str(PROGS / "node_holder.py")
TMUX = shutil.which("tmux")
needs_tmux = pytest.mark.skipif(TMUX is None, reason="no tmux here (CI installs it, .ci/run)")
# Users' text the terminal must never get raw: a bidi override and a C1 CSI.
LABEL = "top-\u202eevil\x9b2J-label-that-is-long-enough-to-be-cut-at-eighty-columns"
SHOWN_LABEL = "top-\\u202eevil\\x9b2J-label-that-is-long-enough-to-be-cut-at-eighty-columns"
_servers = itertools.count()


# --------------------------------------------------------------------------
# The renderer, fed documents (no daemon, no terminal).

NOW = 1_800_000_000.0


def _holder(**extra: Any) -> dict[str, Any]:
    return {
        "lease": "abcd1234",
        "label": "train",
        "pid": 4242,
        "user": "ann",
        "uid": 1000,
        "since": NOW - 60,
        "expires": NOW + 3600,
        "state": "active",
        **extra,
    }


def _status(holder: dict[str, Any] | None, gpu: dict[str, Any] | None) -> dict[str, Any]:
    dev0: dict[str, Any] = {"index": 0, "holder": holder}
    dev1: dict[str, Any] = {"index": 1, "holder": None}
    if gpu is not None:
        dev0["gpu"] = gpu
        dev1["gpu"] = {"util_percent": None, "memory_used_bytes": None, "memory_total_bytes": None}
    queue = [{"label": None, "pid": 77, "user": "bob", "count": 1, "indices": []}]
    return {
        "arbiter": {"kind": "per-user", "user": "ann", "pid": 1, "state_dir": "/s", "config": None},
        "classes": {"gpu": {"devices": [dev0, dev1], "queue": queue}},
    }


def _row(lines: list[Line], head: str, first: str) -> list[str]:
    """The cells of the row starting ``first`` in the table whose header starts ``head``."""
    at = next(n for n, ln in enumerate(lines) if ln.text.startswith(head))
    row = next(ln for ln in lines[at:] if ln.text.split()[0] == first)
    return re.split(r"\s{2,}", row.text.strip())


def test_the_frame_shows_the_figures_where_the_documents_carry_them() -> None:
    usage = {
        "cpu_seconds": 12.5,
        "cpu_percent": 87.25,
        "rss_bytes": 3 * 1024**3,
        "pids": 5,
        "source": "cgroup",
    }
    gpu = {"util_percent": 42, "memory_used_bytes": 2 * 1024**3, "memory_total_bytes": 80 * 1024**3}
    snap = Snapshot(
        status=_status(_holder(usage=usage), gpu),
        status_at=NOW,
        stacks=[
            {
                "stack": "svc",
                "units": [
                    {"unit": "model", "state": "ready", "pid": 99, "uptime": 75.0, "usage": usage},
                    {"unit": "web", "state": "ready", "pid": 98, "uptime": 5.0, "usage": None},
                ],
            }
        ],
    )
    lines = frame(snap, None, None, NOW, 2.0, 10.0)
    dev = _row(lines, "DEVICE", "gpu:0")
    assert dev[:6] == ["gpu:0", "active", "abcd1234", "ann", "4242", "1h00m"]
    assert dev[6:8] == ["42", "2.0GiB/80.0GiB"]
    assert _row(lines, "DEVICE", "gpu:1")[1:] == ["free", "-", "-"]
    assert _row(lines, "LEASE", "abcd1234") == [
        "abcd1234",
        "ann",
        "4242",
        "gpu:0",
        "1h00m",
        "87.2",
        "3.0GiB",
        "5",
        "'train'",
    ]
    assert _row(lines, "STACK", "svc") == [
        "svc",
        "model",
        "ready",
        "99",
        "1m15s",
        "87.2",
        "3.0GiB",
        "5",
    ]
    assert [ln.text.split()[1:] for ln in lines if ln.text.startswith("svc ")][1] == [
        "web",
        "ready",
        "98",
        "5.0s",
        "-",
        "-",
        "-",
    ]
    assert any("queue 1: (private) pid 77 user bob wants 1 device(s)" in ln.text for ln in lines)


def test_the_frame_shows_a_dash_where_the_figures_are_absent() -> None:
    snap = Snapshot(status=_status(_holder(label=None), None), status_at=NOW)
    lines = frame(snap, None, None, NOW, 2.0, 10.0)
    assert _row(lines, "DEVICE", "gpu:0")[6:] == ["-", "-", "(private)"]
    assert _row(lines, "LEASE", "abcd1234")[5:] == ["-", "-", "-", "(private)"]
    assert lines[-1] == Line("STACKS  none running", HEAD)


def test_strays_are_red_and_others_text_is_escaped() -> None:
    stray = {
        "device": "gpu:1",
        "index": 1,
        "pid": 555,
        "user": "eve",
        "age_s": 30.0,
        "rss_bytes": 4096,
        "covered": False,
        "why": "no live lease on gpu:1",
        "command": "evil \x1b]0;pwned\x07 \u202ecmd",
    }
    covered = {**stray, "pid": 556, "covered": True, "why": "descends from holder pid 4242"}
    doc = {"holders": [stray, covered], "processes": 321, "not_inspected": 0}
    snap = Snapshot(
        status=_status(_holder(label=LABEL), None), status_at=NOW, audit=doc, audit_at=NOW - 3
    )
    lines = frame(snap, None, None, NOW, 2.0, 10.0)
    red = [ln.text for ln in lines if ln.style == RED]
    assert red[0] == "STRAYS  1 (scanned 3.0s ago, 321 processes)"
    assert len(red) == 2 and red[1].startswith("gpu:1   555  eve")
    assert red[1].endswith("no live lease on gpu:1  evil \\x1b]0;pwned\\x07 \\u202ecmd")
    assert not any("556" in ln.text for ln in lines)  # a covered holder is no stray
    assert any(SHOWN_LABEL in ln.text for ln in lines)
    assert not any(ch in ln.text for ln in lines for ch in "\x1b\x07\x9b\u202e")


def test_the_frame_fits_the_terminal() -> None:
    snap = Snapshot(status=_status(_holder(label=LABEL), None), status_at=NOW)
    lines = frame(snap, 60, 8, NOW, 2.0, 10.0)
    assert len(lines) == 8 and all(len(ln.text) <= 59 for ln in lines)
    assert lines[-1].text.startswith("... ") and "more lines" in lines[-1].text
    whole = frame(snap, None, None, NOW, 2.0, 10.0)
    assert len(whole) > 8 and any(SHOWN_LABEL in ln.text for ln in whole)


def test_a_daemon_that_does_not_answer_is_said_in_red() -> None:
    snap = Snapshot(status=_status(None, None), status_at=NOW - 12, status_error="it is stopped")
    lines = frame(snap, 200, 40, NOW, 2.0, 10.0)
    said = [ln for ln in lines if ln.text.startswith("daemon: ")]
    assert said == [
        Line("daemon: it is stopped (hold top starts none; asking again); shown as of 12s ago", RED)
    ]
    assert any(ln.text.startswith("gpu:0") and ln.style == PLAIN for ln in lines)  # what it had


# --------------------------------------------------------------------------
# The scene, and a terminal.


class Scene(NamedTuple):
    lease: str
    client: int  # npu-hold
    stray: int  # holds npu:1 outside any lease


@pytest.fixture
def scene(tmp_path: Path) -> Iterator[Scene]:
    d = tmp_path / "npunodes"
    d.mkdir()
    nodes = [d / "accel0", d / "accel1"]
    for n in nodes:
        n.write_bytes(b"\0" * 4096)
    update_config(tmp_path, devices={"npu": {"nodes": [f"{d}/accel*"]}})
    holds_0 = [PY, HOLDER, str(tmp_path / "covered.out"), "fd", str(nodes[0])]
    client = subprocess.Popen(
        [str(BIN / "npu-hold"), "-t", "5m", "-l", LABEL, "--device", "npu:0", "--", *holds_0],
        stdin=subprocess.DEVNULL,
    )
    stray = subprocess.Popen(
        [PY, HOLDER, str(tmp_path / "stray.out"), "fd", str(nodes[1])], stdin=subprocess.DEVNULL
    )
    try:
        holder_roles(tmp_path / "covered.out", client)
        holder_roles(tmp_path / "stray.out", stray)
        out = subprocess.run([*HOLD, "status", "--json"], capture_output=True, timeout=60).stdout
        lease = json.loads(out)["classes"]["npu"]["devices"][0]["holder"]["lease"]
        yield Scene(lease, client.pid, stray.pid)
    finally:
        client.send_signal(signal.SIGTERM)  # it ends its lease and stops its tree
        stray.kill()
        stray.wait()
        client.wait(20)


class Terminal:
    """A tmux server of its own (``-L``) with one session running ``argv``."""

    def __init__(self, status: Path, argv: list[str], cols: int, rows: int, **env: str) -> None:
        self.name = f"holdtop-{os.getpid()}-{next(_servers)}"
        self.env = {k: v for k, v in os.environ.items() if k not in ("TMUX", "COLUMNS", "LINES")}
        self.env.update(env)
        # The command's exit status, through a file: tmux 3.3a may mark a pane dead
        # only seconds after its process ended (pane_dead_status comes late).
        self.status = status
        # sh catches Ctrl-C (the command gets it, as caught signals are reset at exec)
        # and writes the status; the pane stays (remain-on-exit) for its screen.
        wrapped = ["sh", "-c", 'trap : INT; "$@"; echo $? > "$0"', str(status), *argv]
        self.tmux(
            "-f",
            "/dev/null",
            "new-session",
            "-d",
            "-s",
            "t",
            "-x",
            str(cols),
            "-y",
            str(rows),
            " ".join(_quote(a) for a in wrapped),
            ";",
            "set-option",
            "-t",
            "t",
            "remain-on-exit",
            "on",
        )
        self.server = int(self.tmux("display-message", "-p", "-t", "t", "#{pid}"))
        self.socket = self.tmux("display-message", "-p", "-t", "t", "#{socket_path}")

    def tmux(self, *args: str) -> str:
        assert TMUX is not None
        res = subprocess.run(
            [TMUX, "-L", self.name, *args], env=self.env, capture_output=True, text=True, timeout=10
        )
        assert res.returncode == 0, (args, res.stderr)
        return res.stdout.strip()

    def screen(self, colours: bool = False) -> str:
        return self.tmux("capture-pane", "-p", *(["-e"] if colours else []), "-t", "t")

    def wait_screen(self, pattern: str, timeout: float = 20.0, colours: bool = False) -> str:
        seen = [""]

        def found() -> bool:
            seen[0] = self.screen(colours)
            return re.search(pattern, seen[0], re.M) is not None

        try:
            wait_for(found, timeout, 0.1, f"{pattern!r} on the screen")
        except AssertionError as e:
            raise AssertionError(f"{e}; the screen:\n{seen[0]}") from None
        return seen[0]

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "t", *keys)

    def ended(self, timeout: float = 10.0) -> int:
        """The command's exit status, once it ended (within ``timeout``)."""
        text = wait_for(
            lambda: self.status.exists() and self.status.read_text().strip(),
            timeout,
            0.05,
            "the command's end",
        )
        return int(text)

    def close(self) -> None:
        subprocess.run(
            [TMUX or "tmux", "-L", self.name, "kill-server"], capture_output=True, timeout=10
        )
        wait_for(lambda: not alive(self.server), 10, 0.02, "the tmux server's end")
        if Path(self.socket).is_socket():  # tmux leaves it behind; the name is this test's
            os.unlink(self.socket)


def _quote(arg: str) -> str:
    return "'" + arg.replace("'", "'\\''") + "'"


@pytest.fixture
def terminal(tmp_path: Path) -> Iterator[Callable[..., Terminal]]:
    """Start a :class:`Terminal` (``argv``, ``cols``, ``rows``, environment); each is
    closed (its server killed) at the end."""
    made: list[Terminal] = []

    def start(argv: list[str], cols: int, rows: int, **env: str) -> Terminal:
        made.append(Terminal(tmp_path / f"status{len(made)}", argv, cols, rows, **env))
        return made[-1]

    try:
        yield start
    finally:
        for t in made:
            t.close()


def top_argv(*args: str) -> list[str]:
    return [str(BIN / "hold"), "top", *args]


# --------------------------------------------------------------------------
# Through a terminal.


@needs_tmux
def test_the_live_view_shows_the_lease_and_the_stray_in_red_and_q_quits(
    scene: Scene, terminal: Callable[..., Terminal]
) -> None:
    term = terminal(top_argv("-d", "0.5"), 100, 30)
    screen = term.wait_screen(rf"^LEASE .*\n{scene.lease} ")
    lease_row = next(ln for ln in screen.splitlines() if ln.startswith(scene.lease))
    cells = lease_row.split()
    assert cells[1] == pwd.getpwuid(os.geteuid()).pw_name and cells[3] == "npu:0"
    assert "'top-\\u202eevil\\x9b" in screen  # escaped, never raw
    assert all(len(ln) <= 99 for ln in screen.splitlines())
    coloured = term.wait_screen(rf"\x1b\[[0-9;]*31m[^\n]*npu:1 +{scene.stray} ", colours=True)
    assert "\u202e" not in coloured and "\x9b" not in coloured
    term.keys("q")
    assert term.ended() == 0
    wait_for(lambda: "hold top" not in term.screen(), 10, 0.05, "the terminal's own screen back")


@needs_tmux
def test_the_view_fits_80x24_refits_on_resize_and_ctrl_c_quits(
    scene: Scene, terminal: Callable[..., Terminal]
) -> None:
    term = terminal(top_argv("-d", "0.5"), 80, 24)
    screen = term.wait_screen(rf"^npu:0 +active +{scene.lease} .*\.\.\.$")
    assert all(len(ln) <= 79 for ln in screen.splitlines())
    assert SHOWN_LABEL not in screen  # cut, with "..."
    term.tmux("resize-window", "-t", "t", "-x", "200", "-y", "40")
    screen = term.wait_screen(re.escape(SHOWN_LABEL))
    assert max(len(ln) for ln in screen.splitlines()) > 80
    term.keys("C-c")
    assert term.ended() == 0


@needs_tmux
def test_a_stopped_daemon_does_not_freeze_the_view(
    scene: Scene, terminal: Callable[..., Terminal]
) -> None:
    state = Path(os.environ["HOLD_STATE_DIR"])
    pid = daemon_pid(state)
    assert pid is not None
    term = terminal(top_argv("-d", "0.5"), 250, 30, HOLD_ANSWER_WAIT="1s")  # the paths whole
    term.wait_screen(rf"^npu:0 +active +{scene.lease} ")
    os.kill(pid, signal.SIGSTOP)
    try:
        screen = term.wait_screen(r"^daemon: .*did not answer within 1 s")
        assert re.search(rf"^npu:0 +active +{scene.lease} ", screen, re.M)  # what it had
        started = time.monotonic()
        term.keys("q")
        assert term.ended() == 0
        quit_s = time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)
    assert quit_s < 5.0, f"q took {quit_s:.1f}s with the daemon stopped"


@needs_tmux
def test_without_a_daemon_the_view_says_so_and_starts_none(
    terminal: Callable[..., Terminal],
) -> None:
    term = terminal(top_argv("-d", "0.2"), 250, 30)  # the paths whole
    term.wait_screen(r"^daemon: no daemon answers on .*hold top starts none; asking again")
    term.wait_screen(r"^STRAYS  none")
    term.keys("q")
    assert term.ended() == 0
    assert daemon_pid(Path(os.environ["HOLD_STATE_DIR"])) is None


@needs_tmux
def test_at_a_terminal_n_frames_end_the_view(terminal: Callable[..., Terminal]) -> None:
    term = terminal(top_argv("-n", "3", "-d", "0.2"), 100, 30)
    assert term.ended() == 0
    wait_for(lambda: "hold top" not in term.screen(), 10, 0.05, "the terminal's own screen back")


@needs_tmux
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_gives_the_terminal_back(terminal: Callable[..., Terminal], sig: int) -> None:
    term = terminal(top_argv("-d", "0.2"), 100, 30)
    term.wait_screen(r"^STRAYS  none")
    shell = int(term.tmux("display-message", "-p", "-t", "t", "#{pane_pid}"))
    children = Path(f"/proc/{shell}/task/{shell}/children").read_text().split()
    (top,) = [int(c) for c in children]
    os.kill(top, sig)
    assert term.ended() == 128 + sig
    wait_for(lambda: "hold top" not in term.screen(), 10, 0.05, "the terminal's own screen back")


# --------------------------------------------------------------------------
# Not at a terminal.


def _top(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*HOLD, "top", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_piped_it_prints_frames_as_plain_lines(scene: Scene) -> None:
    res = _top("-n", "2", "-d", "0.1")
    assert res.returncode == 0, res.stderr
    frames = res.stdout.split("\n\n")
    assert len(frames) == 2 and "\x1b" not in res.stdout
    for text in frames:
        assert re.search(rf"^npu:0 +active +{scene.lease} .*{re.escape(SHOWN_LABEL)}", text, re.M)
        assert re.search(rf"^STRAYS  1 \(.*\n.*\nnpu:1 +{scene.stray} ", text, re.M)
        assert text.startswith("hold top ") and "(q quits" not in text
    one = _top()
    assert one.returncode == 0 and one.stdout.count("hold top ") == 1


def test_piped_without_a_daemon_it_says_so_and_starts_none() -> None:
    res = _top()
    assert res.returncode == 0, res.stderr
    assert re.search(
        r"^daemon: no daemon answers on .* \(hold top starts none\)$", res.stdout, re.M
    )
    assert daemon_pid(Path(os.environ["HOLD_STATE_DIR"])) is None


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["-d", "0"], "--delay '0' is not valid"),
        (["-d", "fast"], "--delay 'fast' is not valid"),
        (["--delay", "50ms"], "--delay '50ms' is not valid: at least 100ms"),
        (["-n", "0"], "'-n' / '--iterations': 0 is not in the range"),
    ],
)
def test_bad_options_are_refused_by_name(args: list[str], said: str) -> None:
    res = _top(*args)
    assert res.returncode == 2 and said in res.stderr, res.stderr
    assert res.stdout == ""
    assert daemon_pid(Path(os.environ["HOLD_STATE_DIR"])) is None


def test_piped_it_lists_the_running_stacks_units(tmp_path: Path) -> None:
    """A detached stack's units, as ``hold ps`` has them (usage ``-`` until it carries it)."""
    speaks = "import sys, time; print('READY', file=sys.stderr, flush=True); time.sleep(60)"
    stack = tmp_path / "stack.yaml"
    stack.write_text(
        f'name: tp\nunits:\n  svc:\n    cmd: [{PY}, -c, "{speaks}"]\n'
        '    ready: {log: "READY"}\n    stop: {grace: 2s}\n'
    )
    up = subprocess.run(
        [*HOLD, "up", "--detach", str(stack)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert up.returncode == 0, up.stderr
    try:
        ps = json.loads(subprocess.run([*HOLD, "ps", "tp", "--json"], capture_output=True).stdout)
        (unit,) = ps["units"]
        res = _top()
        assert res.returncode == 0, res.stderr
        row = re.search(r"^tp +svc +(\S+) +(\d+) +\S+ +(\S+) +(\S+) +(\S+)$", res.stdout, re.M)
        assert row is not None, res.stdout
        assert row.group(1) == "ready" and int(row.group(2)) == unit["pid"]
        if unit.get("usage") is None:
            assert row.groups()[2:] == ("-", "-", "-")
    finally:
        down = subprocess.run([*HOLD, "down", "tp"], capture_output=True, text=True, timeout=60)
    assert down.returncode == 0, down.stderr


# --------------------------------------------------------------------------
# Another user's view (real unprivileged users, the system daemon in a /run of its own).


@pytest.mark.skipif(os.geteuid() != 0, reason="making users needs root")
def test_another_users_view_hides_a_private_label(system: Any) -> None:  # noqa: F811
    w, _ns, _daemon = system
    a_user, b_user = w.users
    w.start(
        a_user,
        "run",
        "-d",
        "npu",
        "-l",
        "A-secret",
        "--private",
        "-t",
        "1m",
        "--",
        *w.gated("A", "--wait"),
        name="A",
    )
    w.ready("A")
    seen = w.run(b_user, "top")
    assert seen.returncode == 0, seen.stderr
    row = re.search(rf"^npu:0 +active +\S+ +{a_user} .*\(private\)$", seen.stdout, re.M)
    assert row is not None, seen.stdout
    assert "A-secret" not in seen.stdout
    assert re.search(r"^STRAYS  ", seen.stdout, re.M), seen.stdout  # the scan ran as b
    own = w.run(a_user, "top")
    assert own.returncode == 0 and "'A-secret'" in own.stdout, own.stdout
