"""``--adopt PID``: a lease for a job that already runs (issue 15, first part).

The job is a real CUDA-free process that holds a "device" node -- a class
``fake`` over regular files, held by ``tests/progs/node_holder.py`` (an open
descriptor, and a child that holds nothing: a tree of two) -- started by the
test, outside any lease. The adopting client is the real command against the
test's own daemon (conftest). Every wait is bounded; the leak check proves
that nothing of a stopped job is left, nor any cgroup leaf.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    HOLD,
    LOADED,
    PROGS,
    alive,
    as_user,
    daemon_pid,
    holds_node,
    unpriv_python,
    update_config,
    wait_for,
    wait_in_line,
)
from test_audit import audit, audit_json, fake_nodes, row_of

from hold.daemon.tokens import read_record

BIN = Path(sys.executable).parent
HOLDER = str(PROGS / "node_holder.py")


class Jobs:
    """The test's jobs (started outside any lease) and adopting clients; all ended after."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.jobs: list[subprocess.Popen[bytes]] = []
        self.clients: list[subprocess.Popen[str]] = []
        self.children: list[int] = []  # each job's child (not ours to wait for)
        self.n = 0

    def job(self, node: Path, *opts: str, session: bool = True) -> dict[str, int]:
        """A holder of ``node`` with a child (``main``, ``child``: pids), running."""
        self.n += 1
        out = self.base / f"job{self.n}.out"
        proc = subprocess.Popen(
            [sys.executable, HOLDER, str(out), "fd", str(node), "--child", *opts],
            stdin=subprocess.DEVNULL,
            start_new_session=session,
        )
        self.jobs.append(proc)

        def roles() -> dict[str, int]:
            assert proc.poll() is None, f"the job ended: {proc.returncode}"
            lines = out.read_text().splitlines() if out.exists() else []
            got = {r: int(p) for r, p in (line.split() for line in lines)}
            return got if {"main", "holder", "child"} <= set(got) else {}

        got = wait_for(roles, 20, 0.02, "the job holding its node")
        self.children.append(got["child"])
        return got

    def adopt(self, pid: int, *opts: str, prog: list[str] | None = None) -> subprocess.Popen[str]:
        argv = [*(prog or [*HOLD, "run", "--device", "fake"]), "--adopt", str(pid), *opts]
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.clients.append(proc)
        return proc

    def close(self) -> None:
        for c in self.clients:
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)
            try:
                c.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                c.kill()
                c.communicate()
        for pid in self.children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        for j in self.jobs:
            if j.poll() is None:
                j.kill()
            j.wait()


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[Jobs]:
    j = Jobs(tmp_path)
    try:
        yield j
    finally:
        j.close()


def token(index: int) -> dict[str, object] | None:
    return read_record(os.path.join(os.environ["HOLD_STATE_DIR"], f"fake-{index}.token"))


def granted(client: subprocess.Popen[str], index: int = 0) -> dict[str, object]:
    def look() -> dict[str, object] | None:
        assert client.poll() is None, client.communicate()
        return token(index)

    try:
        return wait_for(look, 20, 0.02, f"the lease of fake:{index}")
    except AssertionError as e:
        client.send_signal(signal.SIGTERM)
        _out, err = client.communicate(timeout=30)
        raise AssertionError(f"{e}; the client said: {err}") from None


def ended(client: subprocess.Popen[str], timeout: float = 30) -> tuple[int, str]:
    _out, err = client.communicate(timeout=timeout)
    return client.returncode, err


def gone(*pids: int) -> bool:
    return not any(alive(p) for p in pids)


# ---------------------------------------------------------------- adopted


def test_adopted_job_is_covered_then_stopped_at_the_time_limit(
    tmp_path: Path, jobs: Jobs, cgroup_mode: str
) -> None:
    nodes = fake_nodes(tmp_path)
    job = jobs.job(nodes[0])
    before = row_of(audit_json(code=1), job["holder"])
    assert before["covered"] is False and before["why"] == "no live lease on fake:0"
    started = time.monotonic()
    # 8 s: the lease must outlast the audit below (a Python start-up and a scan).
    client = jobs.adopt(job["main"], "-t", "8s", "-l", "adopted run")
    lease = granted(client)
    doc = audit_json()
    row = row_of(doc, job["holder"])
    # Covered either way: in the lease's cgroup leaf, or (walked) by descent from the
    # adopted root that the lease's record names by pid and start time.
    assert (row["covered"], row["lease"], row["label"]) == (True, lease["lease"], "adopted run")
    assert doc["stray"] == 0
    code, err = ended(client)
    assert code == 124, err
    assert time.monotonic() - started < 8 + LOADED
    assert f"adopted pid {job['main']}" in err and "lease expired" in err
    wait_for(lambda: gone(job["main"], job["child"]), LOADED, 0.02, "the job stopped")
    assert token(0) is None
    assert audit_json(code="clean")["holders"] == []


def test_gpu_hold_adopts_and_release_stops_it(tmp_path: Path, jobs: Jobs) -> None:
    nodes = fake_nodes(tmp_path)
    update_config(tmp_path, devices={"gpu": {"nodes": [str(nodes[0].parent / "fakedev*")]}})
    job = jobs.job(nodes[1])
    client = jobs.adopt(job["main"], "-t", "1m", prog=[str(BIN / "gpu-hold")])
    lease = wait_for(
        lambda: read_record(os.path.join(os.environ["HOLD_STATE_DIR"], "gpu-1.token")),
        20,
        0.02,
        "gpu:1 leased",
    )
    res = subprocess.run(
        [*HOLD, "release", str(lease["lease"])], capture_output=True, text=True, timeout=30
    )
    assert res.returncode == 0, res.stderr
    code, err = ended(client)
    assert code == 6, err
    assert gone(job["main"], job["child"])


def test_ctrl_c_of_the_adopting_client_stops_the_job(tmp_path: Path, jobs: Jobs) -> None:
    nodes = fake_nodes(tmp_path)
    job = jobs.job(nodes[0], session=False)  # in pytest's own group and session
    client = jobs.adopt(job["main"], "-t", "1m")
    granted(client)
    time.sleep(0.3)  # its own loop waits by now (a signal before it stops the job too)
    client.send_signal(signal.SIGINT)
    code, err = ended(client)
    assert code == 130, err
    assert "SIGINT" in err and "stopped" in err
    assert gone(job["main"], job["child"])
    assert alive(os.getpid())  # its group and session (pytest's) were not the job's


def test_the_job_ending_by_itself_ends_the_lease(tmp_path: Path, jobs: Jobs) -> None:
    nodes = fake_nodes(tmp_path)
    # The job (and its child) ends once the lease is granted, not after a fixed
    # time: under load the adopting client may take seconds to start.
    go = tmp_path / "go"
    script = f"exec 3<{nodes[0]}; (until [ -e {go} ]; do sleep 0.02; done) & wait"
    proc = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    jobs.jobs.append(proc)  # type: ignore[arg-type]
    wait_for(lambda: holds_node(proc.pid, nodes[0]), 10, 0.02, "the job holding fake:0")
    client = jobs.adopt(proc.pid, "-t", "1m")
    granted(client)
    go.touch()
    code, err = ended(client)
    assert code == 0, err
    assert f"adopted pid {proc.pid}" in err
    assert token(0) is None  # the lease is over when the client returns


def test_a_job_whose_children_come_and_go_is_granted(tmp_path: Path, jobs: Jobs) -> None:
    """The job's children hold its node for a millisecond each, one after
    another. A grant's holder scan sees one of them; by the adopted tree's look
    a moment later it has ended: it holds nothing then, and is no reason to
    wait (it was read as a holder that is no member, and the grant waited
    for the next check, and again, past 20 s under load)."""
    nodes = fake_nodes(tmp_path)
    go = tmp_path / "go"
    script = f"exec 3<{nodes[0]}; until [ -e {go} ]; do sleep 0.001; done"
    proc = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    jobs.jobs.append(proc)  # type: ignore[arg-type]
    wait_for(lambda: holds_node(proc.pid, nodes[0]), 10, 0.02, "the job holding fake:0")
    client = jobs.adopt(proc.pid, "-t", "1m")
    granted(client)
    go.touch()
    code, err = ended(client)
    assert code == 0, err
    assert token(0) is None


# ---------------------------------------------------------------- refused


def refused(argv: list[str], **kw: object) -> str:
    res = subprocess.run(
        argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, **kw
    )  # type: ignore[call-overload]
    assert res.returncode == 2, (res.returncode, res.stderr)
    return str(res.stderr)


def test_pid_1_is_refused(tmp_path: Path) -> None:
    fake_nodes(tmp_path)
    err = refused([*HOLD, "run", "--device", "fake", "--adopt", "1"])
    assert "cannot adopt pid 1: pid 1 (init) is never adopted" in err


def test_own_ancestor_and_itself_are_refused(tmp_path: Path) -> None:
    fake_nodes(tmp_path)
    cmd = " ".join(HOLD) + " run --device fake --adopt $$"
    err = refused(["sh", "-c", f"{cmd}; exit $?"])
    assert "is an ancestor of this process" in err
    err = refused(["sh", "-c", f"exec {cmd}"])
    assert "is this very process" in err


def test_the_daemon_is_refused(tmp_path: Path) -> None:
    fake_nodes(tmp_path)
    subprocess.run([*HOLD, "run", "--device", "fake", "--", "true"], check=True, timeout=60)
    pid = daemon_pid(Path(os.environ["HOLD_STATE_DIR"]))
    assert pid is not None
    err = refused([*HOLD, "run", "--device", "fake", "--adopt", str(pid)])
    assert f"is the ticket daemon (pid {pid})" in err


def test_a_job_on_another_lease_s_device_is_refused_naming_that_lease(
    tmp_path: Path, jobs: Jobs
) -> None:
    nodes = fake_nodes(tmp_path)
    other = subprocess.Popen(
        [*HOLD, "run", "--device", "fake:0", "-l", "theirs", "--", "sleep", "60"],
        stdin=subprocess.DEVNULL,
    )
    try:
        lease = wait_for(lambda: token(0), 20, 0.02, "the other lease")
        job = jobs.job(nodes[0])  # a stray on fake:0, leased to the other
        err = refused([*HOLD, "run", "--device", "fake", "--adopt", str(job["main"])])
        assert f"lease {lease['lease']} 'theirs'" in err, err
        assert alive(job["main"]) and alive(job["holder"])  # left as it was
    finally:
        other.send_signal(signal.SIGTERM)
        other.wait(30)


def test_another_user_s_process_is_refused(
    tmp_path: Path, unpriv_user: str, other_user: str, unpriv_runtime: Path
) -> None:
    base = Path(tempfile.mkdtemp(prefix="hold-adopt-", dir="/tmp"))
    try:
        base.chmod(0o1777)
        (base / "fakedev0").write_bytes(b"")
        config = base / "config.yaml"
        config.write_text(f'devices:\n  fake:\n    nodes: ["{base}/fakedev*"]\n')
        config.chmod(0o644)
        theirs = subprocess.Popen(as_user(unpriv_user, ["sleep", "60"], unpriv_runtime, {}))
        try:
            wait_for(lambda: _uid(theirs.pid) != 0, 10, 0.02, "the other user's process")
            env = {"HOLD_STATE_DIR": str(base / "state"), "HOLD_CONFIG": str(config)}
            argv = [unpriv_python(), "-m", "hold", "run", "--device", "fake", "--adopt"]
            err = refused(as_user(other_user, [*argv, str(theirs.pid)], unpriv_runtime, env))
            assert f"belongs to user {unpriv_user}, not {other_user}" in err, err
            assert alive(theirs.pid)
        finally:
            theirs.kill()
            theirs.wait()
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)


def _uid(pid: int) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return 0


def test_the_daemon_itself_refuses_what_the_client_would(tmp_path: Path) -> None:
    """The rules hold at the daemon, whatever a client sends (pid 1, the asker's parent)."""
    from hold.client.connection import Client
    from hold.statedir import open_state_dir
    from hold_supervisor.proc.identity import ProcessId

    fake_nodes(tmp_path)
    client = Client.with_session(open_state_dir())
    try:
        for pid, why in (
            (1, "pid 1 (init) is never adopted"),
            (os.getppid(), "is an ancestor of this process"),
        ):
            start = ProcessId.of(pid).starttime
            tree = {
                "tree_id": os.urandom(6).hex(),
                "leaf": None,
                "grace": 1.0,
                "adopt": {"pid": pid, "start": start},
            }
            ans = client.request(
                {
                    "op": "acquire",
                    "cls": "fake",
                    "count": 1,
                    "label": "x",
                    "ttl": 10.0,
                    "grace": 1.0,
                    "tree": tree,
                }
            )
            assert ans.get("ev") == "error" and why in str(ans.get("error")), ans
    finally:
        client.close()


# ---------------------------------------------------------------- audit hint


def test_audit_suggests_adopting_a_stray_of_the_caller(tmp_path: Path, jobs: Jobs) -> None:
    nodes = fake_nodes(tmp_path)
    job = jobs.job(nodes[1])
    res = audit("--device", "fake")
    assert res.returncode == 1
    lines = res.stdout.splitlines()
    hint = f"to lease a stray of yours: hold run --device fake -t DURATION --adopt {job['main']}"
    assert lines[-2] == hint, res.stdout  # above the table's last line
    assert lines[-1].startswith("1 holder(s), 1 stray")  # its child holds nothing
    assert "--adopt" not in audit_json(code=1)  # --json: the document only


# ---------------------------------------------------------------- in line


def test_a_device_the_job_blocked_is_granted_to_its_adoption(tmp_path: Path, jobs: Jobs) -> None:
    nodes = fake_nodes(tmp_path, count=1)
    job = jobs.job(nodes[0])
    busy = subprocess.run(
        [*HOLD, "run", "--device", "fake", "--no-wait", "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert busy.returncode == 75 and "OUTSIDE any lease" in busy.stderr, busy.stderr
    client = jobs.adopt(job["main"], "-t", "2s", "--wait-timeout", "10s")
    code, err = ended(client)
    assert code == 124, err
    assert gone(job["main"], job["child"])


def test_ctrl_c_while_waiting_in_line_leaves_the_job_running(tmp_path: Path, jobs: Jobs) -> None:
    fake_nodes(tmp_path, count=1)
    other = subprocess.Popen(
        [*HOLD, "run", "--device", "fake", "--", "sleep", "60"], stdin=subprocess.DEVNULL
    )
    try:
        wait_for(lambda: token(0), 20, 0.02, "the other lease")
        sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
        jobs.jobs.append(sleeper)  # type: ignore[arg-type]
        client = jobs.adopt(sleeper.pid, "-t", "1m")
        wait_in_line("fake", 1)  # behind the other lease, its handlers set
        assert client.poll() is None
        client.send_signal(signal.SIGINT)
        code, err = ended(client)
        assert code == 130, err
        assert f"pid {sleeper.pid} not adopted, left running" in err
        assert alive(sleeper.pid)
    finally:
        other.send_signal(signal.SIGTERM)
        other.wait(30)
