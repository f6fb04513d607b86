"""One user cannot take a shared daemon from the others (issue 24: 11,000 idle
connections of one user took the daemon to 17k descriptors and made another
user's ``hold status`` fail; 1,500 queued requests of one user kept another from
being granted for over 20 s).

A root daemon serving two real unprivileged users (``state: {shared: true}``),
with small limits in its configuration. User A opens connections and queues
requests past them (real sockets, its own process); each one over is refused
with a message that names the limit, and user B is still served -- its
``hold status`` answered, showing the limits and B's own use of them, and its
request granted -- within the usual deadlines.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import HOLD, alive, as_user, unpriv_python, wait_for, write_config

CONNECTIONS, QUEUED = 12, 4

# User A's flood: N connections (each asking ``open``, and ``acquire`` with
# "acquire"); one JSON line says what each first heard; then it holds them all
# until its stdin closes.
FLOOD = """
import json, socket, sys
path, n, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
socks, heard = [], []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(20)
    s.connect(path)
    socks.append(s)
    f = s.makefile("rb")
    try:
        s.sendall(b'{"op": "open"}\\n')
    except BrokenPipeError:
        pass  # refused (and closed) at once: its reason is still there to read
    ans = json.loads(f.readline() or b'{"ev": "closed"}')
    if mode == "acquire" and ans.get("ev") == "session":
        s.sendall(json.dumps({"op": "acquire", "cls": "npu", "count": 1, "label": "a",
                              "ttl": 60, "grace": 1, "wait": True}).encode() + b"\\n")
        ans = json.loads(f.readline() or b'{"ev": "closed"}')
    heard.append(ans)
print(json.dumps(heard), flush=True)
sys.stdin.read()
"""


class Shared:
    def __init__(self, base: Path, runtime: Path, py: str) -> None:
        self.base, self.runtime, self.py = base, runtime, py
        self.state = base / "state"
        self.env = {"HOLD_STATE_DIR": str(self.state), "HOLD_CONFIG": str(base / "config.yaml")}
        self.procs: list[subprocess.Popen[str]] = []

    def hold(self, user: str, *args: str) -> subprocess.CompletedProcess[str]:
        argv = as_user(user, [self.py, "-m", "hold", *args], self.runtime, self.env)
        return subprocess.run(argv, capture_output=True, text=True, timeout=30)

    def flood(self, user: str, n: int, mode: str) -> tuple[subprocess.Popen[str], list[Any]]:
        argv = [self.py, "-c", FLOOD, str(self.state / "daemon.sock"), str(n), mode]
        p = subprocess.Popen(
            as_user(user, argv, self.runtime, self.env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.procs.append(p)
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line, f"the flood ended early ({p.poll()})"
        heard: list[Any] = json.loads(line)
        return p, heard


@pytest.fixture
def shared(
    unpriv_user: str, other_user: str, unpriv_runtime: Path, isolated_hold: Path
) -> Iterator[Shared]:
    base = Path(tempfile.mkdtemp(prefix="hold-limits-", dir="/tmp"))
    base.chmod(0o755)
    w = Shared(base, unpriv_runtime, unpriv_python())
    daemon = None
    try:
        w.state.mkdir()
        w.state.chmod(0o755)
        write_config(
            base,
            state={"shared": True},
            limits={"connections": CONNECTIONS, "queued": QUEUED},
        )
        (base / "config.yaml").chmod(0o644)
        for node in (base / "dev").iterdir():
            node.chmod(0o666)
        (base / "dev").chmod(0o755)
        daemon = subprocess.Popen(
            [*HOLD, "daemon"],
            env={**os.environ, **w.env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(lambda: (w.state / "daemon.sock").exists(), 20, what="the shared daemon")
        yield w
    finally:
        for p in w.procs:
            if p.poll() is None:
                assert p.stdin is not None
                p.stdin.close()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
            if p.stdout is not None:
                p.stdout.close()
        if daemon is not None:
            daemon.terminate()
            daemon.wait(15)
            assert not alive(daemon.pid)
        shutil.rmtree(base, ignore_errors=True)


def test_one_users_connections_stop_at_its_limit_and_another_user_is_served(
    shared: Shared, unpriv_user: str, other_user: str
) -> None:
    _, heard = shared.flood(unpriv_user, CONNECTIONS + 5, "open")
    served = [h for h in heard if h.get("ev") == "session"]
    refused = [h for h in heard if h.get("ev") == "error"]
    assert len(served) == CONNECTIONS and len(refused) == 5, heard
    assert all(
        f"{unpriv_user} has {CONNECTIONS} connections open" in h["error"]
        and f"limits: {{connections: {CONNECTIONS}}}" in h["error"]
        for h in refused
    ), refused
    # A, over its limit, is told so by its own commands too.
    a = shared.hold(unpriv_user, "status")
    assert a.returncode != 0 and "connections open to the ticket daemon" in a.stderr, a.stderr
    assert "Traceback" not in a.stderr
    # B is served, and sees the limits and its own use of them.
    b = shared.hold(other_user, "status", "--json")
    assert b.returncode == 0, b.stderr
    doc = json.loads(b.stdout)
    assert doc["limits"]["connections"] == CONNECTIONS and doc["limits"]["queued"] == QUEUED
    assert doc["limits"]["yours"] == {"connections": 1, "queued": 0}
    text = shared.hold(other_user, "status")
    assert f"limits per user (not root): {CONNECTIONS} connections, {QUEUED} requests" in (
        text.stdout
    )


def test_one_users_queue_stops_at_its_limit_and_another_user_is_granted(
    shared: Shared, unpriv_user: str, other_user: str
) -> None:
    # B holds npu:0 first, so each of A's requests waits in line (none is
    # granted meanwhile, whatever the timing): past the limit, refused.
    hold_b = subprocess.Popen(
        as_user(
            other_user,
            [shared.py, "-m", "hold", "run", "-d", "npu:0", "--", "sleep", "600"],
            shared.runtime,
            shared.env,
        ),
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    shared.procs.append(hold_b)

    def b_holds() -> bool:
        st = shared.hold(other_user, "status", "--json")
        h = json.loads(st.stdout)["classes"]["npu"]["devices"][0]["holder"] if st.stdout else None
        return bool(h) and h["user"] == other_user

    wait_for(b_holds, 30, 0.1, "B's lease of npu:0")
    _, heard = shared.flood(unpriv_user, QUEUED + 3, "acquire")
    waiting = [h for h in heard if h.get("ev") == "queued"]
    refused = [h for h in heard if h.get("ev") == "error"]
    assert len(waiting) == QUEUED and len(refused) == 3, heard
    assert all(
        h["code"] == 75 and f"{unpriv_user} has {QUEUED} requests waiting in line" in h["error"]
        for h in refused
    ), refused
    # B's requests are not A's to count: B waits in no line of A's making.
    g = shared.hold(other_user, "run", "-d", "gpu", "--", "true")
    assert g.returncode == 0, g.stderr
    b = shared.hold(other_user, "run", "-d", "npu", "--no-wait", "--", "true")
    assert b.returncode == 75 and "requests waiting in line" not in b.stderr, b.stderr
    st = shared.hold(unpriv_user, "status", "--json")
    assert st.returncode == 0, st.stderr
    assert json.loads(st.stdout)["limits"]["yours"]["queued"] == QUEUED
    hold_b.terminate()  # hold run stops its command on SIGTERM, then ends the lease
    assert hold_b.wait(30) == 128 + 15


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("limits: {connections: 0}\n", "limits.connections '0' is not valid: a whole number"),
        ("limits: {queued: -3}\n", "limits.queued '-3' is not valid: a whole number"),
        ("limits: {queued: 1e9}\n", "limits.queued '1e9' is not valid: a whole number"),
        ("limits: {queue: 5}\n", "did you mean 'queued'"),
        ("limits: 5\n", "limits"),
    ],
)
def test_a_bad_limit_is_refused_with_file_and_line(tmp_path: Path, text: str, said: str) -> None:
    from hold.config import parse_file
    from hold_supervisor.parse import BadValue

    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(BadValue) as info:
        parse_file(str(path))
    assert f"{path}:1:" in str(info.value) and said in str(info.value), str(info.value)
