"""hold inside a real Slurm cluster (issue 26): munged, slurmctld and slurmd on this machine.

One cluster for the session (:mod:`slurmcluster`: one node, two GPUs in
``gres.conf`` that are character nodes with the NVIDIA major number, jobs
confined by Slurm's device cgroup). Each test's ``gpu`` class is those two
nodes, and each test runs its own ticket daemon outside the jobs, as the
system daemon runs on a real node: a daemon that a job's ``gpu-hold`` started
would live in the job's cgroup and end with the job. Jobs find it through the
environment that ``srun`` passes on (``HOLD_STATE_DIR``, ``HOLD_CONFIG``).

Skipped, with the reason, where the cluster cannot start (no packages, not
root, no cgroup plugin that can run here).
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    GPU_VISIBLE_ENV,
    HOLD,
    PROGS,
    ROOT,
    alive,
    as_user,
    unpriv_python,
    update_config,
    wait_for,
)
from slurmcluster import ClusterUnavailable, SlurmCluster

from hold_supervisor.exitcodes import INCOMPLETE

BIN = Path(sys.executable).parent
JOB = PROGS / "gpu_job.py"
EPILOG = ROOT / "units" / "slurm" / "hold-epilog"


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        c.start()
    except ClusterUnavailable as e:
        pytest.skip(f"no Slurm cluster here: {e}")
    try:
        yield c
    finally:
        c.stop()


class Slurm:
    """The session's cluster, seen by one test: its daemon, its files."""

    def __init__(self, cluster: SlurmCluster, base: Path, daemon: subprocess.Popen[bytes]) -> None:
        self.cluster = cluster
        self.base = base
        self.daemon = daemon
        self.out = base / "jobs.jsonl"

    def srun(
        self, args: list[str], *, user: str | None = None, env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        """``srun ARGS`` in the background (its output piped)."""
        argv = ["srun", "--chdir=/", "--quiet"]
        if user is not None:
            argv.append(f"--uid={user}")
        return subprocess.Popen(
            [*argv, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {}), **self.cluster.env},
        )

    def lines(self) -> list[dict[str, Any]]:
        """What the jobs' programs wrote, one object per program."""
        try:
            text = self.out.read_text()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines()]


def _finish(p: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


@pytest.fixture
def slurm(cluster: SlurmCluster, isolated_hold: Path) -> Iterator[Slurm]:
    """This test's ``gpu`` class over the cluster's two GPU nodes, and its daemon
    (root's, its state shared with the test's other users)."""
    base = isolated_hold
    update_config(
        base,
        devices={"gpu": {"nodes": [f"{cluster.dev}/nvidia[0-9]*"], "visible_env": GPU_VISIBLE_ENV}},
        state={"shared": True},
    )
    # Jobs may run as another user: they read the configuration and reach the socket.
    base.chmod(0o755)
    (base / "config.yaml").chmod(0o644)
    log = open(base / "daemon.err", "wb")  # noqa: SIM115
    daemon = subprocess.Popen([*HOLD, "daemon"], stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    log.close()
    sock = Path(os.environ["HOLD_STATE_DIR"]) / "daemon.sock"
    try:
        wait_for(lambda: sock.exists() or daemon.poll() is not None, 20, what="the daemon")
        assert daemon.poll() is None, (base / "daemon.err").read_text()
        yield Slurm(cluster, base, daemon)
    finally:
        cluster.write_epilog("#!/bin/sh\nexit 0\n")
        cluster.settle()
        daemon.terminate()
        daemon.wait(20)


def gpu_hold(*args: str) -> list[str]:
    return [str(BIN / "gpu-hold"), *args]


def status() -> dict[str, Any]:
    res = subprocess.run([*HOLD, "status", "--json"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    doc: dict[str, Any] = json.loads(res.stdout)
    return doc


def leases() -> dict[int, str]:
    """The gpu class's leased devices, as ``hold status`` shows them: index -> lease id."""
    devices = status()["classes"]["gpu"]["devices"]
    return {d["index"]: d["holder"]["lease"] for d in devices if (d["holder"] or {}).get("since")}


def audit(*args: str) -> tuple[int, dict[str, Any]]:
    res = subprocess.run(
        [*HOLD, "audit", "--device", "gpu", "--json", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode in (0, 1, INCOMPLETE), res.stderr
    doc: dict[str, Any] = json.loads(res.stdout)
    # No stray, but some process unread (this VM's init, even for root): not
    # clean, said so (issue 45); the tests ask whether a stray was found.
    assert (res.returncode == INCOMPLETE) == (res.returncode != 1 and doc["not_inspected"] > 0)
    return (0 if res.returncode == INCOMPLETE else res.returncode), doc


# --------------------------------------------------------------------------
# Within the allocation.


def test_two_jobs_get_different_gpus_and_lease_only_their_own(slurm: Slurm) -> None:
    gate = slurm.base / "gate"
    # GIVEN_CVD: what Slurm set, before gpu-hold sets its own.
    command = [sys.executable, str(JOB), str(slurm.out), str(slurm.cluster.dev), str(gate)]
    script = f'exec {BIN / "gpu-hold"} -e GIVEN_CVD="$CUDA_VISIBLE_DEVICES" -- "$@"'
    jobs = [slurm.srun(["--gres=gpu:1", "sh", "-c", script, "sh", *command]) for _ in range(2)]
    try:
        lines = wait_for(lambda: len(slurm.lines()) == 2 and slurm.lines(), 30, what="two jobs")
        # Inside both leases at once: two leases, one per GPU.
        assert sorted(leases()) == [0, 1], status()
    finally:
        gate.touch()
    for p in jobs:
        code, _out, err = _finish(p)
        assert code == 0, err
    by_job = {ln["SLURM_JOB_ID"]: ln for ln in lines}
    assert len(by_job) == 2
    for ln in lines:
        # The lease is the job's own GPU, whichever ordinal Slurm wrote: under
        # ConstrainDevices the job on GPU 1 is told CUDA_VISIBLE_DEVICES=0 (its
        # first), without it 1; and the command is told the same GPU.
        gpu = int(ln["SLURM_STEP_GPUS"])
        assert ln["GIVEN_CVD"] == str(0 if slurm.cluster.constrained else gpu), ln
        assert ln["HOLD_DEVICES"] == f"gpu:{gpu}", ln
        assert ln["CUDA_VISIBLE_DEVICES"] == ln["GIVEN_CVD"], ln
        assert ln["held"] == [str(slurm.cluster.gpus[gpu])]
    assert {ln["HOLD_DEVICES"] for ln in lines} == {"gpu:0", "gpu:1"}
    assert leases() == {}


def test_a_job_with_two_gpus_leases_both(slurm: Slurm) -> None:
    p = slurm.srun(
        [
            "--gres=gpu:2",
            *gpu_hold(
                "-n", "2", "--", sys.executable, str(JOB), str(slurm.out), str(slurm.cluster.dev)
            ),
        ]
    )
    code, _out, err = _finish(p)
    assert code == 0, err
    (ln,) = slurm.lines()
    assert ln["HOLD_DEVICES"] == "gpu:0,gpu:1"
    assert ln["SLURM_STEP_GPUS"] == "0,1"


def test_a_job_with_one_gpu_is_refused_a_second(slurm: Slurm) -> None:
    p = slurm.srun(["--gres=gpu:1", *gpu_hold("-n", "2", "--no-wait", "--", "true")])
    code, _out, err = _finish(p)
    assert code == 2, err
    assert "cannot lease 2 gpu device(s) from here" in err
    assert "Slurm job" in err and "--gres=gpu:2" in err, err


def test_a_job_without_gpus_is_refused_at_once_saying_why(slurm: Slurm) -> None:
    if not slurm.cluster.constrained:
        # Slurm then sets no CUDA_VISIBLE_DEVICES and leaves every node open:
        # nothing tells hold that the job has no GPU (README: Running under Slurm).
        pytest.skip(f"no device cgroup in this cluster: {slurm.cluster.unconstrained}")
    # No --no-wait: the refusal must not be a wait in line.
    p = slurm.srun(gpu_hold("-t", "1m", "--", "true"))
    code, _out, err = _finish(p, timeout=30)
    assert code == 2, err
    assert "may use none" in err, err
    assert "was given no GPU" in err and "--gres=gpu:1" in err, err
    for node in slurm.cluster.gpus:  # the kernel's word: the job's device cgroup denies both
        assert str(node) in err, err
    assert leases() == {}


def test_the_non_root_path_a_job_of_an_unprivileged_user(
    slurm: Slurm, unpriv_user: str, unpriv_runtime: Path
) -> None:
    """``srun --uid``: the job runs as the user, and its gpu-hold asks root's daemon."""
    py = unpriv_python()
    home = pwd.getpwnam(unpriv_user).pw_dir
    program = "import sys; from hold.cli.entry import gpu_main; raise SystemExit(gpu_main())"
    out = slurm.base / "user.jsonl"
    out.touch()
    out.chmod(0o666)
    p = slurm.srun(
        [
            "--gres=gpu:1",
            py,
            "-c",
            program,
            "-l",
            "user job",
            "--",
            py,
            str(JOB),
            str(out),
            str(slurm.cluster.dev),
        ],
        user=unpriv_user,
        env={"PYTHONPATH": str(unpriv_runtime), "HOME": home, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    code, _out, err = _finish(p)
    assert code == 0, err
    (ln,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert ln["uid"] == pwd.getpwnam(unpriv_user).pw_uid
    assert ln["HOLD_DEVICES"] == f"gpu:{ln['SLURM_STEP_GPUS']}"
    # The daemon granted it to that user (its history says whose each lease was).
    hist = Path(os.environ["HOLD_STATE_DIR"]) / "history.jsonl"
    users = [json.loads(x).get("user") for x in hist.read_text().splitlines()]
    assert unpriv_user in users, users


# --------------------------------------------------------------------------
# The job's end.


@pytest.mark.parametrize("signal", ["TERM", "KILL"])
def test_scancel_in_the_middle_of_a_lease_leaves_nothing(slurm: Slurm, signal: str) -> None:
    """Slurm's own ``scancel`` (SIGTERM to the step, SIGKILL after KillWait): gpu-hold
    stops its tree; ``--signal=KILL``: gpu-hold dies at once, and the daemon,
    outside the job, ends the lease when its connection ends."""
    holder_out = slurm.base / "escapee.pids"
    # The lease's command: one process that holds the GPU, and an escapee of it
    # (setsid, double fork) that holds it too.
    p = slurm.srun(
        [
            "--gres=gpu:1",
            *gpu_hold(
                "-t",
                "10m",
                "--",
                "sh",
                "-c",
                f"{sys.executable} {PROGS / 'node_holder.py'} {holder_out} path "
                f"{slurm.cluster.dev}/nvidia$SLURM_STEP_GPUS --escape & "
                f"exec {sys.executable} {JOB} {slurm.out} {slurm.cluster.dev} /nonexistent",
            ),
        ]
    )
    wait_for(
        lambda: slurm.lines() and holder_out.exists() and "holder" in holder_out.read_text(),
        30,
        what="the job's lease and its escapee",
    )
    (ln,) = slurm.lines()
    job = ln["SLURM_JOB_ID"]
    escapee = int(
        next(x.split()[1] for x in holder_out.read_text().splitlines() if x.startswith("holder"))
    )
    code, doc = audit()
    assert code == 0 and {h["pid"] for h in doc["holders"]} >= {ln["pid"]}, doc
    assert list(leases().values()) == [ln["HOLD_LEASE"]]
    res = slurm.cluster.run(["scancel", *(["--signal=KILL"] if signal == "KILL" else []), job])
    assert res.returncode == 0, res.stderr
    _finish(p)
    wait_for(lambda: not alive(ln["pid"]) and not alive(escapee), 20, what="the lease's tree gone")
    wait_for(lambda: leases() == {}, 20, what="the lease gone from hold status")
    code, doc = audit()
    assert code == 0 and doc["holders"] == [], doc


# --------------------------------------------------------------------------
# The epilog.


def _escape_slurm_cgroups(pid: int) -> None:
    """Move ``pid`` out of every cgroup Slurm put it in (to the hierarchy's root),
    as a process that outlives a job's tracking does (an ssh session on the
    node, proctrack/linuxproc's missed double fork)."""
    mounts: dict[str, str] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            fstype, opts = fields[sep + 1], fields[sep + 3].split(",")
            if fstype == "cgroup2":
                mounts[""] = fields[4]
            elif fstype == "cgroup":
                for o in opts:
                    mounts[o] = fields[4]
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _hid, controllers, path = line.split(":", 2)
        if "slurm" not in path:
            continue
        mount = mounts.get(controllers.split(",")[0])
        assert mount is not None, line
        Path(mount, "cgroup.procs").write_text(str(pid))


def test_the_epilog_stops_what_the_jobs_user_left_holding_its_gpus(
    slurm: Slurm, unpriv_user: str, unpriv_runtime: Path
) -> None:
    c = slurm.cluster
    log = slurm.base / "epilog.jsonl"
    env = {k: os.environ[k] for k in ("HOLD_STATE_DIR", "HOLD_CONFIG", "HOLD_LOCK_DIR", "HOME")}
    c.write_epilog(
        "#!/bin/sh\n"
        + "".join(f"export {k}='{v}'\n" for k, v in env.items())
        + f"export PATH='{BIN}:/usr/sbin:/usr/bin:/sbin:/bin'\n"
        + f"export HOLD_EPILOG_LOG='{log}' HOLD_EPILOG_GRACE=2s\n"
        + f"exec {EPILOG}\n"
    )
    py = unpriv_python()
    uid = pwd.getpwnam(unpriv_user).pw_uid
    user_env = {"PYTHONPATH": str(unpriv_runtime), "HOME": pwd.getpwnam(unpriv_user).pw_dir}
    pids = slurm.base / "pids"
    pids.touch()
    pids.chmod(0o666)
    holder = PROGS / "node_holder.py"
    # The job: its user's holder of its GPU, which the test then moves out of
    # the job's cgroups; the job ends, and Slurm's own stop misses it.
    gate = slurm.base / "gate"
    p = slurm.srun(
        [
            "--gres=gpu:1",
            "sh",
            "-c",
            f'echo "job $SLURM_JOB_ID $SLURM_STEP_GPUS" >> {pids}; '
            # Its output elsewhere: a step lasts as long as its output does.
            f"{py} {holder} {pids} path {c.dev}/nvidia$SLURM_STEP_GPUS "
            ">/dev/null 2>&1 & "
            f"while [ ! -e {gate} ]; do sleep 0.05; done",
        ],
        user=unpriv_user,
        env=user_env,
    )
    others: list[subprocess.Popen[bytes]] = []
    try:
        text = wait_for(
            lambda: ("holder" in pids.read_text() or p.poll() is not None) and pids.read_text(),
            30,
            what="the job's holder",
        )
        assert p.poll() is None, p.communicate()
        job, gpu = next(x.split()[1:] for x in text.splitlines() if x.startswith("job "))
        stray = int(next(x.split()[1] for x in text.splitlines() if x.startswith("holder")))
        mine, theirs = c.gpus[int(gpu)], c.gpus[1 - int(gpu)]
        # Not for the epilog: the same user holding the *other* GPU (outside
        # Slurm), and root holding the job's GPU.
        others = [
            subprocess.Popen(
                as_user(
                    unpriv_user,
                    [py, str(holder), str(pids), "path", str(theirs)],
                    unpriv_runtime,
                    {},
                )
            ),
            subprocess.Popen([sys.executable, str(holder), str(pids), "path", str(mine)]),
        ]
        wait_for(lambda: pids.read_text().count("holder") == 3, 20, what="the bystanders")
        _escape_slurm_cgroups(stray)
        gate.write_text("")
        code, _out, err = _finish(p)
        assert code == 0, err
        lines = wait_for(
            lambda: log.exists() and log.read_text().splitlines(), 30, what="the epilog's log"
        )
        wait_for(lambda: not alive(stray), 10, what="the stray stopped")
        (entry,) = [json.loads(x) for x in lines]
        assert (entry["pid"], entry["uid"], entry["slurm_job_id"]) == (stray, uid, job), entry
        assert (entry["device"], entry["node"]) == (f"gpu:{gpu}", str(mine)), entry
        assert entry["stopped"] is True and entry["kill_survivors"] == [], entry
        # The bystanders still hold their nodes.
        assert [q.poll() for q in others] == [None, None]
        # The node was not drained: the epilog succeeded.
        res = c.run(["sinfo", "-h", "-n", c.node, "-o", "%T"])
        assert res.stdout.strip() in ("idle", "completing"), res.stdout
    finally:
        gate.touch()
        for q in others:
            q.kill()
            q.wait(10)
