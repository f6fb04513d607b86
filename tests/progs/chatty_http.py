"""A server that logs a line every millisecond and is healthy only after DELAY s.

Usage: chatty_http.py PORT DELAY COUNT_FILE

Counts the readiness probes it receives (GET, any path) and writes the count
to COUNT_FILE when it first answers 200: how often it was asked while it
printed, which a probe woken by every output line would make thousands.
"""

import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

port, delay, out = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
start = time.monotonic()
asked = [0]


class Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        asked[0] += 1
        ok = time.monotonic() - start >= delay
        self.send_response(200 if ok else 503)
        self.end_headers()
        if ok:
            with open(out + ".tmp", "w") as f:
                f.write(str(asked[0]))
            os.replace(out + ".tmp", out)

    def log_message(self, *args: object) -> None:
        pass


server = ThreadingHTTPServer(("127.0.0.1", port), Health)
threading.Thread(target=server.serve_forever, daemon=True).start()
while True:
    print(f"served a request at {time.monotonic() - start:.3f}", flush=True)
    time.sleep(0.001)
