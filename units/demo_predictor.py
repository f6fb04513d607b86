"""Demo "predictor": connects to the model server, then prints READY.

Usage: demo_predictor.py --model-url http://127.0.0.1:PORT

Asks the model's /health until it answers 200 (for up to 10 s), prints
READY, then asks /predict once a second. SIGTERM ends it. Standard library only.
"""

import argparse
import signal
import sys
import time
import urllib.request

parser = argparse.ArgumentParser()
parser.add_argument("--model-url", required=True)
args = parser.parse_args()
running = True


def stop(signum: int, frame: object) -> None:
    global running
    running = False


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
    if time.monotonic() > deadline or not running:
        print("predictor: the model server did not answer", flush=True)
        sys.exit(1)
    time.sleep(0.05)
print("predictor: READY", flush=True)
n = 0
while running:
    time.sleep(1)
    if running:
        n += 1
        status, body = get("/predict")
        print(f"predictor: request {n}: {status} {body.decode(errors='replace')}", flush=True)
print("predictor: stopped", flush=True)
