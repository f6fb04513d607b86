"""A real Slurm cluster of one node for the tests: munged, slurmctld and slurmd.

Debian's packages (``slurmctld slurmd slurm-client munge``, 22.05 on bookworm),
started in the foreground with every file (configuration, key, sockets, state,
spool, logs, pid files) under one directory of the test session's, on ports
picked free, so that nothing of the machine's own (``/etc/slurm``,
``/run/munge``) is read or touched and two sessions never meet.

The node declares two GPUs in ``gres.conf``: character nodes with the NVIDIA
major number (195) made in that directory, so Slurm's GPU paths
(``CUDA_VISIBLE_DEVICES``, ``SLURM_STEP_GPUS``, the device cgroup) and hold's
(nodes matched by device number, NVIDIA ordinals) run without a GPU. Their
minors are drawn at random (in order: ``nvidia0``'s is the smaller, as a
driver numbers them), so that another session's cluster on this machine,
whose holders every scan sees, most likely has other ones. On a machine with
NVIDIA GPUs of its own the cluster is not started: CUDA's ordinals count every
GPU of the machine, and a job's would name the real ones.

Containment: ``proctrack/cgroup`` and ``task/cgroup`` with
``ConstrainDevices=yes`` -- what a GPU cluster runs, and what makes a job's
view of the GPUs real: the kernel itself denies a job the nodes of GPUs it was
not given. ``IgnoreSystemd=yes`` lets the cgroup v2 plugin start where no
systemd runs; on a hybrid machine (v1 controllers mounted) Slurm takes its v1
plugin, which needs no systemd at all. Where slurmd cannot start with them,
the cluster is started again with ``proctrack/linuxproc`` and ``task/none``
(no device cgroup: :attr:`SlurmCluster.unconstrained` says why), and the
tests that need the device cgroup skip, saying why. ``HOLD_TEST_SLURM_CGROUP=off``
starts it that way at once (to run the tests as such a machine would).
"""

from __future__ import annotations

import glob
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "scontrol", "sinfo", "squeue", "scancel")
NVIDIA_MAJOR = 195
GPUS = 2
CPUS = 4  # declared (config_overrides): two one-CPU jobs side by side on any machine


class ClusterUnavailable(Exception):
    """Why no cluster could be started here."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class SlurmCluster:
    """One controller and one node with two GPUs, all under ``base``."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.node = f"holdnode-{uuid.uuid4().hex[:6]}"
        self.conf = base / "slurm.conf"
        self.dev = base / "dev"
        self.gpus = [self.dev / f"nvidia{i}" for i in range(GPUS)]
        self.minors = sorted(random.SystemRandom().sample(range(254), GPUS))
        self.epilog = base / "epilog"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        # Slurm's cgroup plugins run (the device cgroup confines each job); else
        # why not, and the cluster runs proctrack/linuxproc with task/none.
        self.constrained = True
        self.unconstrained: str | None = None

    @property
    def env(self) -> dict[str, str]:
        """What a Slurm client command needs to find this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    # ------------------------------------------------------------ start

    def start(self, timeout: float = 30.0) -> None:
        """Write the configuration and start the daemons; :class:`ClusterUnavailable`
        (with everything started stopped again) where they do not come up in time."""
        missing = [p for p in PROGRAMS if shutil.which(p) is None]
        if missing:
            raise ClusterUnavailable(
                f"not installed: {', '.join(missing)} "
                "(apt-get install slurmctld slurmd slurm-client munge)"
            )
        if os.geteuid() != 0:
            raise ClusterUnavailable("slurmd and the GPU nodes need root")
        if glob.glob("/dev/nvidia[0-9]*"):
            raise ClusterUnavailable(
                "this machine has NVIDIA GPUs of its own: CUDA's ordinals in a job would count them"
            )
        try:
            self._make_files()
        except BaseException:
            self.stop()
            raise
        why = "HOLD_TEST_SLURM_CGROUP=off"
        if os.environ.get("HOLD_TEST_SLURM_CGROUP") != "off":
            try:
                self._attempt(constrained=True, timeout=timeout)
                return
            except ClusterUnavailable as e:
                why = str(e)
            except BaseException:
                self.stop()
                raise
            self.stop()
        try:
            self._attempt(constrained=False, timeout=timeout)
        except BaseException as e:
            self.stop()
            if isinstance(e, ClusterUnavailable):
                raise ClusterUnavailable(f"with cgroups: {why}; without: {e}") from None
            raise
        self.unconstrained = why

    def _attempt(self, *, constrained: bool, timeout: float) -> None:
        self.constrained = constrained
        self._write_conf()
        self.procs = {}
        self._start_daemons(timeout)

    def _make_files(self) -> None:
        b = self.base
        for d in ("state", "spool", "run", "log"):
            (b / d).mkdir()
        # Jobs may run as another user: the node files and the directory must be reachable.
        b.chmod(0o755)
        self.dev.mkdir(mode=0o755)
        for minor, path in zip(self.minors, self.gpus, strict=True):
            try:
                os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(NVIDIA_MAJOR, minor))
            except OSError as e:
                raise ClusterUnavailable(f"cannot make the GPU node {path}: {e}") from None
            path.chmod(0o666)
        key = b / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        # The epilog the tests install: a file of theirs (see write_epilog), empty until then.
        self.write_epilog("#!/bin/sh\nexit 0\n")

    def _write_conf(self) -> None:
        b = self.base
        if self.constrained:
            plugins = ["ProctrackType=proctrack/cgroup", "TaskPlugin=task/cgroup"]
        else:
            plugins = ["ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none"]
        host = socket.gethostname().split(".")[0]
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=holdtest",
                    f"SlurmctldHost={host}(127.0.0.1)",
                    f"SlurmctldPort={_free_port()}",
                    f"SlurmdPort={_free_port()}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={b}/run/munge.sock",
                    f"StateSaveLocation={b}/state",
                    f"SlurmdSpoolDir={b}/spool",
                    f"SlurmctldPidFile={b}/run/slurmctld.pid",
                    f"SlurmdPidFile={b}/run/slurmd.pid",
                    f"SlurmctldLogFile={b}/log/slurmctld.log",
                    f"SlurmdLogFile={b}/log/slurmd.log",
                    *plugins,
                    "GresTypes=gpu",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "SchedulerType=sched/builtin",
                    "SlurmdParameters=config_overrides",
                    "ReturnToService=2",
                    "MpiDefault=none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    # scancel: SIGTERM, then SIGKILL this long after (default 30 s).
                    "KillWait=3",
                    "InactiveLimit=0",
                    # Job ids of its own: Slurm's cgroups are named by them.
                    f"FirstJobId={1_000_000 + int.from_bytes(os.urandom(3), 'big')}",
                    f"Epilog={self.epilog}",
                    f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={CPUS} "
                    f"Gres=gpu:{GPUS} State=UNKNOWN",
                    f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        (b / "cgroup.conf").write_text("ConstrainDevices=yes\nIgnoreSystemd=yes\n")
        (b / "gres.conf").write_text(
            f"AutoDetect=off\nNodeName={self.node} Name=gpu File={self.dev}/nvidia[0-{GPUS - 1}]\n"
        )

    def write_epilog(self, text: str) -> None:
        """Replace the node's ``Epilog`` script (read by slurmd at each job's end)."""
        tmp = self.epilog.with_suffix(".new")
        tmp.write_text(text)
        tmp.chmod(0o755)
        tmp.replace(self.epilog)

    def _spawn(self, name: str, argv: Sequence[str]) -> None:
        log = open(self.base / "log" / f"{name}.out", "wb")  # noqa: SIM115
        self.procs[name] = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        log.close()

    def _start_daemons(self, timeout: float) -> None:
        b = self.base
        deadline = time.monotonic() + timeout
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",  # root, and a key in a directory munged did not make
                f"--socket={b}/run/munge.sock",
                f"--key-file={b}/munge.key",
                f"--pid-file={b}/run/munged.pid",
                f"--seed-file={b}/state/munge.seed",
                f"--log-file={b}/log/munged.log",
            ],
        )
        self._until(lambda: (b / "run" / "munge.sock").exists(), deadline, "munged's socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._until(lambda: self._ok("scontrol", "ping"), deadline, "slurmctld (scontrol ping)")
        self._spawn("slurmd", ["slurmd", "-D", "-N", self.node, "-f", str(self.conf)])
        self._until(self._node_idle, deadline, f"node {self.node} idle (sinfo)")

    def _ok(self, *argv: str) -> bool:
        try:
            res = self.run(list(argv), timeout=10)
        except subprocess.TimeoutExpired:
            return False
        return res.returncode == 0 and "DOWN" not in res.stdout

    def _node_idle(self) -> bool:
        res = self.run(["sinfo", "-h", "-n", self.node, "-o", "%T"], timeout=10)
        return res.stdout.strip() == "idle"

    def _until(self, ready: Callable[[], object], deadline: float, what: str) -> None:
        while not ready():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else "timed out"
                raise ClusterUnavailable(f"waiting for {what}: {why}; {self.logs_tail()}")
            time.sleep(0.1)

    def logs_tail(self, lines: int = 8) -> str:
        out = []
        for f in sorted((self.base / "log").glob("*")):
            text = f.read_text(errors="replace").splitlines()[-lines:]
            if text:
                out.append(f"{f.name}: " + " | ".join(text))
        return "; ".join(out)

    # ------------------------------------------------------------ use

    def run(
        self, argv: list[str], timeout: float = 60, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster."""
        full = {**os.environ, **(env or {}), **self.env}
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=full)

    def jobs(self) -> list[str]:
        """The ids of the jobs the controller still has (any state but ended)."""
        res = self.run(["squeue", "-h", "-o", "%i"], timeout=10)
        return res.stdout.split()

    def steps_running(self) -> list[int]:
        """The pids of this session's slurmstepd processes (a job's step, or its
        epilog's): pytest's descendants, as everything the cluster starts is."""
        from hold_supervisor.proc import scan

        procs = scan.snapshot()
        out = []
        for pid in scan.descendants([os.getpid()], procs):
            if procs[pid].is_dead:
                continue
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            if comm == "slurmstepd":
                out.append(pid)
        return out

    def settle(self, timeout: float = 20.0) -> None:
        """Cancel what is left and wait until no job and no step process remains."""
        if self.jobs():
            self.run(["scancel", "--full", "--signal=KILL", *self.jobs()], timeout=10)
        deadline = time.monotonic() + timeout
        while self.jobs() or self.steps_running():
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"Slurm jobs {self.jobs()} / steps {self.steps_running()} still there after "
                    f"{timeout}s; {self.logs_tail()}"
                )
            time.sleep(0.05)

    # ------------------------------------------------------------ stop

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the daemons (slurmd first: it stops its steps), nothing left behind."""
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self._remove_cgroups()

    def _remove_cgroups(self) -> None:
        """Slurm's cgroup directories for this node (``slurm_NODE`` or
        ``system.slice/slurmstepd.scope``'s node), emptied already: removed, deepest first."""
        for mount in _cgroup_mounts():
            top = Path(mount) / f"slurm_{self.node}"
            if not top.is_dir():
                continue
            for dirpath, _dirs, _files in sorted(
                os.walk(top), key=lambda t: t[0].count("/"), reverse=True
            ):
                try:
                    os.rmdir(dirpath)
                except OSError:
                    pass


def _cgroup_mounts() -> list[str]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            if fields[sep + 1] in ("cgroup", "cgroup2"):
                out.append(fields[4])
    return out
