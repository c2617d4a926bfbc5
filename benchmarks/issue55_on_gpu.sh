#!/usr/bin/env bash
# Issue 55 (right for the right reason) on a GPU, one call: the knobs it added proven by
# --try-fixes and by the scripts' own timers, and the scripts whose findings it corrected.
#   cnn_layout: GD306 at the model's line, channels-last measured (--try-fixes), and the plain
#     A/B with the script's timer (benchmarks/knobs_ab.py --cases layout);
#   debug_left_on: GD107 at set_detect_anomaly's line, no-debug measured;
#   fp32_no_tf32 (a GPU-bound step), blocking_save, hf_trainer: no periodic work from a full
#     launch queue or gpudiag's own steps, a save priced whole.
# Each profile has a time limit, so the call ends inside the device's 10 minutes.
# Run from the project root on a GPU machine; writes under $1 (default reports/issue55).
set -uo pipefail
out=${1:-reports/issue55}
mkdir -p "$out"
. benchmarks/profile_on_gpu.sh  # profile NAME LIMIT_S OPTIONS... -- COMMAND...
profile cnn_layout 240 --no-plots --try-fixes --fix channels-last -- python3 examples/cnn_layout.py
timeout 60 python3 benchmarks/knobs_ab.py --cases layout --pairs 2 --out "$out/layout_ab.json" \
  > "$out/layout_ab.txt" 2>&1
profile debug_left_on 100 --no-plots --try-fixes --fix no-debug -- python3 examples/debug_left_on.py
profile fp32_no_tf32 50 --no-plots -- python3 examples/fp32_no_tf32.py
profile blocking_save 40 --no-plots -- python3 examples/blocking_save.py
profile hf_trainer 70 --no-plots -- python3 examples/hf_trainer.py
python3 benchmarks/gpu_summary.py "$out" > "$out/summary.txt"
cat "$out/layout_ab.txt" "$out/summary.txt"
