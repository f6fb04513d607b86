"""``hold web``: a read-only status page (devices, holders, queue, strays), live.

Loaded only by ``hold web`` (``http.server`` is on no other command's path).
The standard library's threaded server is enough: a handful of viewers polling
small JSON documents, each computed at most once per :data:`FRESH_S` however
many ask. Read-only by construction: GET and HEAD only (anything else 405),
and no route acts; the documents are the commands' own (``/status.json`` is
``hold status --json``, made by :func:`hold.views.status.status_document`;
``/audit.json`` is ``hold audit --json`` without ``--kill``; ``/report.json``
is ``hold report --json``; ``/metrics`` is ``hold metrics``).

The page's HTML, JS and CSS are files in ``hold/webpage/`` (package data),
served from their own paths so that the Content-Security-Policy forbids every
inline script: the data (labels, commands: user-controlled) reaches the DOM
through ``textContent`` only.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.resources import files
from typing import Any, NamedTuple

from hold.client.connection import Client, DaemonUnreachable
from hold.config import load
from hold.devices.classes import DeviceClass
from hold.errors import HoldError
from hold.protocol import Op, ProtocolError
from hold.statedir import StateDir
from hold.views.audit import build_report
from hold.views.metrics import render
from hold.views.report import fetch
from hold.views.status import status_document, with_gpu
from hold_supervisor.exitcodes import USAGE
from hold_supervisor.parse import BadValue

DEFAULT_LISTEN = "127.0.0.1:8377"
FRESH_S = 1.0  # a document is recomputed at most this often (the audit scans /proc)
REPORT_FRESH_S = 10.0  # the report reads the whole history
BODY_MAX = 65536  # a refused request's body read before the answer, at most
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Cache-Control": "no-store",
}
ASSETS = {  # path -> (file in hold/webpage, content type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/app.css": ("app.css", "text/css; charset=utf-8"),
}
JSON_TYPE = "application/json; charset=utf-8"
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text format


class Listen(NamedTuple):
    host: str
    port: int
    loopback: bool
    family: socket.AddressFamily


def parse_listen(text: str) -> Listen:
    """``ADDRESS:PORT`` (``[::1]:8080`` for IPv6; ``localhost`` is 127.0.0.1)."""
    host, sep, port = text.rpartition(":")
    accepted = "ADDRESS:PORT with an IP address (or localhost) and a port 0-65535"
    if not sep or not port.isdigit() or int(port) > 65535:
        raise BadValue("--listen", text, accepted)
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    host = "127.0.0.1" if host == "localhost" else host
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise BadValue("--listen", text, accepted) from None
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    return Listen(str(ip), int(port), ip.is_loopback, family)


def exposure_warning(where: Listen, euid: int) -> str:
    """What anyone who can reach a non-loopback address sees: said before serving."""
    labels = (
        "every label, private ones too (root sees them)"
        if euid == 0
        else "lease labels (not private ones)"
    )
    return (
        f"hold web: WARNING: {where.host}:{where.port} is not loopback: anyone who can "
        "reach it, without a login, sees who holds which device (user, pid, lease, "
        f"since, until), {labels}, who waits in line, and the pid, user and command "
        "line of every process holding a device node (strays too). The page acts on "
        "nothing (GET only)."
    )


# ------------------------------------------------------------------ the documents


class Unavailable(HoldError):
    """A document cannot be had now (no daemon answers): a 503 with this message."""


class _Fresh:
    """One value, recomputed at most every ``ttl`` seconds; concurrent askers wait
    for the one computation (so N viewers cost one scan)."""

    def __init__(self, make: Callable[[], Any], ttl: float = FRESH_S) -> None:
        self.make, self.ttl = make, ttl
        self.lock = threading.Lock()
        self.at = -ttl - 1.0
        self.value: Any = None

    def get(self) -> Any:
        with self.lock:
            if time.monotonic() - self.at >= self.ttl:
                self.value = self.make()
                self.at = time.monotonic()
            return self.value


class Sources:
    """Where the page's documents come from, each the command's own (a test swaps
    in its own Sources)."""

    def __init__(
        self, sd: StateDir, classes: dict[str, DeviceClass], report_labels: bool = False
    ) -> None:
        self.sd, self.classes, self.report_labels = sd, classes, report_labels
        self._answer = _Fresh(self._ask_status)  # the daemon's status answer, whole
        self._audit = _Fresh(self._scan)
        self._report = _Fresh(self._ask_report, REPORT_FRESH_S)

    def status(self) -> dict[str, Any]:
        """``hold status --json``'s document."""
        return status_document(self._answer.get())

    def audit(self) -> dict[str, Any]:
        """``hold audit --json``'s document (every class; nothing killed)."""
        doc: dict[str, Any] = self._audit.get()
        return doc

    def report(self) -> dict[str, Any]:
        """``hold report --json``'s document (the whole history)."""
        doc: dict[str, Any] = self._report.get()
        return doc

    def metrics(self) -> str:
        """``hold metrics``' text: its renderer, over the same status and audit."""
        return render({"status": self._answer.get(), "audit": self.audit()})

    def _ask_status(self) -> dict[str, Any]:
        try:  # never starts a daemon: a page left open must not keep one alive
            client = Client.connect(self.sd, autostart=False)
        except DaemonUnreachable as e:
            raise Unavailable(f"{e} (the page starts none)") from None
        try:
            ans: dict[str, Any] = client.request({"op": Op.STATUS})
        except (DaemonUnreachable, OSError, ProtocolError, TimeoutError) as e:
            raise Unavailable(f"the daemon did not answer: {e}") from None
        finally:
            client.close()

        return with_gpu(ans)

    def _scan(self) -> dict[str, Any]:
        return build_report(self.sd, self.classes, None)

    def _ask_report(self) -> dict[str, Any]:
        try:
            return fetch(self.sd, 0.0, self.report_labels)
        except HoldError as e:
            raise Unavailable(str(e)) from None


# ------------------------------------------------------------------ the server


class WebServer(ThreadingHTTPServer):
    daemon_threads = True  # a viewer's open connection never holds up the exit

    def __init__(self, where: Listen, sources: Sources) -> None:
        self.address_family = where.family
        self.where, self.sources = where, sources
        super().__init__((where.host, where.port), Handler)
        self.port = int(self.server_address[1])
        # Loopback: only requests naming this machine, or none (a DNS-rebinding
        # page elsewhere names its own host, and gets nothing).
        self.hosts = {f"{h}:{self.port}" for h in ("127.0.0.1", "localhost", "[::1]")}
        self.hosts |= {f"{h}:{self.port}" for h in (where.host, f"[{where.host}]")} | {""}

    def url(self) -> str:
        host = f"[{self.where.host}]" if self.where.family == socket.AF_INET6 else self.where.host
        return f"http://{host}:{self.port}/"


class Handler(BaseHTTPRequestHandler):
    server: WebServer

    def version_string(self) -> str:
        return "hold-web"  # the Python version is nobody's business

    def parse_request(self) -> bool:
        """Refuse, before any dispatch, every method but GET and HEAD, and (on
        loopback) a Host that is not this machine."""
        if not super().parse_request():
            return False
        if self.command not in ("GET", "HEAD"):
            self._drain()
            self._send(
                405, b"read-only: GET only\n", "text/plain; charset=utf-8", {"Allow": "GET, HEAD"}
            )
            return False
        host = self.headers.get("Host", "")
        if self.server.where.loopback and host.lower() not in self.server.hosts:
            self._send(
                421,
                b"this page answers requests for this machine only\n",
                "text/plain; charset=utf-8",
            )
            return False
        return True

    def do_GET(self) -> None:
        self._route()

    def do_HEAD(self) -> None:
        self._route()

    def _route(self) -> None:
        path = self.path.split("?", 1)[0]
        src = self.server.sources
        try:
            if path in ASSETS:
                name, ctype = ASSETS[path]
                self._send(200, files("hold").joinpath("webpage", name).read_bytes(), ctype)
            elif path in ("/status.json", "/audit.json", "/report.json"):
                doc = {
                    "/status.json": src.status,
                    "/audit.json": src.audit,
                    "/report.json": src.report,
                }[path]()
                self._json(200, doc)
            elif path == "/metrics":
                self._send(200, src.metrics().encode(), METRICS_TYPE)
            else:
                self._send(404, b"not found\n", "text/plain; charset=utf-8")
        except Unavailable as e:
            self._json(503, {"error": str(e)})
        except Exception as e:  # a viewer gets a short answer; the console the whole error
            self.log_error("%s: %r", path, e)
            self._json(500, {"error": f"{type(e).__name__} (see hold web's console)"})

    def _json(self, code: int, doc: dict[str, Any]) -> None:
        self._send(code, json.dumps(doc, sort_keys=True).encode(), JSON_TYPE)

    def _send(
        self, code: int, body: bytes, ctype: str, extra: dict[str, str] | None = None
    ) -> None:
        self.send_response(code)
        for k, v in {**HEADERS, "Content-Type": ctype, **(extra or {})}.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _drain(self) -> None:
        """Read a refused request's body (bounded): closing on unread data would
        reset the connection before the client reads the 405."""
        try:
            n = min(int(self.headers.get("Content-Length") or 0), BODY_MAX)
        except ValueError:
            return
        if n > 0:
            self.rfile.read(n)

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass  # a poll every two seconds per viewer: no access log

    def log_message(self, format: str, *args: Any) -> None:
        sys.stderr.write(f"hold web: {self.address_string()}: {format % args}\n")


# ------------------------------------------------------------------ the command


def main_web(sd: StateDir, classes: dict[str, DeviceClass], listen: str) -> int:
    """Serve until interrupted; the exit status (2: a bad or busy address)."""
    try:
        where = parse_listen(listen)
    except BadValue as e:
        print(f"hold web: {e}", file=sys.stderr)
        return USAGE
    _start_daemon(sd)
    try:
        server = WebServer(where, Sources(sd, classes, _report_labels()))
    except OSError as e:
        print(f"hold web: cannot listen on {listen}: {e.strerror or e}", file=sys.stderr)
        return USAGE
    if not where.loopback:
        print(exposure_warning(where, os.geteuid()), file=sys.stderr)
    print(f"hold web: serving {server.url()} (read-only; Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _report_labels() -> bool:
    """The configuration's ``report: {labels: ...}`` (``hold report`` reads it too)."""
    return load().report_labels  # read once already by the command: it is good


def _start_daemon(sd: StateDir) -> None:
    """As ``hold status`` does: a daemon serving when the page opens (a client
    starts one where none serves). If that fails, the page says so and serves."""
    try:
        Client.connect(sd).close()
    except DaemonUnreachable as e:
        print(f"hold web: {e}", file=sys.stderr)
