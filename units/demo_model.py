"""Demo "model server": HTTP with /health, healthy after a short load time.

Usage: demo_model.py --port PORT [--load-time SECONDS]

/health answers 503 while the "model" loads, then 200; /predict answers a
small JSON document. SIGTERM ends it cleanly. Standard library only.
"""

import argparse
import json
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--load-time", type=float, default=0.5)
args = parser.parse_args()
loaded = threading.Event()


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/health":
            code, body = (
                (200, {"status": "ok"}) if loaded.is_set() else (503, {"status": "loading"})
            )
        elif self.path.startswith("/predict") and loaded.is_set():
            code, body = 200, {"tokens": ["hello", "world"]}
        else:
            code, body = 404, {"error": "not found"}
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, fmt: str, *a: object) -> None:
        print(f"model: {self.address_string()} {fmt % a}", flush=True)


server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)


class Stop(Exception):
    """Raised by the signal handler to leave serve_forever() at once."""


def stop(signum: int, frame: object) -> None:
    print(f"model: signal {signum}, shutting down", flush=True)
    # Raise rather than call server.shutdown(): shutdown only sets a flag that
    # serve_forever() reads between two polls of its socket, every 0.5 s (its
    # poll_interval; the select() the signal interrupted is resumed, PEP 475),
    # so each stop took up to half a second. The handler runs in the main
    # thread, inside serve_forever(), so the exception ends it now.
    raise Stop


print(
    f"model: listening on 127.0.0.1:{args.port}, loading weights ({args.load_time:g}s)", flush=True
)


def load() -> None:
    time.sleep(args.load_time)
    loaded.set()
    print("model: loaded, healthy", flush=True)


threading.Thread(target=load, daemon=True).start()
# Only now: a Stop raised before the try would end with a traceback.
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
try:
    server.serve_forever()
except Stop:
    pass
server.server_close()
print("model: stopped", flush=True)
sys.exit(0)
