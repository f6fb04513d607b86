#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: what `hold audit` prints for a real CUDA
# process outside any ticket and one inside `gpu-hold`, next to what the
# driver (nvidia-smi / NVML) says. Run from the repository root with a Python
# that has torch and this package's dependencies on its path.
set -u
PY=${PY:-python3}
export HOLD_STATE_DIR=${HOLD_STATE_DIR:-$(mktemp -d)/state}
cd "$(dirname "$0")/.."
work=$(mktemp -d)
mkfifo "$work/out.in" "$work/in.in"
"$PY" tests/progs/cuda_hog.py 768 < "$work/out.in" > "$work/out.out" & exec 7>"$work/out.in"
"$PY" -m hold run --device gpu -l "demo inside" --pass-env LD_LIBRARY_PATH -- \
  "$PY" tests/progs/cuda_hog.py 1536 < "$work/in.in" > "$work/in.out" & exec 8>"$work/in.in"
for f in out in; do for _ in $(seq 600); do grep -q ready "$work/$f.out" 2>/dev/null && break; sleep 0.1; done; done
echo "outside: $(cat "$work/out.out")   inside (under gpu-hold): $(cat "$work/in.out")"
echo '$ nvidia-smi --query-compute-apps=pid,used_memory --format=csv'
nvidia-smi --query-compute-apps=pid,used_memory --format=csv
echo '$ hold audit --device gpu'
"$PY" -m hold audit --device gpu; echo "exit status: $?"
echo '$ hold status'
"$PY" -m hold status
exec 7>&- 8>&-
wait
"$PY" -m hold audit --device gpu; echo "after both ended, exit status: $?"
kill "$(cat "$HOLD_STATE_DIR/daemon.lock")" 2>/dev/null
