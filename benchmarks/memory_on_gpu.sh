#!/usr/bin/env bash
# Issue 57 on a GPU, one call: the memory timeline, its owners and growth (GD403, named at the
# line that keeps the tensors) on examples/kept_logits.py keeping every step's logits (131 MB a
# step), keeping a slice, and capped at 4 GiB so that it dies of out-of-memory (GD404); and
# the cost of reading each step's memory (the watch's step_ended, timed in a loop). With a
# second argument `allocator`: examples/growing_lengths.py (GD405), expandable segments
# measured by --try-fixes, instead of the kept_logits runs.
# Run from the project root on a GPU machine; writes under $1 (default reports/memory).
set -uo pipefail
out=${1:-reports/memory}
mkdir -p "$out"
. benchmarks/profile_on_gpu.sh  # profile NAME LIMIT_S OPTIONS... -- COMMAND...
if [ "${2:-}" = allocator ]; then
  profile growing_lengths 240 --try-fixes --fix expandable-segments -- \
    python3 examples/growing_lengths.py
else
  profile kept_logits 90 -- python3 examples/kept_logits.py
  KEEP=slice profile kept_slice 90 -- python3 examples/kept_logits.py
  MEM_CAP_GIB=4 profile kept_logits_capped 90 -- python3 examples/kept_logits.py
fi
python3 - > "$out/watch_cost.txt" <<'PY'
import time, torch
from gpudiag.measure.profile.inscript.watches.memory import MemoryWatch
class Clock:
    steps, host_marks = 0, (0.0,)
kept = [torch.empty(2**20, device="cuda") for _ in range(100)]
watch = MemoryWatch(Clock())
for _ in range(100):
    watch.step_ended()
samples = []
for _ in range(20):
    watch.resident.clear(); watch.allocated.clear(); watch.reserved.clear(); watch.peak.clear()
    start = time.perf_counter()
    for _ in range(1000):
        watch.step_ended()
    samples.append((time.perf_counter() - start) / 1000 * 1e6)
samples.sort()
print(f"step_ended on CUDA: median {samples[10]:.2f} us, min {samples[0]:.2f}, max {samples[-1]:.2f} (20 x 1000 calls)")
PY
python3 benchmarks/gpu_summary.py "$out" > "$out/summary.txt"
cat "$out/watch_cost.txt" "$out/summary.txt"
