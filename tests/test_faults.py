"""The daemon going away at any step: a client asks a new one and carries on."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import HOLD, daemon_pid

NPU_HOLD = str(Path(sys.executable).parent / "npu-hold")


def dying_daemon(state: Path) -> threading.Thread:
    """A daemon that opens one session and dies at once (socket gone, connection closed)."""
    state.mkdir(mode=0o700, exist_ok=True)
    path = state / "daemon.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def serve() -> None:
        listener.settimeout(30)
        conn, _ = listener.accept()
        with conn:
            line = conn.makefile("rb").readline()
            assert json.loads(line)["op"] == "open"
            conn.sendall(
                json.dumps(
                    {
                        "ev": "session",
                        "session": "0" * 16,
                        "classes": {},
                        "arbiter": {"kind": "per-user"},
                    }
                ).encode()
                + b"\n"
            )
            path.unlink()  # as a SIGKILLed daemon's socket (refused) would be
            listener.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize(
    "argv", [[NPU_HOLD, "-t", "1m", "--"], [*HOLD, "run", "--"]], ids=["npu-hold", "hold run"]
)
def test_the_daemon_dying_after_open_is_survived(tmp_path: Path, argv: list[str]) -> None:
    (tmp_path / "accel0").write_text("")
    Path(os.environ["HOLD_CONFIG"]).write_text(
        f'devices:\n  npu:\n    nodes: ["{tmp_path}/accel*"]\n'
    )
    state = Path(os.environ["HOLD_STATE_DIR"])
    fake = dying_daemon(state)
    out = tmp_path / "ran"
    res = subprocess.run([*argv, "touch", str(out)], capture_output=True, text=True, timeout=60)
    fake.join(10)
    assert res.returncode == 0, res.stderr
    assert out.exists()
    assert "Broken pipe" not in res.stderr
    assert daemon_pid(state) is not None  # a real one took over
