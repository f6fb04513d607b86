"""Hold GPU memory like a model server would: allocate MiB on the GPU, say so, wait.

Usage: cuda_hog.py MIB [DEVICE_INDEX]. Prints "ready <pid>" once the memory is
allocated and stays until killed (or until stdin reaches end of file).
"""

import os
import sys

import torch

mib = int(sys.argv[1])
index = int(sys.argv[2]) if len(sys.argv) > 2 else 0
block = torch.empty(mib * 1024 * 1024, dtype=torch.uint8, device=f"cuda:{index}")
block.fill_(1)
torch.cuda.synchronize()
print(f"ready {os.getpid()}", flush=True)
sys.stdin.read()
