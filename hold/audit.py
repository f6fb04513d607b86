"""``hold audit``: every process that holds a device node, and whether a ticket covers it.

Finding holders: every process's descriptors and memory mappings, matched by
device number -- a descriptor's ``st_rdev`` (or, for the regular files that
stand in for devices in tests, ``(st_dev, st_ino)``), a mapping's
``dev inode`` fields -- never by the text of a path, so a node reached
through a bind mount, a hard link or a renamed node still matches.

This reads ``/proc`` directly rather than through psutil: the scan visits
every descriptor of every process on the machine, and psutil's per-process
objects would cost several times the system calls that matter.

Covered means: the holder descends (matched by pid *and* start time) from a
live lease's holder, or lives in the cgroup leaf of a tree registered for that
lease. Anything else is STRAY, with the reason.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import stat
import time
from collections.abc import Iterable
from typing import Any, NamedTuple

from hold.devices import DeviceClass
from hold.statedir import StateDir
from hold.tokens import read_record
from supervisor import procscan
from supervisor.cgroup import own_cgroup, v2_mount
from supervisor.identity import Stat
from supervisor.parse import format_duration

# A key for "this node": ("rdev", st_rdev) for device nodes, ("file", dev, ino)
# for the node's own inode (how a mapping names it, and how a regular file
# standing in for a device is known).
Key = tuple[Any, ...]


class Target(NamedTuple):
    cls: str
    unit: int | None  # device index; None: a shared node of the class (/dev/nvidiactl)
    path: str


class Holder(NamedTuple):
    pid: int
    starttime: int
    uid: int
    cls: str
    unit: int | None
    how: str  # "fd" or "mmap"
    node: str


def targets(classes: dict[str, DeviceClass], only: str | None = None) -> dict[Key, Target]:
    """Every node of the classes, by the keys a holder's descriptor or mapping can show."""
    out: dict[Key, Target] = {}
    for cls in classes.values():
        if only is not None and cls.name != only:
            continue
        for index, path in enumerate(cls.device_nodes()):
            _add(out, path, Target(cls.name, index, path))
        for pattern in cls.shared_nodes:
            for path in sorted(glob.glob(pattern)):
                _add(out, path, Target(cls.name, None, path))
    return out


def _add(out: dict[Key, Target], path: str, target: Target) -> None:
    try:
        st = os.stat(path)
    except OSError:
        return
    out[("file", st.st_dev, st.st_ino)] = target
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        out[("rdev", st.st_rdev)] = target


class Scan(NamedTuple):
    holders: list[Holder]
    not_inspected: int  # processes whose descriptors we may not read
    processes: int
    seconds: float


class _Matcher:
    """The per-process work of a scan, with the lookups prepared once."""

    def __init__(self, tgts: dict[Key, Target]) -> None:
        self.tgts = tgts
        self.rdev = {k[1]: t for k, t in tgts.items() if k[0] == "rdev"}
        # In /proc/PID/maps a mapping names its file by "maj:min inode" of the
        # node file itself: searching the raw text for " maj:min inode " finds
        # it without parsing a line (the kernel's formatting: two-digit hex
        # device numbers, decimal inode).
        self.map_needles = [
            (f" {os.major(k[1]):02x}:{os.minor(k[1]):02x} {k[2]} ".encode(), t)
            for k, t in tgts.items()
            if k[0] == "file"
        ]

    def inspect(self, pid: int) -> tuple[list[Holder], bool]:
        """(holders in this process, True if we may not read its descriptors or mappings).

        "May not" is decided per descriptor and per file, not only by the
        listing of ``fd/``: the listing can be allowed where following the
        links is not (a process in another user namespace, or one more
        privileged than us, such as a sandbox's init), and such a process
        must be counted as not inspected, never passed over as holding nothing.
        """
        base = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(base)
        except PermissionError:
            return [], True
        except OSError:
            return [], False
        found: dict[tuple[str, int | None], tuple[Target, str]] = {}
        denied = False
        for name in fds:
            try:
                st = os.stat(f"{base}/{name}")
            except PermissionError:
                denied = True  # the same check guards every descriptor: stop asking
                break
            except OSError:
                continue  # closed meanwhile
            mode = st.st_mode
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                t = self.rdev.get(st.st_rdev)
            elif stat.S_ISREG(mode):
                t = self.tgts.get(("file", st.st_dev, st.st_ino))
            else:
                continue
            if t is not None:
                found.setdefault((t.cls, t.unit), (t, "fd"))
        try:
            for t in self._mapped(pid):
                found.setdefault((t.cls, t.unit), (t, "mmap"))
        except PermissionError:
            denied = True
        if not found:
            return [], denied
        st0 = procscan.stat_of(pid)
        if st0 is None or st0.is_dead:
            return [], False
        uid = _uid(pid)
        return [Holder(pid, st0.starttime, uid, t.cls, t.unit, how, t.path)
                for t, how in found.values()], denied  # fmt: skip

    def _mapped(self, pid: int) -> list[Target]:
        data = _read(f"/proc/{pid}/maps")
        if not data:
            return []
        out = [t for needle, t in self.map_needles if needle in data]
        if self.rdev and b" /dev/" in data:
            # Another node file for the same device (mknod elsewhere): the
            # path only locates it; its device number decides.
            for line in data.splitlines():
                parts = line.split(None, 5)
                if len(parts) < 6 or not parts[5].startswith(b"/dev/") or parts[4] == b"0":
                    continue
                try:
                    st = os.stat(parts[5].decode())
                except (OSError, UnicodeDecodeError):
                    continue
                t = self.rdev.get(st.st_rdev) if stat.S_ISCHR(st.st_mode) else None
                if t is not None and t not in out:
                    out.append(t)
        return out


def _read(path: str) -> bytes:
    """A whole /proc file with plain system calls (no buffered file object per file).

    Raises PermissionError (a process we may not inspect); b"" if it is gone.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except PermissionError:
        raise
    except OSError:
        return b""
    try:
        chunks: list[bytes] = []
        while True:
            chunk = os.read(fd, 262144)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    except PermissionError:
        raise
    except OSError:
        return b""
    finally:
        os.close(fd)


def scan(tgts: dict[Key, Target], pids: Iterable[int] | None = None, threads: int = 0) -> Scan:
    """Who holds any of ``tgts`` now (one entry per process and node).

    The work is system calls on /proc (which release the GIL), so it is spread
    over a few threads: on two cores that nearly halves the wall time.
    """
    import threading

    t0 = time.monotonic()
    me = os.getpid()
    todo = [p for p in (procscan.pids() if pids is None else pids) if p != me]
    matcher = _Matcher(tgts)
    threads = threads or min(4, os.cpu_count() or 1)
    results: list[tuple[list[Holder], int]] = []

    def work(chunk: list[int]) -> None:
        holders: list[Holder] = []
        denied = 0
        for pid in chunk:
            found, no = matcher.inspect(pid)
            holders += found
            denied += no
        results.append((holders, denied))  # list.append is atomic

    chunks: list[list[int]] = [todo[i::threads] for i in range(threads)]
    workers = [threading.Thread(target=work, args=(c,)) for c in chunks[1:]]
    for w in workers:
        w.start()
    work(chunks[0])
    for w in workers:
        w.join()
    holders = [h for part, _ in results for h in part]
    denied = sum(d for _, d in results)
    return Scan(holders, denied, len(todo), time.monotonic() - t0)


def _uid(pid: int) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


# ---------------------------------------------------------------- attribution


class LeaseView(NamedTuple):
    lease: str
    cls: str
    devices: tuple[int, ...]
    label: str
    holder_pid: int
    holder_start: int
    leaves: tuple[str, ...]
    alive: bool  # the holder still runs


def live_leases(sd: StateDir) -> list[LeaseView]:
    """The leases recorded in token files (one view per lease)."""
    seen: dict[str, LeaseView] = {}
    for path in sorted(glob.glob(os.path.join(sd.path, "*-*.token"))):
        rec = read_record(path)
        if rec is None or rec.get("lease") in seen:
            continue
        st = procscan.stat_of(int(rec["holder_pid"]))
        alive = st is not None and not st.is_dead and st.starttime == int(rec["holder_start"])
        seen[rec["lease"]] = LeaseView(
            rec["lease"], rec["cls"], tuple(rec["devices"]), rec["label"],
            int(rec["holder_pid"]), int(rec["holder_start"]),
            tuple(rec.get("leaves") or ()), alive,
        )  # fmt: skip
    return list(seen.values())


class Verdict(NamedTuple):
    covered: bool
    lease: str | None
    label: str | None
    why: str


def attribute(
    h: Holder,
    leases: list[LeaseView],
    procs: dict[int, Stat],
    ended: list[dict[str, Any]] | None = None,
) -> Verdict:
    """Which lease covers ``h``, and how; or why it is stray.

    ``ended``: leases that ended (the daemon's ``ended.json``), to name the
    lease a stray outlived. That match may use the ``HOLD_TREE`` marker: it
    only explains a stray, it never covers anything.
    """
    chain = {(a.pid, a.starttime) for a in _ancestors(h.pid, procs)}
    chain.add((h.pid, h.starttime))
    where = _cgroup_dir(h.pid)
    related: list[tuple[LeaseView, str]] = []
    for lv in leases:
        by = None
        if (lv.holder_pid, lv.holder_start) in chain:
            by = f"descends from holder pid {lv.holder_pid}"
        elif where is not None and any(where == lf or where.startswith(lf + "/")
                                       for lf in lv.leaves):  # fmt: skip
            by = "in the lease's cgroup"
        if by is None:
            continue
        if lv.cls == h.cls and lv.alive and (h.unit is None or h.unit in lv.devices):
            return Verdict(True, lv.lease, lv.label, by)
        related.append((lv, by))
    for lv, _by in related:
        if not lv.alive:
            return Verdict(False, lv.lease, lv.label,
                           f"the holder of lease {lv.lease} is gone")  # fmt: skip
        if lv.cls == h.cls:
            devs = ",".join(map(str, lv.devices))
            why = f"lease {lv.lease} is for {lv.cls}:{devs}, not {h.cls}:{h.unit}"
            return Verdict(False, lv.lease, lv.label, why)
        return Verdict(False, lv.lease, lv.label,
                       f"lease {lv.lease} is for {lv.cls}, not {h.cls}")  # fmt: skip
    past = _outlived(h, where, ended or [])
    if past is not None:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(past["ended"])))
        why = f"lease {past['lease']} ended at {when}; this process outlived it"
        return Verdict(False, past["lease"], past["label"], why)
    dev = h.cls if h.unit is None else f"{h.cls}:{h.unit}"
    on_it = [lv for lv in leases if lv.cls == h.cls and lv.alive
             and (h.unit is None or h.unit in lv.devices)]  # fmt: skip
    if not on_it:
        return Verdict(False, None, None, f"no live lease on {dev}")
    names = ", ".join(f"{lv.lease} (holder pid {lv.holder_pid})" for lv in on_it)
    return Verdict(False, None, None, f"not in the tree of {dev}'s lease {names}")


def _outlived(h: Holder, where: str | None, ended: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ended lease whose tree ``h`` belonged to (by marker or leaf), if any."""
    if not ended:
        return None
    environ = _read(f"/proc/{h.pid}/environ")
    marker = None
    for entry in environ.split(b"\0"):
        if entry.startswith(b"HOLD_TREE="):
            marker = entry[10:].decode(errors="replace")
    rec: dict[str, Any]
    for rec in reversed(ended):
        if marker is not None and marker in (rec.get("trees") or []):
            return rec
        leaves = rec.get("leaves") or []
        if where is not None and any(where == lf or where.startswith(lf + "/") for lf in leaves):
            return rec
    return None


def ended_leases(sd: StateDir) -> list[dict[str, Any]]:
    """The daemon's record of recently ended leases (empty if none)."""
    try:
        with open(os.path.join(sd.path, "ended.json"), "rb") as f:
            data = json.loads(f.read())
    except (OSError, ValueError):
        return []
    return data if isinstance(data, list) else []


def _ancestors(pid: int, procs: dict[int, Stat]) -> list[Stat]:
    out: list[Stat] = []
    st = procs.get(pid)
    seen: set[int] = set()
    while st is not None and st.ppid > 0 and st.ppid not in seen:
        seen.add(st.ppid)
        st = procs.get(st.ppid)
        if st is not None:
            out.append(st)
    return out


_MOUNT = v2_mount()


def _cgroup_dir(pid: int) -> str | None:
    rel = own_cgroup(pid)
    if _MOUNT is None or rel is None:
        return None
    return os.path.normpath(_MOUNT + rel)


# ------------------------------------------------------------------ details


class Details(NamedTuple):
    command: str
    age_s: float | None
    rss_bytes: int | None


def details(pid: int) -> Details:
    """What a person needs to see of a holder, through psutil.

    Only for the few holders found, after the scan, so psutil's per-process
    object costs nothing that matters, and it tells a process that is gone
    from one we may not read.
    """
    import psutil

    try:
        p = psutil.Process(pid)
        with p.oneshot():
            command = " ".join(p.cmdline()) or f"[{p.name()}]"
            return Details(command, max(0.0, time.time() - p.create_time()),
                           p.memory_info().rss)  # fmt: skip
    except psutil.NoSuchProcess:
        return Details("(exited)", None, None)
    except psutil.AccessDenied:
        return Details("(not readable)", None, None)


def device_memory(holders: list[Holder]) -> dict[tuple[int, str, int | None], int]:
    """Bytes of device memory per (pid, class, index), where the driver reports it.

    NVIDIA: NVML (``nvidia-ml-py``) when installed; AMD: the KFD per-process
    entries in sysfs; others: DRM ``fdinfo`` memory keys. Absent sources are
    skipped: the column then says nothing rather than something wrong.
    """
    out: dict[tuple[int, str, int | None], int] = {}
    pids = {h.pid for h in holders}
    if not pids:
        return out
    _nvml(pids, out)
    _kfd(pids, out)
    _drm_fdinfo(holders, out)
    return out


def _nvml(pids: set[int], out: dict[tuple[int, str, int | None], int]) -> None:
    try:
        import pynvml  # type: ignore[import-not-found]  # nvidia-ml-py, optional
    except ImportError:
        return
    try:
        pynvml.nvmlInit()
    except Exception:
        return
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            dev = pynvml.nvmlDeviceGetHandleByIndex(i)
            try:
                minor = int(pynvml.nvmlDeviceGetMinorNumber(dev))
            except Exception:
                minor = i
            procs = []
            for fn in ("nvmlDeviceGetComputeRunningProcesses",
                       "nvmlDeviceGetGraphicsRunningProcesses"):  # fmt: skip
                try:
                    procs += getattr(pynvml, fn)(dev)
                except Exception:
                    continue
            for p in procs:
                used = getattr(p, "usedGpuMemory", None)
                if p.pid in pids and used is not None:
                    key = (int(p.pid), "gpu", minor)
                    out[key] = out.get(key, 0) + int(used)
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _kfd(pids: set[int], out: dict[tuple[int, str, int | None], int]) -> None:
    for pid in pids:
        for path in glob.glob(f"/sys/class/kfd/kfd/proc/{pid}/vram_*"):
            try:
                with open(path, "rb") as f:
                    used = int(f.read().strip())
            except (OSError, ValueError):
                continue
            key = (pid, "gpu", None)
            out[key] = out.get(key, 0) + used


def _drm_fdinfo(holders: list[Holder], out: dict[tuple[int, str, int | None], int]) -> None:
    for h in holders:
        # Only DRM nodes have drm-* keys; reading every fdinfo of every other
        # holder would be most of a large audit's time for nothing.
        if (h.pid, h.cls, h.unit) in out or not h.node.startswith("/dev/dri/"):
            continue
        total = 0
        for path in glob.glob(f"/proc/{h.pid}/fdinfo/*"):
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            if b"drm-" not in data:
                continue
            for line in data.splitlines():
                if line.startswith((b"drm-memory-", b"drm-resident-")):
                    value = line.split(b":", 1)[1].split()
                    try:
                        n = int(value[0])
                    except (IndexError, ValueError):
                        continue
                    unit = value[1] if len(value) > 1 else b""
                    total += n * {b"KiB": 1024, b"MiB": 1 << 20, b"GiB": 1 << 30}.get(unit, 1)
        if total:
            out[(h.pid, h.cls, h.unit)] = total


# ---------------------------------------------------------------- the report


def build_report(sd: StateDir, classes: dict[str, DeviceClass], only: str | None) -> dict[str, Any]:
    """Scan and attribute; the ``--json`` document (schema version 1)."""
    tgts = targets(classes, only)
    result = scan(tgts)
    procs = procscan.snapshot()
    leases = live_leases(sd)
    ended = ended_leases(sd)
    mem = device_memory(result.holders)
    rows = []
    for h in sorted(result.holders, key=lambda h: (h.cls, -1 if h.unit is None else h.unit,
                                                   h.pid)):  # fmt: skip
        if classes[h.cls].allows(h.pid, h.uid):
            v = Verdict(True, None, None, "an allowed holder of the class (configuration)")
        else:
            v = attribute(h, leases, procs, ended)
        try:
            user = pwd.getpwuid(h.uid).pw_name
        except KeyError:
            user = str(h.uid)
        d = details(h.pid)
        rows.append({
            "device": h.cls if h.unit is None else f"{h.cls}:{h.unit}",
            "cls": h.cls, "index": h.unit, "node": h.node, "how": h.how,
            "pid": h.pid, "starttime": h.starttime, "uid": h.uid, "user": user,
            "command": d.command,
            "age_s": None if d.age_s is None else round(d.age_s, 1),
            "rss_bytes": d.rss_bytes,
            "device_memory_bytes": mem.get((h.pid, h.cls, h.unit),
                                           mem.get((h.pid, h.cls, None))),
            "covered": v.covered, "lease": v.lease, "label": v.label, "why": v.why,
        })  # fmt: skip
    return {
        "version": 1,
        "holders": rows,
        "stray": sum(1 for r in rows if not r["covered"]),
        "not_inspected": result.not_inspected,
        "processes": result.processes,
        "scan_seconds": round(result.seconds, 4),
    }


def render_table(doc: dict[str, Any]) -> str:
    cols = ("DEVICE", "PID", "USER", "AGE", "RSS", "DEVMEM", "LEASE", "COMMAND")
    lines = []
    rows = []
    for r in doc["holders"]:
        if not r["covered"]:
            lease = f"STRAY: {r['why']}"
        else:
            lease = f"{r['lease']} {r['label']!r}" if r["lease"] else "allowed (configuration)"
        rows.append((r["device"], str(r["pid"]), r["user"], format_duration(r["age_s"]),
                     _size(r["rss_bytes"]), _size(r["device_memory_bytes"]), lease,
                     r["command"][:60]))  # fmt: skip
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c)
              for i, c in enumerate(cols)]  # fmt: skip
    lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip())
    for row in rows:
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    tail = f"{len(rows)} holder(s), {doc['stray']} stray; {doc['processes']} processes scanned"
    if doc["not_inspected"]:
        tail += f"; not inspected: {doc['not_inspected']} (permission)"
    lines.append(tail)
    return "\n".join(lines)


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    if n < 1024:
        return f"{n}B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if size < 1024 or unit == "GiB":
            break
    return f"{size:.1f}{unit}"


# ------------------------------------------------------------------- --kill


def kill_strays(doc: dict[str, Any], sd: StateDir, grace: float) -> list[dict[str, Any]]:
    """Stop the tree of every stray holder; what each stop did.

    Never touched: pid 1, the daemon, this process and its ancestors, and
    every covered holder with everything below it. A stray that is one of
    these is reported as not stopped (it still holds the device), never
    passed to ``stop_tree``, which would find an empty tree and call that a
    success. "Stopped" means the stop's survivor check came back empty *and*
    the stray itself (by pid and start time) is gone.

    A stray that an earlier stray's stop ended (a member of that tree: its
    descendant, say, or killed by that stop's survivor check) is reported as
    such -- what was done to it, and with whose tree -- not as "already gone".
    """
    from supervisor.identity import ProcessId
    from supervisor.stop import stop_tree
    from supervisor.tree import Tree

    daemon: set[int] = set()
    try:
        with open(sd.lock, "rb") as f:
            text = f.read().strip()
        if text.isdigit():
            daemon.add(int(text))
    except OSError:
        pass
    me = os.getpid()
    callers = {me} | {a.pid for a in procscan.ancestors(me)}
    covered = frozenset(r["pid"] for r in doc["holders"] if r["covered"])
    results: list[dict[str, Any]] = []
    done: set[int] = set()
    # pid -> (its start time, or None where only the pid is known; the stray
    # whose tree's stop ended it; what that stop did to it)
    ended: dict[int, tuple[int | None, int, str]] = {}
    for r in doc["holders"]:
        pid = r["pid"]
        if r["covered"] or pid in done:
            continue
        done.add(pid)

        def spared(why: str, pid: int = pid) -> None:
            results.append({"pid": pid, "stopped": False, "why": f"never stopped: {why}"})

        if pid == 1 or pid in daemon:
            spared("init or the daemon")
            continue
        if pid in callers:
            spared("this audit or one of its ancestors")
            continue
        above = {a.pid for a in procscan.ancestors(pid)} | {pid}
        if above & covered:
            spared(f"a covered holder (pid {min(above & covered)}) or below one")
            continue
        st = procscan.stat_of(pid)
        if st is None or st.is_dead or st.starttime != r["starttime"]:
            by = ended.get(pid)
            if by is not None and by[0] in (None, r["starttime"]):
                results.append({"pid": pid, "stopped": True, "with": by[1], "outcome": by[2],
                                "why": f"{by[2]} with the tree of stray pid {by[1]}"})  # fmt: skip
            else:
                results.append({"pid": pid, "stopped": True, "why": "already gone"})
            continue
        # Its own group and session only if it leads them: a stray started from
        # someone's shell must not take the shell's session with it. Spared
        # (with everything below them): covered holders and the daemon. Not
        # pid 1, everything is below it; it cannot be a member anyway.
        ident = ProcessId(pid, st.starttime)
        tree = Tree(
            f"audit{pid}", ident,
            st.pgrp if st.pgrp == pid else None,
            st.session if st.session == pid else None,
            spare=covered | frozenset(daemon),
        )  # fmt: skip
        report = stop_tree(tree, grace=grace)
        for m in report.stopped:
            ended[m.pid] = (m.ident.starttime, pid, f"ended on {report.signal}")
        for m in report.killed:
            ended[m.pid] = (m.ident.starttime, pid, "killed")
        for sv in report.escalated:
            ended[sv.pid] = (None, pid, "killed by the survivor check")
        for sv in report.survivors:  # still alive: not ended by anyone
            ended.pop(sv.pid, None)
        gone = not ident.is_running()  # a zombie holds nothing
        survivors = [s._asdict() for s in report.survivors]
        if not gone and pid not in {s["pid"] for s in survivors}:
            survivors.append({"pid": pid, "command": r["command"], "found_by": "the stray itself"})
        results.append({
            "pid": pid, "stopped": report.ok and gone, "outcome": report.outcome,
            "members": [m.pid for m in report.stopped],
            "survivors": survivors,
        })  # fmt: skip
    return results
