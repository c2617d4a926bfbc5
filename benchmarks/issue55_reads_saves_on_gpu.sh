#!/usr/bin/env bash
# Issue 55 on a GPU, the second call: the reads of a small host-bound step named, and saves
# that record their callers.
#   step_reads: GD103 at the logging line although the step reads only twice (below the
#     count), priced against the plain A/B with the script's own timer (benchmarks/knobs_ab.py
#     --cases reads: reading every step against every 50 steps, ABBA);
#   blocking_save, hf_trainer: each save recorded with the lines that called it, a saving
#     step's extra kept with the save exactly when the line holding it ran the save.
# Run from the project root on a GPU machine; writes under $1 (default reports/issue55-reads).
set -uo pipefail
out=${1:-reports/issue55-reads}
mkdir -p "$out"
. benchmarks/profile_on_gpu.sh  # profile NAME LIMIT_S OPTIONS... -- COMMAND...
profile step_reads 60 --no-plots -- python3 examples/step_reads.py
timeout 120 python3 benchmarks/knobs_ab.py --cases reads --pairs 3 --out "$out/reads_ab.json" \
  > "$out/reads_ab.txt" 2>&1
profile blocking_save 40 --no-plots -- python3 examples/blocking_save.py
profile hf_trainer 70 --no-plots -- python3 examples/hf_trainer.py
python3 benchmarks/gpu_summary.py "$out" > "$out/summary.txt"
cat "$out/reads_ab.txt" "$out/summary.txt"
