"""Who is behind a process: its container, Kubernetes pod, Slurm job or systemd
unit, read from its cgroup paths; and its pid inside its own pid namespace.

A holder found by device number may live in a container (its own ``/dev``, its
own pids): a pid and a command alone do not tell a person whose it is. The
runtimes and managers name their cgroups after what they run, so
``/proc/PID/cgroup`` says it without asking any of them:

* Docker: ``docker-<id>.scope`` (systemd driver) or ``/docker/<id>`` (cgroupfs);
  Podman: ``libpod-<id>.scope`` (``libpod-conmon-`` is its monitor, not the
  container); containerd: ``cri-containerd-<id>.scope``; CRI-O: ``crio-<id>.scope``;
  each ``<id>`` 64 hex digits, shown as its first 12 as ``docker ps`` does.
* Kubernetes: ``kubepods...pod<uid>`` (the pod's uid, with ``_`` for ``-`` under
  the systemd driver).
* Slurm: ``job_<N>`` (``/slurm/uid_U/job_N/step_S`` under cgroup v1,
  ``slurmstepd.scope/job_N/step_S`` under v2).
* systemd: the innermost ``.service`` or ``.scope`` that is none of the above.

Every line of the file is read (a hybrid host has the v2 path and a v1 path
per controller; a v1-only runtime writes its ids only there). Read only for
the few holders a scan found, never per process of the machine.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import NamedTuple

from hold_supervisor.proc import scan

_RUNTIMES = (
    ("docker", re.compile(r"(?:^|/)docker[-/]([0-9a-f]{64})(?:\.scope)?(?:/|$)")),
    ("podman", re.compile(r"(?:^|/)libpod-(?!conmon-)([0-9a-f]{64})(?:\.scope)?(?:/|$)")),
    ("containerd", re.compile(r"(?:^|/)cri-containerd-([0-9a-f]{64})(?:\.scope)?(?:/|$)")),
    ("cri-o", re.compile(r"(?:^|/)crio-([0-9a-f]{64})(?:\.scope)?(?:/|$)")),
    # kubepods with the cgroupfs driver: /kubepods/<qos>/pod<uid>/<container id>
    ("kubernetes", re.compile(r"/pod[0-9a-f_-]{36}/([0-9a-f]{64})(?:/|$)")),
)
_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_POD = re.compile(rf"kubepods.*?[-/]pod({_UID})(?:\.slice)?(?:/|$)")
_SLURM = re.compile(r"(?:^|/)job_(\d+)(?:/|$)")
_UNIT = re.compile(r"([^/]+\.(?:service|scope))(?:/|$)")


class Origin(NamedTuple):
    """What runs a process, as far as its cgroups say; None where they say nothing."""

    container: str | None = None  # the runtime's id, 12 hex digits
    runtime: str | None = None  # docker, podman, containerd, cri-o, kubernetes
    pod: str | None = None  # the Kubernetes pod's uid
    slurm_job: int | None = None
    unit: str | None = None  # the innermost systemd unit that is not a container's
    nspid: int | None = None  # its pid in its own pid namespace, where that differs

    def doc(self) -> dict[str, object]:
        """For ``--json``: the fields that say something."""
        return {k: v for k, v in self._asdict().items() if v is not None}


def words(doc: Mapping[str, object] | None) -> str:
    """An origin's :meth:`Origin.doc` for people: ``docker 3f2a1b9c0d4e``, ``pod
    1234abcd-...``, ``slurm job 42`` or ``unit sshd.service`` (the first that
    applies), and ``pid 7 inside``; "" where it says nothing."""
    doc = doc or {}
    parts = []
    if doc.get("container") is not None:
        parts.append(f"{doc.get('runtime')} {doc['container']}")
    elif doc.get("pod") is not None:
        parts.append(f"pod {doc['pod']}")
    elif doc.get("slurm_job") is not None:
        parts.append(f"slurm job {doc['slurm_job']}")
    elif doc.get("unit") is not None:
        parts.append(f"unit {doc['unit']}")
    if doc.get("nspid") is not None:
        parts.append(f"pid {doc['nspid']} inside")
    return ", ".join(parts)


def parse(cgroup: str, nspid_line: bytes | None = None) -> Origin:
    """The origin that ``/proc/PID/cgroup``'s text (and its ``NSpid:`` line) say."""
    container = runtime = pod = unit = None
    job: int | None = None
    for line in cgroup.splitlines():
        path = line.split(":", 2)[-1]
        for name, pattern in _RUNTIMES:
            m = pattern.search(path)
            if m and container is None:
                container, runtime = m.group(1)[:12], name
        m = _POD.search(path)
        if m and pod is None:
            pod = m.group(1).replace("_", "-")
        m = _SLURM.search(path)
        if m and job is None:
            job = int(m.group(1))
        units = [u for u in _UNIT.findall(path) if not _is_runtime(u)]
        if units and unit is None:
            unit = units[-1]
    nspid = None
    if nspid_line is not None:
        ids = nspid_line.split()[1:]
        if len(ids) > 1 and ids[-1].isdigit():
            nspid = int(ids[-1])
    return Origin(container, runtime, pod, job, unit, nspid)


def _is_runtime(unit: str) -> bool:
    """A container's scope or Slurm's (said better above), not a unit of its own."""
    if unit.startswith("libpod-conmon-"):
        return False  # Podman's monitor: a unit like any other
    return unit.startswith(("docker-", "libpod-", "cri-containerd-", "crio-")) or unit in (
        "slurmstepd.scope",
    )


def origin(pid: int) -> Origin:
    """What runs ``pid`` (:class:`Origin`; empty where it cannot be read or is gone)."""
    try:
        text = scan.read_raw(pid, "cgroup").decode("utf-8", "replace")
        nspid = scan.status_line(pid, b"NSpid:")
    except OSError:
        return Origin()
    return parse(text, nspid)
