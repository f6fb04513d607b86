"""A stack's logs as people read them: every line stamped and tagged with its stream,
a line per run of the stack and per start or restart of a unit, every unit's log
interleaved by time, ``--since``, ``-f`` over every unit, task call records as JSON
lines. Real ``hold up --detach`` runs and real processes.

Every form goes through the real CLI (``hold logs NAME [UNIT] [--since S] [-n N] [-f]``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from conftest import CPU, HOLD, wait_for

from hold_supervisor.unitlog import stamp

PY = sys.executable
STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
LINE = re.compile(rf"({STAMP}) (out|err|---) \| (.*)")
MERGED = re.compile(rf"({STAMP}) (\S+) +(out|err|---|call|run) \| (.*)")


def hold(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*HOLD, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
    )


def logs_argv(
    name: str,
    unit: str | None = None,
    follow: bool = False,
    lines: int | None = None,
    since: str | None = None,
) -> list[str]:
    argv = [*HOLD, "logs", name, *([unit] if unit else [])]
    if follow:
        argv.append("-f")
    if lines is not None:
        argv += ["-n", str(lines)]
    if since is not None:
        argv += ["--since", since]
    return argv


def logs(name: str, unit: str | None = None, **kw: object) -> subprocess.CompletedProcess[str]:
    """``hold logs NAME [UNIT] [--since S] [-n N]``."""
    return subprocess.run(
        logs_argv(name, unit, **kw),  # type: ignore[arg-type]
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )


def write(base: Path, body: str, name: str = "lg") -> Path:
    path = base / "stack.yaml"
    path.write_text(f"name: {name}\nunits:\n{body}")
    return path


def log_file(unit: str, name: str = "lg") -> Path:
    import os

    return Path(os.environ["HOLD_STATE_DIR"]) / "stacks" / name / "logs" / f"{unit}.log"


# A unit that says one line on each stream and becomes ready on its stderr line
# (the log probe reads both streams), then waits.
SPEAKS = (
    "import sys, time; print('to out', flush=True); "
    "print('to err READY', file=sys.stderr, flush=True); time.sleep(60)"
)
SPEAKER = f"""
  a:
    cmd: [{PY}, -c, "{SPEAKS}"]
    ready: {{log: "err READY"}}
    stop: {{grace: 2s}}
"""
TASK = f"""
  tool:
    kind: task
    cmd: [{PY}, -c, "print('hi')"]
    cpus: "{CPU}"
    timeout: 10s
"""


def test_lines_are_stamped_and_tagged_runs_and_restarts_marked(tmp_path: Path) -> None:
    path = write(tmp_path, SPEAKER + TASK)
    for run in (1, 2):
        res = hold("up", "--detach", str(path))
        try:
            assert res.returncode == 0, res.stderr
            if run == 2:
                rs = hold("restart", "lg", "a")
                assert rs.returncode == 0, rs.stderr
                wait_for(
                    lambda: log_file("a").read_text().count("to err READY") == 3,
                    10,
                    what="the restarted unit's output",
                )
            assert hold("call", "lg", "tool").returncode == 0
        finally:
            assert hold("down", "lg").returncode == 0
    got = hold("logs", "lg", "a")
    assert got.returncode == 0, got.stderr
    lines = got.stdout.splitlines()
    parsed = [LINE.fullmatch(line) for line in lines]
    assert all(parsed), lines
    tagged = [(m[2], m[3]) for m in parsed if m]
    assert tagged.count(("out", "to out")) == 3 and tagged.count(("err", "to err READY")) == 3
    ours = [text for stream, text in tagged if stream == "---"]
    assert len([t for t in ours if t.startswith("==== stack lg: run begins")]) == 2, ours
    assert len([t for t in ours if re.fullmatch(r"a: start, pid \d+", t)]) == 2, ours
    assert [t for t in ours if "restart" in t] == [
        t for t in ours if re.fullmatch(r"a: restart 1 \(asked by hold restart\), pid \d+", t)
    ] and len([t for t in ours if "restart" in t]) == 1, ours
    stamps = [m[1] for m in parsed if m]
    assert stamps == sorted(stamps)
    # The task unit's log: JSON lines, a run record per run and a record per call.
    records = [json.loads(line) for line in log_file("tool").read_text().splitlines()]
    assert [r.get("run") for r in records if "call" not in r] == ["begins", "begins"]
    calls = [r for r in records if "call" in r]
    assert len(calls) == 2 and all(r["outcome"] == "exited" and r["exit"] == 0 for r in calls)
    assert all(re.fullmatch(STAMP, r["ts"]) for r in calls)


def test_every_unit_interleaved_since_and_follow(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        SPEAKER
        + f"""
  b:
    cmd: [{PY}, -c, "import time; print('b here', flush=True); time.sleep(60)"]
    ready: {{log: "b here"}}
    after: [a]
    stop: {{grace: 2s}}
"""
        + TASK,
    )
    res = hold("up", "--detach", str(path))
    follower = None
    try:
        assert res.returncode == 0, res.stderr
        assert hold("call", "lg", "tool").returncode == 0
        every = logs("lg")
        assert every.returncode == 0, every.stderr
        lines = every.stdout.splitlines()
        parsed = [MERGED.fullmatch(line) for line in lines]
        assert all(parsed), lines
        rows = [(m[2], m[3], m[4]) for m in parsed if m]
        assert ("a", "err", "to err READY") in rows and ("b", "out", "b here") in rows
        assert [r[1] for r in rows if r[0] == "tool"] == ["run", "call"]
        stamps = [m[1] for m in parsed if m]
        assert stamps == sorted(stamps)  # interleaved by time
        assert rows.index(("a", "err", "to err READY")) < rows.index(("b", "out", "b here"))
        assert logs("lg", lines=1).stdout.splitlines() == lines[-1:]

        # --since a time after all that: only what comes after it (b's restart).
        since = stamp(time.time() + 0.002)  # later than every line so far
        with open(tmp_path / "follow.out", "w") as out:
            follower = subprocess.Popen(
                logs_argv("lg", follow=True), stdout=out, stdin=subprocess.DEVNULL
            )
        wait_for(
            lambda: "b here" in (tmp_path / "follow.out").read_text(),
            10,
            what="the follower's first lines",
        )
        assert hold("restart", "lg", "b").returncode == 0
        wait_for(
            lambda: (tmp_path / "follow.out").read_text().count("b here") == 2,
            10,
            what="the restart's line, followed",
        )
        later = logs("lg", since=since)
        assert later.returncode == 0, later.stderr
        texts = [m[4] for m in map(MERGED.fullmatch, later.stdout.splitlines()) if m]
        assert texts[-1] == "b here" and len(texts) == 2, later.stdout
        assert re.fullmatch(r"b: restart 1 \(asked by hold restart\), pid \d+", texts[0])
        assert logs("lg", "b", since="1h").stdout.count("b here") == 2
        bad = logs("lg", since="yesterday")
        assert bad.returncode == 2 and "--since 'yesterday' is not valid" in bad.stderr
    finally:
        down = hold("down", "lg")
    assert down.returncode == 0, down.stderr
    assert follower is not None and follower.wait(10) == 0  # it ends with the stack
    followed = (tmp_path / "follow.out").read_text().splitlines()
    assert all(MERGED.fullmatch(line) for line in followed), followed
    assert any(" b " in line and "restart 1" in line for line in followed)


def test_logs_of_a_stack_or_unit_that_is_not_there(tmp_path: Path) -> None:
    path = write(tmp_path, SPEAKER, name="uxstack")
    res = hold("up", "--detach", str(path))
    try:
        assert res.returncode == 0, res.stderr
        typo = hold("logs", "uxstak", "a")
        assert typo.returncode == 1, typo.stderr
        assert "no stack 'uxstak' has run here" in typo.stderr
        assert "did you mean 'uxstack'?" in typo.stderr
        unit = hold("logs", "uxstack", "aa")
        assert unit.returncode == 2 and "did you mean 'a'?" in unit.stderr, unit.stderr
    finally:
        assert hold("down", "uxstack").returncode == 0
