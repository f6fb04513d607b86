"""``hold metrics``: this machine's devices and tickets in Prometheus' text format.

For node_exporter's textfile collector (``--output FILE`` is written
atomically, as it asks). One document in, text out: :func:`render` takes
``{"status": the daemon's status answer, "audit": hold audit --json's
document (or None), "now": seconds (optional)}`` -- the same data ``hold
status --json`` and ``hold audit --json`` show -- so ``hold web``'s
``/metrics`` serves exactly what this command prints.

Gauges per device (``class``, ``index``): leased, the holder's uid, the
lease's age and expiry, waiters that could take it, strays (holders outside
any lease, from the audit's scan) and their device memory. Per class,
counters since the daemon started (``hold_daemon_start_time_seconds`` says
when): grants, expiries, and the waits in line (a summary: count and
seconds). Base units (seconds, bytes), ``_total`` for counters.

Per lease of this arbiter (``lease``, ``user``, ``class``, and ``label``:
empty for a private lease, whoever asks, as the file may be world-readable):
its processes' CPU seconds (a counter: with a cgroup leaf it counts every
process that ran there; without one it can fall when a member exits, which
Prometheus reads as a reset), their memory and their number. Per NVIDIA GPU
device: its utilisation (a ratio, 0 to 1) and memory, from NVML.
"""

from __future__ import annotations

import time
from typing import Any

from hold_supervisor.safefile import write_atomic

Labels = dict[str, str]
Sample = tuple[Labels, float]

# name -> (type, help)
FAMILIES: dict[str, tuple[str, str]] = {
    "hold_daemon_start_time_seconds": (
        "gauge",
        "When the daemon started (its counters count from then), seconds since the epoch.",
    ),
    "hold_device_leased": ("gauge", "1 if the device is leased (by this arbiter or another)."),
    "hold_device_holder_uid": ("gauge", "The uid of the leased device's holder."),
    "hold_device_state": (
        "gauge",
        "1 for the device's state: leased, active (another arbiter's lease), blocked, in use "
        "(open, holder not named yet), unusable, free, unknown or unproven.",
    ),
    "hold_device_lease_age_seconds": ("gauge", "Seconds since the device's lease was granted."),
    "hold_device_lease_expiry_timestamp_seconds": (
        "gauge",
        "When the device's lease expires, seconds since the epoch.",
    ),
    "hold_device_waiters": ("gauge", "Requests in line that could take this device."),
    "hold_class_waiters": ("gauge", "Requests in line for the class."),
    "hold_device_strays": ("gauge", "Processes holding the device's nodes outside any lease."),
    "hold_device_stray_memory_bytes": (
        "gauge",
        "Device memory of those processes, where the driver reports it.",
    ),
    "hold_audit_not_inspected_processes": (
        "gauge",
        "Processes the stray scan could not read (run as root to read all).",
    ),
    "hold_grants_total": ("counter", "Leases granted since the daemon started."),
    "hold_expiries_total": (
        "counter",
        "Leases that reached their time limit since the daemon started.",
    ),
    "hold_wait_seconds": ("summary", "Time from a request's arrival to its grant."),
    "hold_lease_cpu_seconds_total": (
        "counter",
        "CPU time (user and system) of the lease's processes.",
    ),
    "hold_lease_memory_bytes": (
        "gauge",
        "Memory of the lease's processes (its cgroup's charge, else their resident memory).",
    ),
    "hold_lease_processes": ("gauge", "Live processes of the lease."),
    "hold_device_gpu_utilization_ratio": (
        "gauge",
        "Fraction of the last sample period the GPU was busy (NVML).",
    ),
    "hold_device_gpu_memory_used_bytes": ("gauge", "GPU memory in use (NVML)."),
    "hold_device_gpu_memory_total_bytes": ("gauge", "GPU memory in all (NVML)."),
}


def render(doc: dict[str, Any]) -> str:
    """The exposition text of ``doc`` (see the module's docstring)."""
    ans = doc["status"]
    now = float(doc.get("now") or time.time())
    out: dict[str, list[tuple[str, Labels, float]]] = {name: [] for name in FAMILIES}
    if isinstance(ans.get("started"), (int, float)):
        out["hold_daemon_start_time_seconds"].append(("", {}, float(ans["started"])))
    leases: set[str] = set()
    for cls, info in sorted(ans["classes"].items()):
        _devices(out, cls, info, now)
        _figures(out, cls, info, leases)
        out["hold_class_waiters"].append(("", {"class": cls}, len(info["queue"])))
        c = (ans.get("counters") or {}).get(cls)
        if c is not None:
            out["hold_grants_total"].append(("", {"class": cls}, c["grants"]))
            out["hold_expiries_total"].append(("", {"class": cls}, c["expiries"]))
            out["hold_wait_seconds"].append(("_count", {"class": cls}, c["waits"]))
            out["hold_wait_seconds"].append(("_sum", {"class": cls}, c["wait_seconds"]))
    _strays(out, ans, doc.get("audit"))
    lines = []
    for name, samples in out.items():
        if not samples:
            continue
        kind, text = FAMILIES[name]
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        lines += [f"{name}{suffix}{_labels(labels)} {_value(v)}" for suffix, labels, v in samples]
    return "\n".join(lines) + "\n"


def _devices(
    out: dict[str, list[tuple[str, Labels, float]]], cls: str, info: dict[str, Any], now: float
) -> None:
    for dev in info["devices"]:
        lab = {"class": cls, "index": str(dev["index"])}
        h = dev["holder"]
        leased = h is not None and h.get("state") not in ("blocked", "unusable", "in use")
        out["hold_device_leased"].append(("", lab, 1 if leased else 0))
        if h is None:
            state = str(dev.get("known", "free"))
        else:
            state = {"elsewhere": "active"}.get(str(h.get("state")), str(h.get("state")))
            state = "leased" if state not in ("active", "blocked", "in use", "unusable") else state
        out["hold_device_state"].append(("", {**lab, "state": state}, 1))
        waiters = [w for w in info["queue"] if not w["indices"] or dev["index"] in w["indices"]]
        out["hold_device_waiters"].append(("", lab, len(waiters)))
        if h is None or not leased:
            continue
        if isinstance(h.get("uid"), int):
            out["hold_device_holder_uid"].append(("", lab, h["uid"]))
        if isinstance(h.get("since"), (int, float)):
            out["hold_device_lease_age_seconds"].append(("", lab, max(0.0, now - h["since"])))
        if isinstance(h.get("expires"), (int, float)):
            out["hold_device_lease_expiry_timestamp_seconds"].append(("", lab, h["expires"]))


def _figures(
    out: dict[str, list[tuple[str, Labels, float]]],
    cls: str,
    info: dict[str, Any],
    leases: set[str],
) -> None:
    """Each lease's figures (once, however many devices it holds); each GPU's."""
    for dev in info["devices"]:
        gpu = dev.get("gpu")
        if isinstance(gpu, dict):
            lab = {"class": cls, "index": str(dev["index"])}
            for key, name, scale in (
                ("util_percent", "hold_device_gpu_utilization_ratio", 0.01),
                ("memory_used_bytes", "hold_device_gpu_memory_used_bytes", 1),
                ("memory_total_bytes", "hold_device_gpu_memory_total_bytes", 1),
            ):
                if isinstance(gpu.get(key), (int, float)):
                    out[name].append(("", lab, gpu[key] * scale))
        h = dev["holder"]
        u = h.get("usage") if h is not None else None
        if not isinstance(u, dict) or h is None or h["lease"] in leases:
            continue
        leases.add(h["lease"])
        label = "" if h.get("private") or h.get("label") is None else str(h["label"])
        lab = {"lease": str(h["lease"]), "user": str(h["user"]), "label": label, "class": cls}
        out["hold_lease_cpu_seconds_total"].append(("", lab, u["cpu_seconds"]))
        out["hold_lease_memory_bytes"].append(("", lab, u["rss_bytes"]))
        out["hold_lease_processes"].append(("", lab, u["pids"]))


def _strays(
    out: dict[str, list[tuple[str, Labels, float]]],
    ans: dict[str, Any],
    audit: dict[str, Any] | None,
) -> None:
    if audit is None:
        return  # not scanned: no claim either way
    count: dict[tuple[str, int], int] = {}
    memory: dict[tuple[str, int], int] = {}
    for row in audit["holders"]:
        if row["covered"] or row["index"] is None:
            continue
        key = (row["cls"], row["index"])
        count[key] = count.get(key, 0) + 1
        memory[key] = memory.get(key, 0) + (row.get("device_memory_bytes") or 0)
    for cls, info in sorted(ans["classes"].items()):
        for dev in info["devices"]:
            key = (cls, dev["index"])
            lab = {"class": cls, "index": str(dev["index"])}
            out["hold_device_strays"].append(("", lab, count.get(key, 0)))
            out["hold_device_stray_memory_bytes"].append(("", lab, memory.get(key, 0)))
    out["hold_audit_not_inspected_processes"].append(("", {}, audit.get("not_inspected", 0)))


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return "{" + inner + "}"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _value(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def main_metrics(ans: dict[str, Any], audit: dict[str, Any] | None, output: str | None) -> int:
    """Print (or write ``output`` atomically, mode 0644) the metrics; the exit status."""
    text = render({"status": ans, "audit": audit})
    if output is None:
        print(text, end="")
        return 0

    write_atomic(output, text.encode(), 0o644)
    return 0
