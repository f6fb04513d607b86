"""A unit for the stack tests: records what happens to it, and becomes ready on demand.

Usage: stack_unit.py DIR NAME [options]

Appends "start NAME PID TIME" to DIR/events when it starts and "stop NAME PID
TIME" when it gets SIGTERM/SIGINT (then exits 0, unless --ignore-term), and
"NAME PID" to DIR/pids for itself and every process it starts.

  --delay S          wait S seconds before becoming ready (default 0)
  --http PORT        then serve HTTP: /health answers 200
  --tcp PORT         then listen on TCP PORT
  --say TEXT         then print TEXT
  --touch PATH       then create PATH
  --exit N           then exit with status N (printing a last line first)
  --crash-after S    once ready, exit 3 after S seconds (appending "crash NAME PID TIME")
  --ignore-term      ignore SIGTERM and SIGINT
  --escapee          start a setsid double-forked escapee that ignores TERM and
                     INT and holds DIR/device open
"""

import os
import signal
import socket
import sys
import threading
import time

base, name = sys.argv[1], sys.argv[2]
opts = sys.argv[3:]


def opt(flag: str) -> str | None:
    return opts[opts.index(flag) + 1] if flag in opts else None


def append(fname: str, text: str) -> None:
    fd = os.open(os.path.join(base, fname), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    os.write(fd, (text + "\n").encode())
    os.close(fd)


def on_stop(signum: int, frame: object) -> None:
    append("events", f"stop {name} {os.getpid()} {time.time():.3f}")
    os._exit(0)


append("events", f"start {name} {os.getpid()} {time.time():.3f}")
append("pids", f"{name} {os.getpid()}")
if "--ignore-term" in opts:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)

if "--escapee" in opts:
    if os.fork() == 0:
        os.setsid()
        if os.fork() > 0:
            os._exit(0)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        fd = os.open(os.path.join(base, "device"), os.O_RDWR | os.O_CREAT, 0o666)
        append("pids", f"{name}-escapee {os.getpid()}")
        while True:
            time.sleep(1)
    os.wait()

print(f"{name}: starting", flush=True)
time.sleep(float(opt("--delay") or 0))

if opt("--exit") is not None:
    print(f"{name}: giving up now", flush=True)
    sys.exit(int(opt("--exit") or 0))

if opt("--http") is not None:
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class H(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a: object) -> None:
            pass

    srv = HTTPServer(("127.0.0.1", int(opt("--http") or 0)), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
if opt("--tcp") is not None:
    lsock = socket.socket()
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(("127.0.0.1", int(opt("--tcp") or 0)))
    lsock.listen()
if opt("--touch") is not None:
    open(opt("--touch") or "", "w").close()
if opt("--say") is not None:
    print(opt("--say"), flush=True)

if opt("--crash-after") is not None:
    time.sleep(float(opt("--crash-after") or 0))
    print(f"{name}: crashing", flush=True)
    append("events", f"crash {name} {os.getpid()} {time.time():.3f}")
    sys.exit(3)
while True:
    time.sleep(1)
