#!/usr/bin/env bash
# The in-script watches (gpudiag/measure/profile/inscript/watches/: one module per framework)
# on a GPU: `gpudiag profile` of one example script per watch, each planting the problem its
# watch exists to name, so a watch that lost a fact on CUDA shows as a finding missing or moved.
#   optimizers: per_tensor_optimizer (GD106 at AdamW(...)); loaders: loader_restarts (GD204 at
#   DataLoader(...)); saves: blocking_save (GD701 at torch.save); compiled: compile_shapes (GD9xx);
#   ddp and fsdp: tiny_ddp and tiny_fsdp2 under torchrun, one rank (NCCL on one GPU);
#   a framework's loop: hf_trainer; and python_loop, item_sync (no watch: the recorder alone).
# Run from the project root on a GPU machine; writes a folder per script under $1 (default
# reports/watches) and summary.txt there: each script's exit code, steps, median step and
# findings (code, severity, location), to hold against the committed GPU runs of the same
# scripts (reports/examples/h200-knobs, h100-try-fixes, h100-compile, h100-profile).
set -uo pipefail
out=${1:-reports/watches}
mkdir -p "$out"
profile() {  # NAME COMMAND...: one profile, its terminal output kept beside its run folder
  local name=$1; shift
  local start=$SECONDS
  python3 -m gpudiag profile --out "$out/$name" -- "$@" > "$out/$name.txt" 2>&1
  echo "$name $? $((SECONDS - start))" >> "$out/exits.txt"
}
: > "$out/exits.txt"
for script in per_tensor_optimizer loader_restarts blocking_save compile_shapes hf_trainer \
              python_loop item_sync; do
  profile "$script" python3 "examples/$script.py"
done
profile tiny_ddp torchrun --standalone --nproc-per-node 1 examples/tiny_ddp.py
profile tiny_fsdp2 torchrun --standalone --nproc-per-node 1 examples/tiny_fsdp2.py
python3 - "$out" <<'EOF' > "$out/summary.txt"
import statistics, sys
from pathlib import Path
from gpudiag.model.runfile import load_run
out = Path(sys.argv[1])
for line in (out / "exits.txt").read_text().splitlines():
    name, code, seconds = line.split()
    print(f"== {name}: exit {code}, {seconds} s")
    try:
        run = load_run(out / name)
    except Exception as exc:  # a run that wrote nothing says why here
        print(f"   no run.json: {exc}")
        continue
    for stage in run.stages:
        median = statistics.median(stage.iter_ms) if stage.iter_ms else float("nan")
        script = stage.facts.script
        steps = script.steps if script is not None else None
        print(f"   stage {stage.name}: {stage.status}, {steps} steps, median {median:.2f} ms, "
              f"{len(stage.iter_ms)} timed")
    for f in run.findings:
        print(f"   {f.id} {f.severity} {f.location}: {f.title}")
EOF
cat "$out/summary.txt"
