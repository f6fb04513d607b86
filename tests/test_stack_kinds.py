"""Stacks as users write them: one-shot steps and dependency conditions, units that
are not essential, working directories, shell snippets, liveness, sd_notify both
ways, and scratch directories. Real ``hold up`` runs, real processes and sockets."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HOLD, PROGS, wait_for

PY = sys.executable


def hold(
    *args: str,
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*HOLD, *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )


def stack(base: Path, body: str, name: str = "k") -> Path:
    path = base / "stack.yaml"
    path.write_text(f"name: {name}\nunits:\n{body}")
    return path


@pytest.fixture(autouse=True)
def _scratch_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Scratch roots under the test's own directory, never the user's cache
    # (which must exist: a scratch root is made only in a directory of ours).
    (tmp_path / "cache").mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_oneshot_then_services_with_conditions_from_another_directory(tmp_path: Path) -> None:
    (tmp_path / "work").mkdir()
    (tmp_path / "app.env").write_text("GREETING='hello there'\n")
    path = stack(
        tmp_path,
        "  migrate:\n"
        "    kind: oneshot\n"
        "    cwd: work\n"
        "    cmd: [sh, -c, 'sleep 0.2; echo migrated > state.txt; echo \"home=${HOME:-} $$\"']\n"
        "  api:\n"
        '    cmd: [sh, -c, \'cat work/state.txt > api.seen; echo "$GREETING" >> api.seen; '
        "echo UP; exec sleep 60']\n"
        "    env_file: app.env\n"
        "    after: [migrate]\n"
        "    ready: {log: UP}\n"
        "  sidecar:\n"
        "    cmd: [sh, -c, 'echo side > side.seen; exec sleep 60']\n"
        "    after: {api: started}\n"
        "    ready: {file: side.seen}\n",
    )
    # From / : relative paths are the stack file's directory's.
    res = hold("up", "--for", "300ms", str(path), cwd="/")
    assert res.returncode == 0, res.stderr
    err = res.stderr
    assert "migrate: completed (exited with status 0" in err
    assert err.index("migrate: completed") < err.index("api: started")
    assert (tmp_path / "work" / "state.txt").read_text() == "migrated\n"
    assert (tmp_path / "api.seen").read_text() == "migrated\nhello there\n"
    assert (tmp_path / "side.seen").exists()
    assert " is up " in err


def test_a_failed_oneshot_fails_the_start_with_4_and_names_it(tmp_path: Path) -> None:
    path = stack(
        tmp_path,
        "  migrate: {kind: oneshot, cmd: [sh, -c, 'echo schema broken; exit 3']}\n"
        "  api: {cmd: [sh, -c, 'touch api.ran; exec sleep 60'], after: [migrate]}\n",
    )
    res = hold("up", "--for", "5s", str(path))
    assert res.returncode == 4, res.stderr
    assert "oneshot migrate failed: exited with status 3" in res.stderr
    assert "| schema broken" in res.stderr
    assert not (tmp_path / "api.ran").exists()
    assert " is up " not in res.stderr


def test_a_oneshot_over_its_timeout_is_stopped_and_fails(tmp_path: Path) -> None:
    path = stack(tmp_path, "  slow: {kind: oneshot, cmd: [sleep, '30'], timeout: 300ms}\n")
    res = hold("up", "--for", "5s", str(path))
    assert res.returncode == 124, res.stderr  # a time limit ran out
    assert "oneshot slow failed: did not complete within 0.3s; stopped" in res.stderr


def test_a_service_that_ends_with_status_0_is_not_success(tmp_path: Path) -> None:
    path = stack(
        tmp_path,
        "  worker: {cmd: [sh, -c, 'sleep 0.3; exit 0']}\n  other: {cmd: [sleep, '60']}\n",
    )
    res = hold("up", str(path))
    assert res.returncode == 4, res.stderr
    assert "unit worker exited with status 0; not restarted: stopping the stack" in res.stderr


def test_a_unit_that_is_not_essential_dies_and_the_rest_goes_on(tmp_path: Path) -> None:
    path = stack(
        tmp_path,
        "  flaky: {cmd: [sh, -c, 'exit 7'], essential: false, ready: {file: nope}}\n"
        "  needs_flaky: {cmd: [sleep, '60'], after: [flaky], essential: false}\n"
        "  main: {cmd: [sh, -c, 'echo ok; exec sleep 60'], ready: {log: ok}}\n",
    )
    res = hold("up", "--detach", str(path))
    assert res.returncode == 0, res.stderr
    try:
        assert "not essential: the stack goes on without it" in res.stderr
        ps = hold("ps", "k", "--json")
        assert ps.returncode == 0, ps.stderr
        units = {u["unit"]: u for u in json.loads(ps.stdout)["units"]}
        assert units["flaky"]["state"] == "failed" and units["flaky"]["essential"] is False
        assert units["needs_flaky"]["state"] == "skipped"
        assert units["main"]["state"] == "ready"
    finally:
        down = hold("down", "k")
    assert down.returncode == 0, down.stderr


def test_an_essential_unit_after_a_dead_optional_one_stops_the_start(tmp_path: Path) -> None:
    path = stack(
        tmp_path,
        "  flaky: {kind: oneshot, cmd: [sh, -c, 'exit 1'], essential: false}\n"
        "  api: {cmd: [sleep, '60'], after: [flaky]}\n",
    )
    res = hold("up", "--for", "5s", str(path))
    assert res.returncode == 4, res.stderr
    assert "unit api cannot start: flaky failed (completed was needed)" in res.stderr


def test_liveness_restarts_a_unit_that_stops_answering(tmp_path: Path) -> None:
    sick = tmp_path / "sick"
    path = stack(
        tmp_path,
        "  api:\n"
        "    cmd: [sh, -c, 'echo $$ >> pids; echo UP; exec sleep 60']\n"
        "    ready: {log: UP}\n"
        # Sick for exactly two checks: the probe itself ends it, so the
        # restarted unit is well whenever the test looks (a unit still sick
        # after its restart is restarted again, up to its max, then the stack
        # ends: a test that ended the sickness itself could look too late).
        # A generous timeout: a check that times out under load is a failure too.
        "    liveness:\n"
        "      exec: 'test ! -e sick || "
        "{ echo x >> fails; [ $(wc -l < fails) -lt 2 ] || rm sick; exit 1; }'\n"
        "      period: 100ms\n"
        "      timeout: 10s\n"
        "      failures: 2\n"
        "    restart: {policy: on-failure, max: 3, backoff: 100ms}\n",
    )
    res = hold("up", "--detach", str(path))
    assert res.returncode == 0, res.stderr
    try:

        def api() -> dict[str, object]:
            out = hold("ps", "k", "--json")
            assert out.returncode == 0, out.stderr
            return {u["unit"]: u for u in json.loads(out.stdout)["units"]}["api"]

        wait_for(lambda: api()["liveness"] == "ok", 10, what="a first good check")
        sick.touch()

        def well_again() -> bool:
            now = api()
            return now["restarts"] == 1 and now["state"] == "ready" and now["liveness"] == "ok"

        wait_for(well_again, 15, what="one restart, then ready and well")
        assert not sick.exists() and (tmp_path / "fails").read_text() == "x\nx\n"
        first, second = (tmp_path / "pids").read_text().split()[:2]
        assert first != second
        # The detached supervisor's own account of it.
        told = (Path(os.environ["HOLD_STATE_DIR"]) / "stacks" / "k" / "supervisor.log").read_text()
        assert (
            "api: liveness failed 2 times in a row (probe command exited with status 1): " in told
        )
    finally:
        down = hold("down", "k")
    assert down.returncode == 0, down.stderr


NOTIFYING_UNIT = r"""
import os, socket, sys, time
where = os.environ["NOTIFY_SOCKET"]
open("notify.path", "w").write(where)
while not os.path.exists("go"):
    time.sleep(0.02)
addr = "\0" + where[1:] if where.startswith("@") else where
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.sendto(b"STATUS=loaded\nREADY=1", addr)
time.sleep(60)
"""


# A unit's NOTIFY_SOCKET is a file in the stack's run directory where its
# path fits a socket address, else an abstract name ("@..."): the longest unit
# name makes it one anywhere.
@pytest.mark.parametrize("unit", ["svc", "s" * 64], ids=["short", "abstract"])
def test_a_unit_is_ready_when_it_sends_ready_1_from_its_own_tree(tmp_path: Path, unit: str) -> None:
    (tmp_path / "unit.py").write_text(NOTIFYING_UNIT)
    path = stack(
        tmp_path, f"  {unit}: {{cmd: [{PY}, unit.py], ready: {{notify: true, timeout: 20s}}}}\n"
    )
    up = subprocess.Popen(
        [*HOLD, "up", "--for", "200ms", str(path)],
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        where = wait_for(
            lambda: (tmp_path / "notify.path").exists() and (tmp_path / "notify.path").read_text(),
            20,
            what="the unit's NOTIFY_SOCKET",
        )
        assert where.startswith("@") or unit == "svc", where
        # A READY=1 from a process that is not the unit's is not believed.
        addr = "\0" + where[1:] if where.startswith("@") else where
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(b"READY=1", addr)
        ps = wait_for(
            lambda: (out := hold("ps", "k", "--json")).returncode == 0 and out.stdout,
            10,
            what="ps",
        )
        svc = json.loads(ps)["units"][0]
        wait_for(
            lambda: (
                "ignored from pid"
                in json.loads(hold("ps", "k", "--json").stdout)["units"][0]["detail"]
            ),
            10,
            what="the foreign READY=1 to be seen and ignored",
        )
        assert svc["state"] == "starting"
        (tmp_path / "go").touch()
        _, err = up.communicate(timeout=30)
    finally:
        if up.poll() is None:
            up.kill()
            up.communicate()
    assert up.returncode == 0, err
    assert f"{unit}: ready after" in err and "(sent READY=1)" in err
    assert "Traceback" not in err, err


def test_hold_up_tells_systemd_ready_and_stopping(tmp_path: Path) -> None:
    sock_path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(sock_path))
        s.settimeout(30)
        path = stack(tmp_path, "  a: {cmd: [sleep, '60']}\n")
        env = {**os.environ, "NOTIFY_SOCKET": str(sock_path)}
        res = hold("up", "--for", "200ms", str(path), env=env)
        assert res.returncode == 0, res.stderr
        got = [s.recv(4096).decode() for _ in range(2)]
    assert got[0].splitlines() == ["READY=1", "STATUS=stack k is up"]
    assert got[1] == "STOPPING=1"


def test_scratch_is_private_removed_and_never_follows_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep")
    path = stack(
        tmp_path,
        "  a:\n"
        '    cmd: [sh, -c, \'echo "$HOLD_SCRATCH" > scratch.path; mkdir -p {scratch}/d; '
        f"ln -s {victim} {{scratch}}/d/v; ln -s / {{scratch}}/root; echo x > {{scratch}}/f; "
        "echo UP; exec sleep 60']\n"
        "    scratch: {}\n"
        "    ready: {log: UP}\n"
        "  b:\n"
        "    cmd: [sh, -c, 'echo result > {scratch}/out; echo UP; exec sleep 60']\n"
        "    scratch: {keep: true}\n"
        "    ready: {log: UP}\n",
    )
    res = hold("up", "--for", "200ms", str(path))
    assert res.returncode == 0, res.stderr
    used = Path((tmp_path / "scratch.path").read_text().strip())
    assert used.parent == tmp_path / "cache" / "hold" / "scratch"
    assert not used.exists()
    assert (victim / "precious").read_text() == "keep"
    kept = [ln.split("scratch kept: ", 1)[1] for ln in res.stderr.splitlines() if "kept: " in ln]
    assert len(kept) == 1 and Path(kept[0], "out").read_text() == "result\n"


def test_scratch_min_free_refuses_before_anything_starts(tmp_path: Path) -> None:
    path = stack(
        tmp_path,
        "  a: {cmd: [sh, -c, 'touch ran; exec sleep 60'], scratch: {min_free: 1000000T}}\n",
    )
    res = hold("up", "--for", "200ms", str(path))
    assert res.returncode == 2, res.stderr
    assert "units.a.scratch: scratch: " in res.stderr and "required (min_free)" in res.stderr
    assert not (tmp_path / "ran").exists()


def test_the_serving_example_runs_from_anywhere(tmp_path: Path) -> None:
    """units/serving-stack.yaml: a one-shot, conditions, liveness and the default cwd."""
    example = Path(__file__).resolve().parent.parent / "units" / "serving-stack.yaml"
    valid = hold("validate", str(example), cwd=tmp_path)
    assert valid.returncode == 0, valid.stderr
    res = hold("up", "--for", "500ms", str(example), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    err = res.stderr
    for line in (
        "prepare: completed (exited with status 0",
        "model: ready after",
        "predictor: ready after",
        "stack serving is up (4 units",
        "survivor check empty",
    ):
        assert line in err, err
    # ticker waits only for model to be started; predictor for it to be ready.
    assert err.index("ticker: started") < err.index("model: ready")
    assert err.index("model: ready") < err.index("predictor: started")
    # prepare's scratch was removed with the stack.
    assert list((tmp_path / "cache" / "hold" / "scratch").iterdir()) == []


def test_a_task_call_gets_its_own_scratch_removed_after_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep")
    cpu = str(sorted(os.sched_getaffinity(0))[-1])
    path = stack(
        tmp_path,
        "  job:\n"
        "    kind: task\n"
        f"    cpus: '{cpu}'\n"
        "    scratch: {}\n"
        '    cmd: [sh, -c, \'echo "$HOLD_SCRATCH" >> calls.txt; echo x > "$HOLD_SCRATCH/f"; '
        f'ln -s {victim} "$HOLD_SCRATCH/v"; echo done\']\n',
    )
    res = hold("up", "--detach", str(path))
    assert res.returncode == 0, res.stderr
    try:
        for _ in range(2):
            call = hold("call", "k", "job")
            assert call.returncode == 0, call.stderr
    finally:
        down = hold("down", "k")
    assert down.returncode == 0, down.stderr
    first, second = (tmp_path / "calls.txt").read_text().split()
    assert first != second  # one per call
    assert not Path(first).exists() and not Path(second).exists()
    assert (victim / "precious").read_text() == "keep"


def test_a_chatty_server_is_probed_on_a_schedule_not_per_line(tmp_path: Path) -> None:
    """A unit that prints a line every millisecond while it loads: its HTTP probe
    is asked on the backing-off schedule, not once per line (1,600 a second,
    issue 24); ready after its 1.5 s all the same."""
    count = tmp_path / "asked"
    chatty = PROGS / "chatty_http.py"
    stack = tmp_path / "stack.yaml"
    stack.write_text(
        "name: chatty\nunits:\n  srv:\n"
        f'    cmd: [{sys.executable}, {chatty}, "{{port}}", "1.5", {count}]\n'
        "    port: auto\n    ready: {http: /health, timeout: 30s}\n"
    )
    res = subprocess.run(
        [*HOLD, "up", "--for", "0.2s", str(stack)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert res.returncode == 0, res.stderr
    asked = int(count.read_text())
    # 1.5 s of a schedule from 20 ms growing to 250 ms: about a dozen asks.
    assert 3 <= asked <= 40, asked
