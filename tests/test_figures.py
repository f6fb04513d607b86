"""Resource figures (issue 25): CPU, memory and process count of a tree, a lease and a unit.

Real processes that work and hold memory (``progs/burner.py``), read from a
cgroup leaf and through psutil; the daemon's status, ``hold status``,
``hold metrics`` (the official parser), ``hold report``, ``hold ps``, a
non-root user's own lease; NVML where there is a GPU. Bounds, never exact
timings: a figure is checked against what the test made (50 MiB held, one
process or three), and CPU only for being there and growing.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    CPU,
    HOLD,
    PROGS,
    as_user,
    fresh_leaf,
    stop_daemon,
    unpriv_python,
    update_config,
    wait_for,
)

from hold_supervisor.proc import usage
from hold_supervisor.proc.cgroup import CgroupUnavailable

BIN = Path(sys.executable).parent
PY = sys.executable
BURNER = str(PROGS / "burner.py")
MB = 50
HELD = MB << 20  # what the burner writes to: resident, and charged to its cgroup
CPUS = os.cpu_count() or 1


def burner_argv(tmp_path: Path, children: int = 0) -> list[str]:
    return [PY, BURNER, str(tmp_path), str(MB), str(children)]


def burner(tmp_path: Path, *prefix: str, children: int = 0) -> subprocess.Popen[bytes]:
    return subprocess.Popen([*prefix, *burner_argv(tmp_path, children)], stdin=subprocess.DEVNULL)


def ready(tmp_path: Path, proc: subprocess.Popen[bytes] | None = None) -> int:
    path = tmp_path / "burner.ready"

    def check() -> str | None:
        assert proc is None or proc.poll() is None, f"{proc.args} ended with {proc.returncode}"
        return (path.exists() and path.read_text()) or None

    return int(wait_for(check, 30, 0.02, "the burner"))


def stop(tmp_path: Path, proc: subprocess.Popen[bytes]) -> None:
    (tmp_path / "burner.stop").write_text("")
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def grows(read: Any, before: usage.TreeUsage, what: str) -> usage.TreeUsage:
    """A later reading whose CPU time is above ``before``'s (bounded wait), at least
    half a second later: CPU time moves in clock ticks (10 ms), so a per cent over
    a shorter time says little (what :class:`usage.Rates` keeps to as well)."""
    found: usage.TreeUsage = wait_for(
        lambda: (
            (r := read()) is not None
            and r.at - before.at >= 0.5
            and r.cpu_seconds > before.cpu_seconds
            and r
        ),
        30,
        0.05,
        what,
    )
    return found


# --------------------------------------------------------------------------
# hold_supervisor.proc.usage, on its own


def test_figures_of_pids_through_psutil(tmp_path: Path) -> None:
    proc = burner(tmp_path, children=2)
    try:
        pid = ready(tmp_path, proc)
        from hold_supervisor.proc import scan

        def family() -> set[int]:
            procs = scan.snapshot()
            return {pid} | scan.descendants([pid], procs)

        kids = wait_for(lambda: len(family()) == 3 and family(), 30, 0.05, "the two children")
        first = usage.of_pids(kids)
        assert first.source == "psutil" and first.pids == 3
        assert HELD <= first.rss_bytes < 3 * (HELD + (200 << 20)), first
        later = grows(lambda: usage.of_pids(kids), first, "the burner's CPU time")
        pct = usage.cpu_percent(first, later)
        assert pct is not None and 0 < pct <= 100 * CPUS + 5, pct
        # A pid that is gone is left out, not an error.
        assert usage.of_pids([*kids, 2**22 + 1]).pids in (2, 3)
    finally:
        stop(tmp_path, proc)


def test_figures_of_a_cgroup_leaf(tmp_path: Path) -> None:
    try:
        ctx = fresh_leaf()
        leaf = ctx.__enter__()
    except CgroupUnavailable as e:
        pytest.skip(f"no cgroup leaf here: {e}")
    proc = None
    try:
        # Born in the leaf: the shell moves itself, then becomes the burner.
        proc = burner(tmp_path, "sh", "-c", f'echo $$ > {leaf.procs_file} && exec "$@"', "sh")
        ready(tmp_path, proc)
        first = usage.of_leaf(leaf.path)
        assert first is not None and first.source == "cgroup" and first.pids == 1, first
        # memory.current (the charge: page cache and kernel memory too) or,
        # without the memory controller, the process's resident memory.
        assert HELD <= first.rss_bytes < HELD + (300 << 20), first
        if os.path.exists(f"{leaf.path}/memory.peak"):
            assert first.peak_bytes is not None and first.peak_bytes >= first.rss_bytes - (1 << 20)
        later = grows(lambda: usage.of_leaf(leaf.path), first, "the leaf's CPU time")
        pct = usage.cpu_percent(first, later)
        assert pct is not None and 0 < pct <= 100 * CPUS + 5, pct
        stop(tmp_path, proc)
        # The exited process's CPU time stays in the leaf's count.
        gone = usage.of_leaf(leaf.path)
        assert gone is not None and gone.pids == 0 and gone.cpu_seconds >= later.cpu_seconds
    finally:
        if proc is not None and proc.poll() is None:
            stop(tmp_path, proc)
        ctx.__exit__(None, None, None)
    assert usage.of_leaf(leaf.path) is None  # removed: unknown, not zero


def test_rates_compare_with_a_reading_old_enough() -> None:
    rates = usage.Rates(least=0.5)
    a = usage.TreeUsage(1.0, 0, 1, "cgroup", at=100.0)
    assert rates.percent("x", a) is None  # nothing to compare with yet
    b = usage.TreeUsage(1.5, 0, 1, "cgroup", at=101.0)
    assert rates.percent("x", b) == pytest.approx(50.0)
    # A moment later (another asker): the per cent said last, not one over 10 ms.
    c = usage.TreeUsage(1.51, 0, 1, "cgroup", at=101.01)
    assert rates.percent("x", c) == pytest.approx(50.0)
    d = usage.TreeUsage(3.5, 0, 1, "cgroup", at=102.0)
    assert rates.percent("x", d) == pytest.approx(200.0)  # two CPUs busy
    rates.forget([])
    assert rates.percent("x", d) is None
    # A psutil sum falls when a member exits unreaped: 0, not negative.
    assert usage.cpu_percent(d, usage.TreeUsage(1.0, 0, 1, "psutil", at=103.0)) == 0.0


# --------------------------------------------------------------------------
# A lease: the daemon's status, hold status, hold metrics, hold report


def status() -> dict[str, Any]:
    out = subprocess.run([*HOLD, "status", "--json"], capture_output=True, text=True, check=True)
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def holder() -> dict[str, Any] | None:
    h: dict[str, Any] | None = status()["classes"]["npu"]["devices"][0]["holder"]
    return h


def test_a_lease_shows_what_its_processes_use(tmp_path: Path, cgroup_mode: str) -> None:
    parser = pytest.importorskip("prometheus_client.parser")
    (tmp_path / "accel0").write_text("")
    update_config(
        tmp_path,
        devices={"npu": {"nodes": [str(tmp_path / "accel*")]}},
        cgroups="required" if cgroup_mode == "cgroup" else "off",
    )
    client = subprocess.Popen(
        [str(BIN / "npu-hold"), "-t", "5m", "-l", 'fig"ures\\', "--", *burner_argv(tmp_path, 2)],
        stdin=subprocess.DEVNULL,
    )
    try:
        ready(tmp_path, client)

        def settled() -> dict[str, Any] | None:
            h = holder()
            u = h and h["usage"]
            return u if u and u["pids"] == 3 and u["rss_bytes"] >= HELD else None

        first = wait_for(settled, 30, 0.1, "the lease's three processes in its usage")
        assert first["source"] == ("cgroup" if cgroup_mode == "cgroup" else "psutil")
        assert first["rss_bytes"] < 3 * (HELD + (200 << 20))

        def grown() -> dict[str, Any] | None:
            h = holder()
            u = h and h["usage"]
            # A per cent once the daemon has a reading half a second older.
            return u if u and u["cpu_seconds"] > first["cpu_seconds"] and u["cpu_percent"] else None

        second = wait_for(grown, 30, 0.2, "the lease's CPU time to grow")
        assert 0 < second["cpu_percent"] <= 100 * CPUS + 5

        # hold status, at a "terminal" 200 wide and piped: the same figures in words.
        piped = subprocess.run([*HOLD, "status"], capture_output=True, text=True, check=True)
        row = next(ln for ln in piped.stdout.splitlines() if ln.startswith("npu:0"))
        assert "procs 3" in row and "mem " in row and "cpu " in row, row

        # hold metrics: the lease's counter and gauges, parsed by the official parser.
        text = subprocess.run([*HOLD, "metrics"], capture_output=True, text=True, check=True)
        fams = {f.name: f for f in parser.text_string_to_metric_families(text.stdout)}
        assert fams["hold_lease_cpu_seconds"].type == "counter"
        [cpu] = fams["hold_lease_cpu_seconds"].samples
        h = holder()
        assert h is not None
        assert cpu.labels == {
            "lease": h["lease"],
            "user": h["user"],
            "label": 'fig"ures\\',
            "class": "npu",
        }
        assert cpu.value >= second["cpu_seconds"]
        [mem] = fams["hold_lease_memory_bytes"].samples
        [count] = fams["hold_lease_processes"].samples
        assert mem.value >= HELD and count.value == 3
    finally:
        client.send_signal(signal.SIGTERM)
        client.wait(30)
    # The history's line of the lease: its CPU time and its peak memory.
    rep = json.loads(
        subprocess.run(
            [*HOLD, "report", "--json"], capture_output=True, text=True, check=True
        ).stdout
    )
    [user] = rep["users"]
    assert user["cpu_s"] is not None and user["cpu_s"] >= second["cpu_seconds"] * 0.99
    assert user["peak_bytes"] >= HELD and user["cpu_unmeasured"] == 0
    [dev] = [d for d in rep["devices"] if d["device"] == "npu:0"]
    assert dev["cpu_s"] == pytest.approx(user["cpu_s"]) and dev["peak_bytes"] == user["peak_bytes"]
    words = subprocess.run([*HOLD, "report"], capture_output=True, text=True, check=True).stdout
    head = next(ln for ln in words.splitlines() if ln.startswith("USER"))
    assert "CPU" in head and "PEAK MEM" in head


def test_old_history_lines_show_unknown_not_zero() -> None:
    from hold.daemon.report import build
    from hold.views.report import text_lines

    old = {
        "kind": "lease",
        "lease": "a",
        "user": "ann",
        "uid": 1000,
        "cls": "npu",
        "devices": [0, 1],
        "label": "x",
        "private": False,
        "requested": 0.0,
        "granted": 0.0,
        "ended": 3600.0,
        "end": "ended",
        "by": None,
        "held": None,
    }
    doc = build([old], 0, show_labels=False, since=0.0, now=3600.0)
    [ann] = doc["users"]
    assert ann["cpu_s"] is None and ann["peak_bytes"] is None and ann["cpu_unmeasured"] == 1
    row = next(ln for ln in text_lines(doc, None) if ln.startswith("ann"))
    assert row.split()[4:6] == ["-", "-"], row  # CPU, PEAK MEM
    # With a newer line beside it: the known part, said to be a lower bound.
    new = {**old, "lease": "b", "cpu_s": 7200.0, "peak_bytes": 3 << 30}
    doc = build([old, new], 0, show_labels=False, since=0.0, now=3600.0)
    [ann] = doc["users"]
    assert ann["cpu_s"] == 7200.0 and ann["peak_bytes"] == 3 << 30
    dev = {d["device"]: d for d in doc["devices"]}
    assert dev["npu:0"]["cpu_s"] == dev["npu:1"]["cpu_s"] == 3600.0  # half on each device
    row = next(ln for ln in text_lines(doc, None) if ln.startswith("ann"))
    assert row.split()[4:6] == [">=2h00m", "3.0GiB"], row


def test_metrics_keep_private_labels_out_and_escape_others() -> None:
    parser = pytest.importorskip("prometheus_client.parser")
    from hold.views.metrics import render

    def held(lease: str, label: str | None, private: bool) -> dict[str, Any]:
        u = {
            "cpu_seconds": 1.5,
            "cpu_percent": None,
            "rss_bytes": 10,
            "pids": 2,
            "source": "psutil",
        }
        return {
            "lease": lease,
            "label": label,
            "private": private,
            "user": 'b"ob',
            "uid": 1,
            "pid": 1,
            "since": 1.0,
            "expires": 2.0,
            "state": "active",
            "usage": u,
        }

    ans = {
        "classes": {
            "npu": {
                "devices": [
                    {"index": 0, "holder": held("l1", 'a"b\\c\nd', False)},
                    {"index": 1, "holder": held("l2", "secret", True)},
                    {"index": 2, "holder": held("l2", "secret", True)},  # the same lease
                ],
                "queue": [],
            }
        },
        "counters": {},
        "started": 1.0,
    }
    fams = {
        f.name: f
        for f in parser.text_string_to_metric_families(render({"status": ans, "audit": None}))
    }
    samples = {s.labels["lease"]: s for s in fams["hold_lease_cpu_seconds"].samples}
    assert set(samples) == {"l1", "l2"}  # one sample per lease, however many devices
    assert samples["l1"].labels["label"] == 'a"b\\c\nd' and samples["l1"].labels["user"] == 'b"ob'
    assert samples["l2"].labels["label"] == ""  # private, even for root's eyes
    assert samples["l1"].value == 1.5


# --------------------------------------------------------------------------
# A stack's units: hold ps


def test_ps_shows_what_each_unit_uses(tmp_path: Path, cgroup_mode: str) -> None:
    stack = tmp_path / "figs.yaml"
    stack.write_text(
        "name: figs\n"
        "units:\n"
        "  burn:\n"
        f"    cmd: {json.dumps(burner_argv(tmp_path, 1))}\n"
        "  idle:\n"
        "    cmd: [sleep, '60']\n"
        "  tool:\n"
        "    kind: task\n"
        f"    cmd: [{json.dumps(PY)}, -c, 'print(1)']\n"
        f'    cpus: "{CPU}"\n'
    )
    up = subprocess.run(
        [*HOLD, "up", "--detach", str(stack)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        assert up.returncode == 0, up.stderr
        ready(tmp_path)

        def units() -> dict[str, dict[str, Any]]:
            out = subprocess.run(
                [*HOLD, "ps", "figs", "--json"], capture_output=True, text=True, check=True
            )
            return {u["unit"]: u for u in json.loads(out.stdout)["units"]}

        def burning() -> dict[str, Any] | None:
            u = units()["burn"]["usage"]
            return u if u and u["pids"] == 2 and u["rss_bytes"] >= HELD else None

        first = wait_for(burning, 30, 0.1, "the burning unit's two processes")
        assert first["source"] == ("cgroup" if cgroup_mode == "cgroup" else "psutil")

        def grown() -> dict[str, Any] | None:
            u = units()["burn"]["usage"]
            return u if u["cpu_seconds"] > first["cpu_seconds"] and u["cpu_percent"] else None

        later = wait_for(grown, 30, 0.2, "the unit's CPU time to grow")
        assert 0 < later["cpu_percent"] <= 100 * CPUS + 5
        idle = units()["idle"]["usage"]
        assert idle["pids"] == 1 and idle["rss_bytes"] < HELD
        # A task unit between calls: no one, or the stub parked in its next call's leaf.
        tool = units()["tool"]["usage"]
        assert tool["pids"] in (0, 1) and tool["rss_bytes"] < HELD, tool
        assert tool["source"] == first["source"], tool
        text = subprocess.run([*HOLD, "ps", "figs"], capture_output=True, text=True, check=True)
        lines = text.stdout.splitlines()
        head = next(ln for ln in lines if ln.startswith("UNIT")).split()
        assert head[4:8] == ["CPU%", "CPU", "MEM", "PROCS"], head
        row = next(ln for ln in lines if ln.startswith("burn")).split()
        assert row[4].endswith("%") and row[6].endswith("MiB") and row[7] == "2", row
        # hold ps: each stack's sum (the burner's two processes, sleep, a parked stub).
        text = subprocess.run([*HOLD, "ps"], capture_output=True, text=True, check=True)
        lines = text.stdout.splitlines()
        assert lines[0].split()[4:8] == ["CPU%", "CPU", "MEM", "PROCS"], lines
        row = next(ln for ln in lines if ln.startswith("figs")).split()
        assert row[4].endswith("%") and row[6].endswith("MiB") and row[7] == str(3 + tool["pids"])
    finally:
        subprocess.run(
            [*HOLD, "down", "figs"], stdin=subprocess.DEVNULL, capture_output=True, timeout=120
        )


# --------------------------------------------------------------------------
# A user who is not root: the figures of their own lease, from their own daemon


@pytest.mark.skipif(os.geteuid() != 0, reason="making users needs root")
def test_a_user_sees_the_figures_of_their_own_lease(unpriv_user: str, unpriv_runtime: Path) -> None:
    py = unpriv_python()
    base = Path(tempfile.mkdtemp(prefix="hold-figures-", dir="/tmp"))
    base.chmod(0o777)
    (base / "accel0").write_text("")
    (base / "accel0").chmod(0o666)
    config = base / "config.yaml"
    # The user's own daemon cannot read root's processes: it would refuse the
    # device (issue 24); this test is about the figures, not that scan.
    config.write_text(
        f'devices:\n  npu:\n    nodes: ["{base}/accel*"]\nunreadable_processes: ignore\n'
    )
    config.chmod(0o644)
    # Its device's lock in the test's own directory, not in the machine's
    # /run/lock (where it stayed behind, one file a run).
    (base / "locks").mkdir(mode=0o1777)
    (base / "locks").chmod(0o1777)
    env = {
        "HOLD_STATE_DIR": str(base / "state"),
        "HOLD_CONFIG": str(config),
        "HOLD_LOCK_DIR": str(base / "locks"),
    }
    burn = [py, str(unpriv_runtime / "progs" / "burner.py"), str(base), str(MB)]

    def hold_as(*args: str) -> list[str]:
        return as_user(unpriv_user, [py, "-m", "hold", *args], unpriv_runtime, env)

    client = subprocess.Popen(
        hold_as("run", "--device", "npu", "-t", "5m", "--", *burn), stdin=subprocess.DEVNULL
    )
    try:
        wait_for(lambda: (base / "burner.ready").exists(), 30, 0.05, "the user's burner")

        def usage_doc() -> dict[str, Any] | None:
            out = subprocess.run(
                hold_as("status", "--json"), capture_output=True, text=True, timeout=30
            )
            assert out.returncode == 0, out.stderr
            h = json.loads(out.stdout)["classes"]["npu"]["devices"][0]["holder"]
            u = h and h["usage"]
            return u if u and u["pids"] == 1 and u["rss_bytes"] >= HELD else None

        u = wait_for(usage_doc, 30, 0.1, "the user's lease's figures")
        assert u["cpu_seconds"] > 0
    finally:
        (base / "burner.stop").write_text("")
        try:
            client.wait(30)
        except subprocess.TimeoutExpired:
            client.kill()
            client.wait()
        stop_daemon(base / "state", timeout=10)
        subprocess.run(["rm", "-rf", str(base)], check=False)


# --------------------------------------------------------------------------
# The hot path stays without psutil


def test_the_run_path_never_imports_psutil(tmp_path: Path) -> None:
    """``hold run`` and ``npu-hold`` from start to exit, every import logged
    (``-X importtime``, lazy ones included): psutil is not among them."""
    (tmp_path / "accel0").write_text("")
    update_config(tmp_path, devices={"npu": {"nodes": [str(tmp_path / "accel*")]}})
    for argv in (
        ["-m", "hold", "run", "--", "true"],
        [
            "-c",
            "import sys; from hold.cli.entry import npu_main; sys.exit(npu_main())",
            "-t",
            "1m",
            "--",
            "true",
        ],
        ["-m", "hold", "check", "--device", "npu"],
    ):
        res = subprocess.run(
            [PY, "-X", "importtime", *argv], capture_output=True, text=True, timeout=60
        )
        assert res.returncode in (0, 1), (argv, res.stderr[-2000:])
        imported = {ln.rsplit("|", 1)[-1].strip() for ln in res.stderr.splitlines() if "|" in ln}
        assert "hold.cli.entry" in imported or "hold.cli.run" in imported, argv
        assert not {m for m in imported if m.split(".")[0] == "psutil"}, argv


# --------------------------------------------------------------------------
# NVML: a real GPU's figures (skipped where there is none)


def _gpu_figures() -> dict[int, Any]:
    from hold.devices import nvml

    got = nvml.figures()
    if not got:
        pytest.skip("no NVIDIA GPU (NVML) here")
    return got


def test_nvml_figures_of_each_gpu() -> None:
    for minor, g in _gpu_figures().items():
        assert minor >= 0
        assert g.util_percent is not None and 0 <= g.util_percent <= 100, g
        assert g.memory_total_bytes is not None and g.memory_total_bytes > 0, g
        assert g.memory_used_bytes is not None and 0 <= g.memory_used_bytes <= g.memory_total_bytes


def test_status_adds_each_gpus_figures() -> None:
    """The daemon names each NVIDIA device's minor; the client adds NVML's figures."""
    figures = _gpu_figures()
    from hold.views.status import with_gpu

    minor = sorted(figures)[0]
    ans = {
        "classes": {
            "gpu": {"devices": [{"index": 0, "holder": None, "nvidia_minor": minor}], "queue": []},
            "npu": {"devices": [{"index": 0, "holder": None}], "queue": []},
        }
    }
    with_gpu(ans)
    gpu = ans["classes"]["gpu"]["devices"][0]["gpu"]  # type: ignore[index]
    assert set(gpu) == {"util_percent", "memory_used_bytes", "memory_total_bytes"}
    assert 0 <= gpu["util_percent"] <= 100 and gpu["memory_total_bytes"] > 0
    assert "gpu" not in ans["classes"]["npu"]["devices"][0]  # type: ignore[index]


def test_the_daemon_names_each_nvidia_device() -> None:
    from hold.daemon.status import _nvidia_minor

    assert _nvidia_minor("c195-3") == 3
    assert _nvidia_minor("c195-255") is None  # nvidiactl: no GPU
    assert _nvidia_minor("c226-128") is None and _nvidia_minor("f803-12") is None


def test_the_status_names_an_nvidia_device_and_the_client_adds_its_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A class over an NVIDIA GPU node (character major 195, made here): the daemon
    says its minor, and ``with_gpu`` adds what NVML says of that minor (here the
    fake driver of test_nvml: no GPU on this machine is asked)."""
    node = tmp_path / "nvidia200"
    try:
        os.mknod(node, 0o600 | stat.S_IFCHR, os.makedev(195, 200))
    except OSError as e:
        pytest.skip(f"cannot make a device node here: {e}")
    update_config(tmp_path, devices={"gpu": {"nodes": [str(node)]}})
    ans = status()
    [dev] = ans["classes"]["gpu"]["devices"]
    assert dev["nvidia_minor"] == 200 and dev["holder"] is None
    assert "gpu" not in dev  # no GPU 200 anywhere: nothing added
    assert all("nvidia_minor" not in d for d in ans["classes"]["npu"]["devices"])

    from test_nvml import FakeLib

    from hold.devices import nvml
    from hold.views.status import with_gpu

    fake = FakeLib()
    monkeypatch.setattr(nvml, "load", lambda: fake)
    dev["nvidia_minor"] = 3  # a GPU the fake driver has
    with_gpu(ans)
    assert dev["gpu"] == {
        "util_percent": 33,
        "memory_used_bytes": 3 << 20,
        "memory_total_bytes": 80 << 30,
    }
