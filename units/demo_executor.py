"""Demo "executor": a TCP service that runs (here: echoes) what it is sent.

Usage: demo_executor.py --port PORT

SIGTERM ends it. Standard library only.
"""

import argparse
import signal
import socketserver
import sys
import threading

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, required=True)
args = parser.parse_args()


class Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        for line in self.rfile:
            self.wfile.write(b"ran: " + line)


server = socketserver.ThreadingTCPServer(("127.0.0.1", args.port), Handler)
server.daemon_threads = True


def stop(signum: int, frame: object) -> None:
    print(f"executor: signal {signum}, shutting down", flush=True)
    threading.Thread(target=server.shutdown).start()


signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
print(f"executor: listening on 127.0.0.1:{args.port}", flush=True)
server.serve_forever()
server.server_close()
print("executor: stopped", flush=True)
sys.exit(0)
