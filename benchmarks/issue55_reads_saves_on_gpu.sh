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
profile() {  # NAME LIMIT_S GPUDIAG_OPTIONS... -- COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" python3 -m gpudiag profile --no-plots --out "$out/$name" "$@" \
    > "$out/$name.txt" 2>&1
  echo "$name exit $? in $((SECONDS - start)) s" | tee -a "$out/exits.txt"
}
: > "$out/exits.txt"
profile step_reads 60 -- python3 examples/step_reads.py
timeout 120 python3 benchmarks/knobs_ab.py --cases reads --pairs 3 --out "$out/reads_ab.json" \
  > "$out/reads_ab.txt" 2>&1
profile blocking_save 40 -- python3 examples/blocking_save.py
profile hf_trainer 70 -- python3 examples/hf_trainer.py
python3 - "$out" <<'PY' > "$out/summary.txt"
import sys
from pathlib import Path
from gpudiag.model.runfile import load_run
out = Path(sys.argv[1])
print((out / "exits.txt").read_text())
for folder in sorted(p for p in out.iterdir() if (p / "run.json").is_file()):
    run = load_run(folder)
    print(f"== {folder.name}")
    for f in run.findings:
        share = f" {f.account.share:.0%}" if f.account is not None else f" {f.impact:.0%}"
        print(f"   {f.id} {f.severity} {f.location}{share}: {f.title}")
    for stage in run.stages:
        timeline = stage.facts.script.timeline if stage.facts.script else None
        for save in (timeline.saves if timeline else [])[:2]:
            print(f"   save at step {save.step}: {save.blocking_ms:.1f} ms from "
                  f"{save.stack[:12]}")
PY
cat "$out/reads_ab.txt" "$out/summary.txt"
