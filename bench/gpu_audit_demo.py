"""On a machine with an NVIDIA GPU: what ``hold audit`` prints for a real CUDA
process outside any ticket and one inside ``gpu-hold``, beside what the driver
says (nvidia-smi). Every step has a deadline; everything started is stopped.

Run from the repository root with a Python that has torch and this package's
dependencies: ``python3 bench/gpu_audit_demo.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOG = str(ROOT / "tests" / "progs" / "cuda_hog.py")
PY = sys.executable


def show(argv: list[str]) -> None:
    print("$ " + " ".join(argv), flush=True)
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    print(res.stdout + res.stderr + f"(exit status {res.returncode})\n", flush=True)


def start(argv: list[str]) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    return p, p.stdout.readline().strip()


def main() -> None:
    os.environ.setdefault("HOLD_STATE_DIR", tempfile.mkdtemp() + "/state")
    hold = [PY, "-m", "hold"]
    outside, said_out = start([PY, HOG, "768"])
    inside, said_in = start(
        [
            *hold,
            "run",
            "--device",
            "gpu",
            "-l",
            "demo inside",
            "--pass-env",
            "LD_LIBRARY_PATH",
            "--",
            PY,
            HOG,
            "1536",
        ]
    )
    try:
        print(f"outside any ticket: {said_out}; inside gpu-hold: {said_in}\n", flush=True)
        show(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv"])
        show([*hold, "audit", "--device", "gpu"])
        show([*hold, "status"])
    finally:
        for p in (outside, inside):
            assert p.stdin is not None
            p.stdin.close()
            p.wait(timeout=60)
    show([*hold, "audit", "--device", "gpu"])
    lock = Path(os.environ["HOLD_STATE_DIR"]) / "daemon.lock"
    if lock.exists():
        subprocess.run(["kill", lock.read_text().strip()], check=False)


if __name__ == "__main__":
    main()
