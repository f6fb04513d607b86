"""Demo "predictor": connects to the model server, then prints READY.

Usage: demo_predictor.py --model-url http://127.0.0.1:PORT

Asks the model's /health until it answers 200 (for up to 10 s), prints
READY, then asks /predict once a second. SIGTERM ends it. Standard library only.
"""

import argparse
import signal
import sys
import threading
import time
import urllib.request

parser = argparse.ArgumentParser()
parser.add_argument("--model-url", required=True)
args = parser.parse_args()
# Set by SIGTERM/SIGINT. An Event rather than a flag and time.sleep(1): the
# sleep a signal interrupts is resumed for the rest of its second (PEP 475),
# so a stop took up to a second; the Event's wait returns at once.
stopping = threading.Event()


def stop(signum: int, frame: object) -> None:
    stopping.set()


signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)


def get(path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(args.model_url + path, timeout=1) as r:
            return r.status, r.read()
    except OSError as e:
        return getattr(e, "code", 0) or 0, str(e).encode()


print(f"predictor: connecting to {args.model_url}", flush=True)
deadline = time.monotonic() + 10
while get("/health")[0] != 200:
    if time.monotonic() > deadline or stopping.is_set():
        print("predictor: the model server did not answer", flush=True)
        sys.exit(1)
    stopping.wait(0.05)
print("predictor: READY", flush=True)
n = 0
while not stopping.wait(1):
    n += 1
    status, body = get("/predict")
    print(f"predictor: request {n}: {status} {body.decode(errors='replace')}", flush=True)
print("predictor: stopped", flush=True)
