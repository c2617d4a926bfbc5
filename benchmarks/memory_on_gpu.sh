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
profile() {  # NAME LIMIT_S GPUDIAG_OPTIONS... -- COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" python3 -m gpudiag profile --out "$out/$name" "$@" > "$out/$name.txt" 2>&1
  echo "$name exit $? in $((SECONDS - start)) s" | tee -a "$out/exits.txt"
}
: > "$out/exits.txt"
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
python3 - "$out" <<'PY' > "$out/summary.txt"
import sys
from pathlib import Path
from gpudiag.model.runfile import load_run
out = Path(sys.argv[1])
print((out / "exits.txt").read_text())
print((out / "watch_cost.txt").read_text())
for folder in sorted(p for p in out.iterdir() if (p / "run.json").is_file()):
    run = load_run(folder)
    print(f"== {folder.name}")
    for f in run.findings:
        print(f"   {f.id} {f.severity} {f.location} {f.impact:.0%}: {f.title}")
        if f.id in ("GD403", "GD404"):
            print(f"      fix: {f.fix}")
    for stage in run.stages:
        owners = stage.facts.script.owners if stage.facts.script else None
        if owners is not None:
            print(f"   owners: {owners}")
    for fix in run.fixes:
        print(f"   fix {fix.remedy}: {fix.status} {fix.speedup} ({fix.speedup_low}-"
              f"{fix.speedup_high}) {fix.equivalence}; {fix.note}")
    for stage in run.stages:
        m = stage.facts.script.memory if stage.facts.script else None
        if m is not None:
            print(f"   memory {m.device}: allocated {m.allocated_mib[:3]} .. {m.allocated_mib[-3:]}; "
                  f"reserved max {max(m.reserved_mib or [0])}; peak {max(m.peak_mib or [0])}; "
                  f"total {m.device_total_mib}; retries {m.alloc_retries}; steps {len(m.resident_mib)}")
        if stage.memory is not None:
            print(f"   stage memory: {stage.memory}")
PY
cat "$out/summary.txt"
