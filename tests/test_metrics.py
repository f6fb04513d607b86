"""``hold metrics``: parsed by the official Prometheus client's parser, and each value
checked against ``hold status --json`` (and the audit, for strays) on a real daemon."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import HOLD, PROGS, wait_for

parser = pytest.importorskip("prometheus_client.parser")

NPU_HOLD = str(Path(sys.executable).parent / "npu-hold")
HOLDER = str(PROGS / "node_holder.py")


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value; every family with HELP and TYPE."""
    out = {}
    for fam in parser.text_string_to_metric_families(text):
        assert fam.documentation and fam.type in ("gauge", "counter", "summary"), fam.name
        assert fam.name.startswith("hold_")
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def dev(cls: str, i: int) -> tuple[tuple[str, str], ...]:
    return (("class", cls), ("index", str(i)))


def status() -> dict[str, Any]:
    out = subprocess.run([*HOLD, "status", "--json"], capture_output=True, text=True, check=True)
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def test_metrics_match_status(tmp_path: Path) -> None:
    for name in ("accel0", "stray0"):
        (tmp_path / name).write_text("")
    Path(os.environ["HOLD_CONFIG"]).write_text(
        f"devices:\n  npu:\n    nodes: [{json.dumps(str(tmp_path / 'accel*'))}]\n"
        f"  fake:\n    nodes: [{json.dumps(str(tmp_path / 'stray*'))}]\n"
    )
    done = subprocess.run([NPU_HOLD, "-t", "1m", "--", "true"], capture_output=True)
    assert done.returncode == 0
    holder = subprocess.Popen(
        [NPU_HOLD, "-t", "1h", "-l", "train", "--", "sleep", "60"], stdin=subprocess.DEVNULL
    )
    waiter = None
    out = tmp_path / "stray.out"
    stray = subprocess.Popen([sys.executable, HOLDER, str(out), "fd", str(tmp_path / "stray0")])
    try:
        wait_for(
            lambda: status()["classes"]["npu"]["devices"][0]["holder"] is not None,
            10,
            what="the grant",
        )
        waiter = subprocess.Popen([NPU_HOLD, "-t", "1m", "--", "true"], stdin=subprocess.DEVNULL)
        wait_for(lambda: len(status()["classes"]["npu"]["queue"]) == 1, 10, what="the waiter")
        wait_for(lambda: out.exists() and "holder" in out.read_text(), 10, what="the stray")
        time.sleep(1.0)
        dest = tmp_path / "out" / "hold.prom"
        dest.parent.mkdir()
        asked = time.time()
        res = subprocess.run(
            [*HOLD, "metrics", "--output", str(dest)], capture_output=True, text=True
        )
        answered = time.time()
        assert res.returncode == 0 and res.stdout == "", res.stderr
        doc = status()
        text = dest.read_text()
    finally:
        for p in (holder, waiter, stray):
            if p is not None:
                p.terminate()
                p.wait(30)
    assert oct(dest.stat().st_mode & 0o777) == "0o644"
    assert [p.name for p in dest.parent.iterdir()] == ["hold.prom"]  # no temporary file left
    m = samples(text)
    h = doc["classes"]["npu"]["devices"][0]["holder"]
    assert m[("hold_device_leased", dev("npu", 0))] == 1
    assert m[("hold_device_leased", dev("fake", 0))] == 0
    assert m[("hold_device_holder_uid", dev("npu", 0))] == h["uid"] == os.geteuid()
    # Aged while the metrics were made: between the asking and the answer (a
    # fixed 3 s around the status asked afterwards was 4.6 s off beside busy loops).
    age = m[("hold_device_lease_age_seconds", dev("npu", 0))]
    assert asked - h["since"] - 0.01 <= age <= answered - h["since"] + 0.01, (asked, answered, h)
    assert m[("hold_device_lease_expiry_timestamp_seconds", dev("npu", 0))] == h["expires"]
    assert ("hold_device_holder_uid", dev("fake", 0)) not in m  # not leased: no holder
    waiting = len(doc["classes"]["npu"]["queue"])
    assert m[("hold_device_waiters", dev("npu", 0))] == waiting == 1
    assert m[("hold_class_waiters", (("class", "npu"),))] == 1
    assert m[("hold_device_strays", dev("fake", 0))] == 1
    assert m[("hold_device_strays", dev("npu", 0))] == 0  # the lease's own: covered
    assert m[("hold_device_stray_memory_bytes", dev("fake", 0))] == 0  # a file: no driver
    npu = (("class", "npu"),)
    assert m[("hold_grants_total", npu)] == 2  # the first ticket, and the holder's
    assert m[("hold_expiries_total", npu)] == 0
    assert m[("hold_wait_seconds_count", npu)] == 2
    assert 0 <= m[("hold_wait_seconds_sum", npu)] < 2
    assert m[("hold_daemon_start_time_seconds", ())] <= h["since"]
    # Printed without --output: the same families.
    printed = subprocess.run([*HOLD, "metrics"], capture_output=True, text=True, check=True)
    assert {k[0] for k in samples(printed.stdout)} >= {"hold_device_leased", "hold_grants_total"}


def test_render_escapes_label_values() -> None:
    from hold.views.metrics import render

    ans = {
        "classes": {'we"ird\\cls': {"devices": [{"index": 0, "holder": None}], "queue": []}},
        "counters": {},
        "started": 5.0,
    }
    fams = list(parser.text_string_to_metric_families(render({"status": ans, "audit": None})))
    leased = next(f for f in fams if f.name == "hold_device_leased")
    assert leased.samples[0].labels == {"class": 'we"ird\\cls', "index": "0"}
