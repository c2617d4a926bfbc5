#!/usr/bin/env bash
# Issue 57's memory knobs on a GPU, one call: activation checkpointing measured by a plain timer
# (benchmarks/checkpointing_ab.py: checkpointed and not, ABAB, the allocator's own peaks), then
# by `gpudiag profile --try-fixes` on the same script capped twice from those peaks: below the
# plain peak (out of memory: GD404) and just above it (near capacity: GD401); a larger batch
# tried on a launch-bound small-batch script (examples/small_batch.py: GD104/GD102); and what
# reading each step's memory costs a small step (benchmarks/memory_watch_overhead.py).
# Run from the project root on a GPU machine; writes under $1 (default reports/memory-fixes).
set -uo pipefail
out=${1:-reports/memory-fixes}
mkdir -p "$out"
. benchmarks/profile_on_gpu.sh  # profile NAME LIMIT_S OPTIONS... -- COMMAND...
timeout 120 python3 benchmarks/checkpointing_ab.py > "$out/checkpointing_ab.json"
read -r oom_cap near_cap < <(python3 - "$out/checkpointing_ab.json" <<'PY'
import json, sys
ab = json.load(open(sys.argv[1]))
plain = ab["peak_reserved_mib"]["plain"] / 1024
checkpointed = ab["peak_reserved_mib"]["checkpointed"] / 1024
# Out of memory: a cap the checkpointed step fits in with room, the plain one does not.
oom = min(plain * 0.8, max(checkpointed * 1.5, checkpointed + 2))
print(f"{oom:.2f} {plain / 0.93:.2f}")
PY
)
echo "caps: out of memory ${oom_cap} GiB, near capacity ${near_cap} GiB" | tee "$out/caps.txt"
MEM_CAP_GIB=$oom_cap profile deep_activations_oom 150 --try-fixes --warmup 3 --timed 12 --steps 2 -- \
  python3 examples/deep_activations.py
MEM_CAP_GIB=$near_cap profile deep_activations_near 150 --try-fixes --warmup 3 --timed 12 --steps 2 -- \
  python3 examples/deep_activations.py
profile small_batch 170 --try-fixes -- python3 examples/small_batch.py
timeout 60 python3 benchmarks/memory_watch_overhead.py > "$out/memory_watch_overhead.json"
python3 benchmarks/gpu_summary.py "$out" > "$out/summary.txt"
cat "$out/caps.txt" "$out/exits.txt" "$out/summary.txt"
python3 -c "
import json
for name in ('checkpointing_ab', 'memory_watch_overhead'):
    d = json.load(open('$out/' + name + '.json')); d.pop('samples_ms', None); print(name, d)"
