"""Demo "executor": a TCP service that runs (here: echoes) what it is sent.

Usage: demo_executor.py --port PORT

SIGTERM ends it. Standard library only.
"""

import argparse
import signal
import socketserver
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, required=True)
args = parser.parse_args()


class Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        for line in self.rfile:
            self.wfile.write(b"ran: " + line)


server = socketserver.ThreadingTCPServer(("127.0.0.1", args.port), Handler)
server.daemon_threads = True


class Stop(Exception):
    """Raised by the signal handler to leave serve_forever() at once."""


def stop(signum: int, frame: object) -> None:
    print(f"executor: signal {signum}, shutting down", flush=True)
    # Raise rather than call server.shutdown(): shutdown only sets a flag that
    # serve_forever() reads between two polls of its socket, every 0.5 s (its
    # poll_interval; the select() the signal interrupted is resumed, PEP 475),
    # so each stop took up to half a second. The handler runs in the main
    # thread, inside serve_forever(), so the exception ends it now.
    raise Stop


print(f"executor: listening on 127.0.0.1:{args.port}", flush=True)
# Only now: a Stop raised before the try would end with a traceback.
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
try:
    server.serve_forever()
except Stop:
    pass
server.server_close()
print("executor: stopped", flush=True)
sys.exit(0)
