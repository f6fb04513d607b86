"""Who is behind a process, from the cgroup paths the runtimes and managers write
(``hold_supervisor.proc.origin``): the lines as each one leaves them in
``/proc/PID/cgroup`` (no Kubernetes or Podman runs here; a real Docker-named
leaf and pid namespace are in test_occupancy_containers.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import LOADED, wait_for

from hold_supervisor.proc import origin as origin_mod
from hold_supervisor.proc import scan
from hold_supervisor.proc.origin import Origin, parse, words

CID = "3f2a1b9c0d4e" + "a" * 52
POD = "1b2c3d4e-1111-2222-3333-444455556666"


@pytest.mark.parametrize(
    ("text", "want"),
    [
        # Docker, systemd driver (cgroup v2), and the cgroupfs driver on a v1 host.
        (f"0::/system.slice/docker-{CID}.scope\n", Origin(CID[:12], "docker")),
        (f"12:pids:/docker/{CID}\n11:cpu:/docker/{CID}\n", Origin(CID[:12], "docker")),
        # Podman: the container, not its monitor (conmon).
        (
            f"0::/machine.slice/libpod-{CID}.scope/container\n",
            Origin(CID[:12], "podman"),
        ),
        (
            f"0::/machine.slice/libpod-conmon-{CID}.scope\n",
            Origin(unit=f"libpod-conmon-{CID}.scope"),
        ),
        # Kubernetes: containerd with the systemd driver (the pod's uid with _),
        # CRI-O, and the cgroupfs driver.
        (
            "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod"
            f"{POD.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n",
            Origin(CID[:12], "containerd", POD),
        ),
        (
            f"0::/kubepods.slice/kubepods-pod{POD.replace('-', '_')}.slice/crio-{CID}.scope\n",
            Origin(CID[:12], "cri-o", POD),
        ),
        (f"0::/kubepods/burstable/pod{POD}/{CID}\n", Origin(CID[:12], "kubernetes", POD)),
        # Slurm: cgroup v2 and v1 (the hybrid's v2 line says nothing then).
        ("0::/system.slice/slurmstepd.scope/job_4219/step_0/user/task_0\n", Origin(slurm_job=4219)),
        (
            "13:freezer:/slurm/uid_1001/job_77/step_batch\n0::/user.slice\n",
            Origin(slurm_job=77),
        ),
        # A systemd unit, a user's own unit inside user@.service.
        (
            "0::/system.slice/nvidia-persistenced.service\n",
            Origin(unit="nvidia-persistenced.service"),
        ),
        (
            "0::/user.slice/user-1000.slice/user@1000.service/app.slice/serve.service\n",
            Origin(unit="serve.service"),
        ),
        ("0::/\n", Origin()),
    ],
)
def test_what_each_runtime_and_manager_writes(text: str, want: Origin) -> None:
    assert parse(text) == want


def test_words_and_doc() -> None:
    o = parse(f"0::/system.slice/docker-{CID}.scope\n", b"NSpid:\t4242\t7\n")
    assert o.nspid == 7 and o.doc() == {"container": CID[:12], "runtime": "docker", "nspid": 7}
    assert words(o.doc()) == f"docker {CID[:12]}, pid 7 inside"
    assert (
        words(parse("0::/system.slice/cron.service\n", b"NSpid:\t99\n").doc())
        == "unit cron.service"
    )
    assert words(None) == words({}) == ""


@pytest.mark.skipif(os.geteuid() != 0, reason="a pid namespace of its own needs root here")
def test_a_real_process_in_its_own_pid_namespace() -> None:
    """Read from a live process: its pid inside its own pid namespace (1: it is that
    namespace's first), and its cgroup as the kernel writes it."""
    # --kill-child: its first process ends with it (pid 1 of a namespace is not
    # an orphan that the test's leak check could ask anyone else to end).
    p = subprocess.Popen(
        [
            "unshare",
            "-p",
            "-f",
            "--kill-child",
            sys.executable,
            "-c",
            "import time; time.sleep(60)",
        ],
    )
    try:
        pid = wait_for(lambda: (scan.children_of(p.pid) or [None])[0], LOADED, what="its child")
        o = origin_mod.origin(pid)
        assert o.nspid == 1
        assert origin_mod.origin(os.getpid()).nspid is None  # the same namespace: nothing to add
    finally:
        p.kill()
        p.wait(timeout=LOADED)
