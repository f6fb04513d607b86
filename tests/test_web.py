"""``hold web``: the read-only status page, in a real browser (headless Chromium).

The scene: ``npu`` is a class of two regular files (so that a process can hold
a node); a real ``npu-hold`` lease on npu:0 runs a holder of npu:0 (covered),
and a plain process holds npu:1 (STRAY: no live lease). ``hold web`` serves
it; Chromium loads the page (``--dump-dom``, ``--screenshot``) and the test
reads the DOM's text. The lease's label is hostile HTML: it must show as text.

The browser tests are skipped only where no Chromium is installed (CI installs
Debian's ``chromium``, .ci/run); one browser start per test. Screenshots are
kept under tests/artifacts/ (git-ignored).
"""

from __future__ import annotations

import http.client
import json
import os
import pwd
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from conftest import HOLD, PROGS, holder_roles, update_config

from hold.views import web

PY = sys.executable
BIN = Path(sys.executable).parent
HOLDER = str(PROGS / "node_holder.py")
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_browser = pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (CI installs it)")
# Hostile on purpose: were it parsed as HTML, the page would gain a script and
# an image whose handler renames the page.
LABEL = "<script>alert(1)</script><img src=x onerror=\"document.title='pwned'\"> eval"


# --------------------------------------------------------------------------
# The scene: a lease with a covered holder, and a stray.


class Scene(NamedTuple):
    lease: str
    client: int  # npu-hold, the lease's holder
    covered: int  # the holder of npu:0 inside the lease
    stray: int  # the holder of npu:1, outside any lease


@pytest.fixture
def scene(tmp_path: Path) -> Iterator[Scene]:
    d = tmp_path / "npunodes"
    d.mkdir()
    nodes = [d / "accel0", d / "accel1"]
    for n in nodes:
        n.write_bytes(b"\0" * 4096)
    update_config(tmp_path, devices={"npu": {"nodes": [f"{d}/accel*"]}})
    client = subprocess.Popen(
        [
            str(BIN / "npu-hold"),
            "-t",
            "5m",
            "-l",
            LABEL,
            "--device",
            "npu:0",
            "--",
            PY,
            HOLDER,
            str(tmp_path / "covered.out"),
            "fd",
            str(nodes[0]),
        ],
        stdin=subprocess.DEVNULL,
    )
    stray = subprocess.Popen(
        [PY, HOLDER, str(tmp_path / "stray.out"), "fd", str(nodes[1])], stdin=subprocess.DEVNULL
    )
    try:
        covered = holder_roles(tmp_path / "covered.out", client)["holder"]
        holder_roles(tmp_path / "stray.out", stray)
        lease = json.loads(hold("status", "--json"))["classes"]["npu"]["devices"][0]["holder"]
        yield Scene(lease["lease"], client.pid, covered, stray.pid)
    finally:
        client.send_signal(signal.SIGTERM)  # it ends its lease and stops its tree
        stray.kill()
        stray.wait()
        client.wait(20)


def hold(*args: str) -> str:
    res = subprocess.run([*HOLD, *args], capture_output=True, text=True, timeout=60)
    assert res.returncode in (0, 1), (args, res.returncode, res.stderr)
    return res.stdout


@pytest.fixture
def served(tmp_path: Path) -> Iterator[str]:
    """``hold web --listen 127.0.0.1:0`` running; its URL."""
    err = (tmp_path / "web.err").open("wb")
    proc = subprocess.Popen(
        [*HOLD, "web", "--listen", "127.0.0.1:0"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=err,
    )
    try:
        assert proc.stdout is not None
        assert select.select([proc.stdout], [], [], 30)[0], "hold web said nothing in 30s"
        line = proc.stdout.readline().decode()
        m = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert m, (line, (tmp_path / "web.err").read_text())
        yield m.group(0)
    finally:
        proc.terminate()
        proc.wait(10)
        err.close()
        assert proc.stdout is not None
        proc.stdout.close()


def get(
    url: str, path: str, method: str = "GET", host: str | None = None, body: bytes | None = None
) -> tuple[int, dict[str, str], bytes]:
    m = re.match(r"http://([\d.]+):(\d+)/", url)
    assert m
    conn = http.client.HTTPConnection(m.group(1), int(m.group(2)), timeout=30)
    try:
        headers = {"Host": host} if host else {}
        conn.request(method, path, body=body, headers=headers)
        res = conn.getresponse()
        return res.status, {k.lower(): v for k, v in res.getheaders()}, res.read()
    finally:
        conn.close()


# --------------------------------------------------------------------------
# The browser.


def browse(url: str, tmp_path: Path, shot: str) -> str:
    """Chromium's DOM of ``url`` after 5 s of (virtual) time; its screenshot kept
    as tests/artifacts/``shot``."""
    assert CHROMIUM is not None
    ARTIFACTS.mkdir(exist_ok=True)
    png = ARTIFACTS / shot
    png.unlink(missing_ok=True)
    argv = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'chromium'}",
        "--virtual-time-budget=5000",
        "--dump-dom",
        f"--screenshot={png}",
        "--window-size=1280,800",
        url,
    ]
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # its whole session: the browser's helpers too
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, proc.returncode
    assert png.stat().st_size > 0
    print(f"screenshot: {png}")
    return out.decode()


class Tables(HTMLParser):
    """The text of each cell of each table with an id: {id: [[cell, ...], ...]};
    and every element's text by id."""

    def __init__(self, dom: str) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.texts: dict[str, str] = {}
        self.open: list[str | None] = []  # the id of each open element (None: none)
        self.table: str | None = None
        self.feed(dom)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        ident = dict(attrs).get("id")
        self.open.append(ident)
        if ident:
            self.texts[ident] = ""
        if tag == "table" and ident:
            self.table = ident
            self.tables[ident] = []
        elif tag == "tr" and self.table:
            self.tables[self.table].append([])
        elif tag in ("td", "th") and self.table:
            self.tables[self.table][-1].append("")

    def handle_endtag(self, tag: str) -> None:
        if self.open:
            self.open.pop()
        if tag == "table":
            self.table = None

    def handle_data(self, data: str) -> None:
        for ident in filter(None, self.open):
            self.texts[ident] += data
        if self.table and self.tables[self.table] and self.tables[self.table][-1]:
            self.tables[self.table][-1][-1] += data


def rows_with(rows: list[list[str]], first: str) -> list[list[str]]:
    return [r for r in rows if r and r[0] == first]


@needs_browser
def test_the_page_in_a_browser_shows_the_lease_and_the_stray(
    scene: Scene, served: str, tmp_path: Path
) -> None:
    dom = browse(served, tmp_path, "hold-web.png")
    page = Tables(dom)
    me = pwd.getpwuid(os.geteuid()).pw_name
    assert page.texts["error"] == "", page.texts["error"]
    assert page.texts["arbiter"].startswith("arbiter: per-user daemon of")

    [dev] = rows_with(page.tables["devices"], "npu:0")
    assert dev[1:5] == ["active", scene.lease, me, str(scene.client)]
    head = page.tables["devices"][0]
    assert head[5:9] == ["CPU%", "CPU", "MEM", "PROCS"] and head[-1] == "LABEL"
    assert dev[8] == "1" and dev[7].endswith("iB"), dev  # the holder's one process, its memory
    assert dev[-1] == LABEL  # the label, as text
    # The stray's device is not "free" (issue 45): the count saw its node open,
    # or the scan status started named the stray.
    assert rows_with(page.tables["devices"], "npu:1")[0][1] in ("in use", "unknown", "blocked")

    holders = {r[1]: r for r in page.tables["holders"][1:]}
    stray = holders[str(scene.stray)]
    assert stray[0] == "npu:1" and stray[2] == me
    assert stray[6] == "STRAY: no live lease on npu:1"
    covered = holders[str(scene.covered)]
    assert covered[0] == "npu:0" and covered[6] == f"{scene.lease} '{LABEL}'"
    assert "1 stray" in page.texts["holders-summary"]
    assert "per user" in page.texts["report"] and me in page.texts["report"]

    # The hostile label made no element and ran nothing: the only script is
    # the page's own, no image exists, and the title is the page's.
    assert dom.count("<script") == 1 and 'src="/app.js"' in dom
    assert "<img" not in dom and "<title>hold</title>" in dom
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dom


# --------------------------------------------------------------------------
# The documents, without a browser.


def _unstable(doc: dict[str, Any]) -> dict[str, Any]:
    """An audit document without what moves between two scans."""
    rows = sorted(
        ({k: v for k, v in r.items() if k not in ("age_s", "rss_bytes")} for r in doc["holders"]),
        key=lambda r: (r["device"], r["pid"]),
    )
    return {"holders": rows, "stray": doc["stray"], "version": doc["version"]}


def _still(doc: dict[str, Any]) -> dict[str, Any]:
    """A status document without the figures that move between two asks (each
    lease's usage: its keys stay)."""
    for info in doc["classes"].values():
        for dev in info["devices"]:
            usage = (dev.get("holder") or {}).get("usage")
            if isinstance(usage, dict):
                dev["holder"]["usage"] = sorted(usage)
            if "gpu" in dev:
                dev["gpu"] = sorted(dev["gpu"])
    return doc


def test_the_json_endpoints_are_the_commands_documents(scene: Scene, served: str) -> None:
    code, headers, body = get(served, "/status.json")
    assert code == 200 and headers["content-type"].startswith("application/json")
    assert _still(json.loads(body)) == _still(json.loads(hold("status", "--json")))
    code, _, body = get(served, "/audit.json")
    audit = json.loads(hold("audit", "--json"))
    assert code == 200 and _unstable(json.loads(body)) == _unstable(audit)
    assert {r["pid"] for r in audit["holders"]} >= {scene.covered, scene.stray}

    code, headers, body = get(served, "/")
    csp = headers["content-security-policy"]
    assert code == 200 and b'<script src="/app.js"' in body
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert "default-src 'none'" in csp and headers["x-content-type-options"] == "nosniff"


def test_read_only_and_this_machine_only(served: str) -> None:
    for method in ("POST", "DELETE", "PUT", "PATCH", "OPTIONS", "RELEASE"):
        code, headers, _ = get(served, "/status.json", method, body=b"lease=1")
        assert (code, headers.get("allow")) == (405, "GET, HEAD"), method
    code, headers, body = get(served, "/app.js", "HEAD")
    assert code == 200 and body == b"" and headers["content-type"].startswith("text/javascript")
    assert get(served, "/nothing")[0] == 404
    # Loopback: a request that names another host (DNS rebinding) gets nothing.
    assert get(served, "/status.json", host="attacker.example:8377")[0] == 421
    port = served.rsplit(":", 1)[1].rstrip("/")
    assert get(served, "/status.json", host=f"localhost:{port}")[0] == 200


def test_loopback_by_default_and_a_warning_for_any_other_address(tmp_path: Path) -> None:
    from hold.cli.group import cli

    assert cli.commands["web"].params[0].default == web.DEFAULT_LISTEN  # type: ignore[union-attr]
    assert web.parse_listen(web.DEFAULT_LISTEN) == web.Listen(
        "127.0.0.1", 8377, True, web.socket.AF_INET
    )
    assert web.parse_listen("[::1]:0").loopback and not web.parse_listen("0.0.0.0:80").loopback
    for bad in ("8080", "example.com:80", "127.0.0.1:99999", "127.0.0.1:"):
        with pytest.raises(web.BadValue):
            web.parse_listen(bad)
    res = subprocess.run(
        [*HOLD, "web", "--listen", "nowhere"], capture_output=True, text=True, timeout=30
    )
    assert res.returncode == 2 and "--listen 'nowhere' is not valid" in res.stderr

    err = tmp_path / "err"
    with err.open("wb") as f:
        argv = [*HOLD, "web", "--listen", "0.0.0.0:0"]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=f)
        try:
            assert proc.stdout is not None
            assert select.select([proc.stdout], [], [], 30)[0]
            assert b"serving http://0.0.0.0:" in proc.stdout.readline()
        finally:
            proc.terminate()
            proc.wait(10)
            assert proc.stdout is not None
            proc.stdout.close()
    warning = " ".join(err.read_text().split())
    assert "WARNING: 0.0.0.0:" in warning and "is not loopback" in warning
    for what in ("who holds which device", "private", "command line", "strays"):
        assert what in warning


# --------------------------------------------------------------------------
# hold report and hold metrics, and the page's live refresh.


def _samples(text: str) -> dict[str, str]:
    """Prometheus text: each sample's name and labels -> its value."""
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    return dict(ln.rsplit(" ", 1) for ln in lines)


def test_report_and_metrics_are_the_commands(scene: Scene, served: str) -> None:
    code, headers, body = get(served, "/metrics")
    assert code == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    page, cli = _samples(body.decode()), _samples(hold("metrics"))
    assert page.keys() == cli.keys()
    # What moves between the two reads: the lease's age and its processes' use
    # (its client wakes to renew it: CPU time 0.018 then 0.019 s, once).
    moving = (
        "hold_device_lease_age_seconds",
        "hold_audit_not_inspected_processes",
        "hold_lease_cpu_seconds_total",
        "hold_lease_memory_bytes",
    )
    assert {k: v for k, v in page.items() if not k.startswith(moving)} == {
        k: v for k, v in cli.items() if not k.startswith(moving)
    }
    assert page['hold_device_leased{class="npu",index="0"}'] == "1"
    assert page['hold_device_strays{class="npu",index="1"}'] == "1"

    code, _, body = get(served, "/report.json")
    doc, want = json.loads(body), json.loads(hold("report", "--json"))
    assert code == 200 and doc["version"] == want["version"] == 1
    for key in ("users", "devices"):  # the live lease's time grows between the two
        assert [(x.get("user"), x.get("device"), x["leases"]) for x in doc[key]] == [
            (x.get("user"), x.get("device"), x["leases"]) for x in want[key]
        ]


class FakeSources(web.Sources):
    def __init__(self) -> None:
        self.asked = 0

    def status(self) -> dict[str, Any]:
        self.asked += 1
        npu = {"devices": [{"index": 0, "holder": None}], "queue": []}
        return {"version": 1, "arbiter": None, "classes": {"npu": npu}}

    def audit(self) -> dict[str, Any]:
        return {
            "version": 1,
            "holders": [],
            "stray": 0,
            "not_inspected": 0,
            "processes": 9,
            "scan_seconds": 0.0,
        }

    def report(self) -> dict[str, Any]:
        user = {"user": "ann", "leases": 2, "leased_s": 3600, "labels": {"<b>x</b>": 60}}
        return {
            "version": 1,
            "since": None,
            "now": 1.8e9,
            "users": [user],
            "devices": [],
            "strays": [],
        }

    def metrics(self) -> str:
        return 'hold_device_leased{class="npu",index="0"} 0\n'


@pytest.fixture
def fake_server() -> Iterator[tuple[str, FakeSources]]:
    src = FakeSources()
    server = web.WebServer(web.parse_listen("127.0.0.1:0"), src)
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    t.start()
    try:
        yield server.url(), src
    finally:
        server.shutdown()
        server.server_close()
        t.join(10)


@needs_browser
def test_the_page_polls_and_shows_the_report(
    fake_server: tuple[str, FakeSources], tmp_path: Path
) -> None:
    url, src = fake_server
    dom = browse(url, tmp_path, "hold-web-report.png")
    page = Tables(dom)
    assert src.asked >= 2  # polled again within the 5 s of virtual time
    assert rows_with(page.tables["devices"], "npu:0")[0][1] == "free"
    report = " ".join(page.texts["report"].split())
    assert "from the start to" in report and "per user" in report
    assert "LEASED" in report and "ann" in report and "1h 00m" in report
    assert "<b>x</b> 1m 00s" in report and "<b>" not in dom  # a label, as text
