"""A FIFO where a file is expected never hangs a command (issue 24: ``env_file:``
naming a FIFO made ``hold validate`` and ``hold up`` wait forever). Every
file a person names -- the stack file, a unit's ``env_file``, the
configuration -- is opened without blocking and refused, with exit 2 and the
file named, when it is not a regular file. Nobody ever writes to the FIFOs
here: a command that opened one for reading would block until the timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import HOLD

NPU_HOLD = str(Path(sys.executable).parent / "npu-hold")
WITHIN = 20.0  # a loaded machine; a hang would be forever


def _run(argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=WITHIN,
        env={**os.environ, **env},
    )


def _stack(tmp_path: Path, env_file: Path) -> Path:
    path = tmp_path / "stack.yaml"
    path.write_text(f"name: fifo\nunits:\n  a:\n    cmd: [sleep, '5']\n    env_file: {env_file}\n")
    return path


def test_an_env_file_that_is_a_fifo_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "env.fifo"
    os.mkfifo(fifo)
    stack = _stack(tmp_path, fifo)
    for cmd in ("validate", "up"):
        res = _run([*HOLD, cmd, str(stack)])
        assert res.returncode == 2, (cmd, res.stderr)
        assert "env_file is not a regular file" in res.stderr, res.stderr
        assert str(fifo) in res.stderr or "env.fifo" in res.stderr, res.stderr


def test_a_stack_file_that_is_a_fifo_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "stack.yaml"
    os.mkfifo(fifo)
    res = _run([*HOLD, "validate", str(fifo)])
    assert res.returncode == 2, res.stderr
    assert "not a regular file" in res.stderr, res.stderr


def test_a_configuration_that_is_a_fifo_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)
    for argv in ([NPU_HOLD, "--", "true"], [*HOLD, "run", "--", "true"], [*HOLD, "status"]):
        res = _run(argv, HOLD_CONFIG=str(fifo))
        assert res.returncode == 2, (argv, res.stderr)
        assert f"HOLD_CONFIG '{fifo}' is not valid" in res.stderr, res.stderr
