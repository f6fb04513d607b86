"""Issue 25's rough edges, through the real CLI against real ``hold up --detach`` stacks:
``hold logs --json`` (with ``-n``, ``--since`` and ``-f``), and a "did you mean" for a
unit name that ``hold restart``, ``hold call`` or ``hold logs`` does not know, and for
``hold audit --device`` with an unknown class.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import CPU, HOLD, wait_for

PY = sys.executable
STAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")
LINE = re.compile(rf"({STAMP.pattern}) (out|err|---) \| (.*)")
SPEAKS = (
    "import sys, time; print('to out', flush=True); "
    "print('to err READY', file=sys.stderr, flush=True); time.sleep(60)"
)


def units(service: str = "a", task: str = "tool") -> str:
    return f"""
  {service}:
    cmd: [{PY}, -c, "{SPEAKS}"]
    ready: {{log: "err READY"}}
    stop: {{grace: 2s}}
  {task}:
    kind: task
    cmd: [{PY}, -c, "print('hi')"]
    cpus: "{CPU}"
    timeout: 10s
"""


def hold(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*HOLD, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
    )


def up(base: Path, name: str, body: str) -> None:
    path = base / "stack.yaml"
    path.write_text(f"name: {name}\nunits:\n{body}")
    res = hold("up", "--detach", str(path))
    assert res.returncode == 0, res.stderr


def objects(text: str) -> list[dict[str, Any]]:
    out = [json.loads(line) for line in text.splitlines()]
    assert all(isinstance(o, dict) for o in out), text
    return out


def check_object(o: dict[str, Any], stack: str) -> None:
    assert o["version"] == 1 and o["stack"] == stack, o
    assert {"unit", "ts", "stream", "text"} <= set(o), o
    assert o["ts"] is not None and STAMP.fullmatch(o["ts"]), o
    assert o["stream"] in ("out", "err", "stack", "call", "run"), o


def test_logs_json_as_the_text_form_chooses_lines(tmp_path: Path) -> None:
    up(tmp_path, "lj", units())
    follower = None
    try:
        assert hold("call", "lj", "tool").returncode == 0
        # One object per line of the text form, in the same order, every field there.
        text = hold("logs", "lj", "a")
        got = hold("logs", "lj", "a", "--json")
        assert got.returncode == 0 and text.returncode == 0, got.stderr
        objs = objects(got.stdout)
        lines = [LINE.fullmatch(line) for line in text.stdout.splitlines()]
        assert all(lines) and len(objs) == len(lines) >= 3, (text.stdout, got.stdout)
        stream = {"out": "out", "err": "err", "---": "stack"}
        for o, m in zip(objs, lines, strict=True):
            assert m is not None
            check_object(o, "lj")
            assert (o["unit"], o["ts"], o["stream"], o["text"]) == (
                "a",
                m[1],
                stream[m[2]],
                m[3],
            )
        assert any(o["stream"] == "out" and o["text"] == "to out" for o in objs)
        assert any(o["stream"] == "err" and o["text"] == "to err READY" for o in objs)
        assert any(o["stream"] == "stack" and o["text"].startswith("a: start") for o in objs)

        # Every unit, interleaved by time: the task's records too, parsed.
        every = objects(hold("logs", "lj", "--json").stdout)
        for o in every:
            check_object(o, "lj")
        assert [o["ts"] for o in every] == sorted(o["ts"] for o in every)
        assert {o["unit"] for o in every} == {"a", "tool"}
        calls = [o for o in every if o["stream"] == "call"]
        assert len(calls) == 1 and calls[0]["record"]["outcome"] == "exited", calls
        assert json.loads(calls[0]["text"]) == calls[0]["record"]
        assert [o["record"]["run"] for o in every if o["stream"] == "run"] == ["begins"]
        assert len(every) == len(hold("logs", "lj").stdout.splitlines())

        # -n: the last N of the whole view.
        last = objects(hold("logs", "lj", "--json", "-n", "2").stdout)
        assert last == every[-2:]
        assert objects(hold("logs", "lj", "a", "--json", "-n", "0").stdout) == []

        # --since: from a stamp on, as the text form.
        since = objs[len(objs) // 2]["ts"]
        later = objects(hold("logs", "lj", "a", "--json", "--since", since).stdout)
        text_later = hold("logs", "lj", "a", "--since", since).stdout.splitlines()
        assert later and len(later) == len(text_later)
        assert all(o["ts"] >= since for o in later)
        assert objects(hold("logs", "lj", "--json", "--since", "2099-01-01T00:00Z").stdout) == []

        # -f: new lines as they come, each an object, until the stack stops.
        out = tmp_path / "follow.out"
        with out.open("w") as f:
            follower = subprocess.Popen(
                [*HOLD, "logs", "lj", "--json", "-f", "-n", "1"],
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.DEVNULL,
            )
        # Its last line printed: it follows now (a restart before that would be
        # written before it looked, and -f shows only what comes after).
        wait_for(lambda: out.read_text().count("\n") >= 1, 10, what="the follower to start")
        rs = hold("restart", "lj", "a")
        assert rs.returncode == 0, rs.stderr

        def restarted() -> bool:
            done = out.read_text().rpartition("\n")[0]  # whole lines only
            return any(o["stream"] == "stack" and "restart 1" in o["text"] for o in objects(done))

        wait_for(restarted, 10, what="the restart's line, followed as JSON")
    finally:
        down = hold("down", "lj")
        if follower is not None and follower.poll() is None:
            try:
                follower.wait(10)
            finally:
                if follower.poll() is None:
                    follower.kill()
                    follower.wait()
    assert down.returncode == 0, down.stderr
    assert follower is not None and follower.returncode == 0
    followed = objects((tmp_path / "follow.out").read_text())
    for o in followed:
        check_object(o, "lj")
    assert any(o["unit"] == "a" and o["text"] == "to out" for o in followed), followed


def test_unknown_units_are_named_with_the_closest(tmp_path: Path) -> None:
    up(tmp_path, "typo", units(service="api", task="tool"))
    try:
        rs = hold("restart", "typo", "apo")
        assert rs.returncode == 2, rs.stderr
        assert "no unit 'apo' in stack typo (units: api)" in rs.stderr
        assert "did you mean 'api'?" in rs.stderr, rs.stderr
        far = hold("restart", "typo", "zzzzzz")
        assert far.returncode == 2 and "did you mean" not in far.stderr, far.stderr
        task = hold("restart", "typo", "tool")
        assert task.returncode == 2 and "is a task" in task.stderr, task.stderr

        call = hold("call", "typo", "tol")
        assert call.returncode == 2, call.stderr
        assert "(task units: tool)" in call.stderr and "did you mean 'tool'?" in call.stderr
        service = hold("call", "typo", "api")
        assert service.returncode == 2 and "a service, not a task" in service.stderr
        assert "did you mean" not in service.stderr

        logs = hold("logs", "typo", "apu")
        assert logs.returncode == 2, logs.stderr
        assert "(units: api, tool)" in logs.stderr and "did you mean 'api'?" in logs.stderr

        # An unknown stack: exit 1 as before, with its own "did you mean".
        for cmd in (["restart", "typp", "api"], ["call", "typp", "tool"], ["logs", "typp"]):
            res = hold(*cmd)
            assert res.returncode == 1, (cmd, res.stderr)
            assert "did you mean 'typo'?" in res.stderr, (cmd, res.stderr)
    finally:
        down = hold("down", "typo")
    assert down.returncode == 0, down.stderr


def test_audit_names_the_closest_class() -> None:
    assert "gpu" in Path(os.environ["HOLD_CONFIG"]).read_text()
    res = hold("audit", "--device", "gpuu")
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "--device 'gpuu' is not valid: one of " in res.stderr
    assert "did you mean 'gpu'?" in res.stderr, res.stderr
    far = hold("audit", "--json", "--device=zzzzzz")
    assert far.returncode == 2 and "did you mean" not in far.stderr, far.stderr
    assert far.stdout == ""


def test_a_file_that_cannot_be_written_is_named_not_its_temp_file(tmp_path: Path) -> None:
    """``hold metrics --output`` into a directory that is not there: the error
    names the file asked for, in words, not an errno and a temp file's random name."""
    dest = tmp_path / "absent" / "hold.prom"
    out = subprocess.run(
        [*HOLD, "metrics", "--output", str(dest)], capture_output=True, text=True, timeout=30
    )
    assert out.returncode != 0
    assert f"cannot write {dest}: no such file or directory" in out.stderr, out.stderr
    assert ".tmp" not in out.stderr and "Errno" not in out.stderr, out.stderr
    assert not dest.parent.exists()


def test_write_failed_keeps_the_errno_and_the_asked_for_name(tmp_path: Path) -> None:
    """The library side: :class:`WriteFailed` is an ``OSError`` of the target path."""
    import errno

    from hold_supervisor.safefile import WriteFailed, write_atomic, write_in_dir

    target = tmp_path / "nodir" / "f"
    try:
        write_atomic(str(target), b"x", 0o644)
    except WriteFailed as e:
        assert e.errno == errno.ENOENT and e.filename == str(target)
        assert str(e) == f"cannot write {target}: no such file or directory"
    else:
        raise AssertionError("write_atomic wrote into a directory that is not there")
    # A directory in which the name is a directory: the rename fails, named as asked.
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").mkdir()
    (tmp_path / "d" / "f" / "x").write_text("")
    try:
        write_in_dir(str(tmp_path / "d"), "f", b"x", uid=os.geteuid(), gid=os.getegid())
    except Exception as e:
        assert str(tmp_path / "d" / "f") in str(e) and ".tmp" not in str(e), e
    else:
        raise AssertionError("write_in_dir replaced a directory")
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["f"]  # no temp file left


def test_errors_are_said_under_the_commands_name() -> None:
    """As ``hold ps:`` and ``npu-hold:`` do: ``hold release:``, not ``hold:``."""
    cases = [
        (["release", "123"], "hold release: "),
        (["report", "--since", "bogus"], "hold report: "),
        (["audit", "--device", "nosuch"], "hold audit: "),
        (["web", "--listen", "nowhere:x"], "hold web: "),
    ]
    for args, prefix in cases:
        out = subprocess.run([*HOLD, *args], capture_output=True, text=True, timeout=30)
        assert out.returncode != 0, (args, out.stderr)
        assert out.stderr.startswith(prefix), (args, out.stderr)
