#!/usr/bin/env bash
# The runs behind reports/examples/h100-try-fixes: `gpudiag profile --try-fixes` on three
# unmodified example scripts with one planted problem each (fp32 matmuls with TF32 switched
# off, a DataLoader with no workers over a slow Dataset, a blocking checkpoint every 5 steps),
# and a SIGTERM to `gpudiag run` on the dgca ladder in the middle of a timed stage (issue 17's
# "stopping keeps what was measured", on a GPU: CUDA-event timing cut short).
# Run from the project root on a GPU machine; writes under $1 (default reports/try-fixes).
set -uo pipefail
out=${1:-reports/try-fixes}
mkdir -p "$out"
run() { echo "== $*"; "$@" || echo "exit $?"; }
for script in ${SCRIPTS:-fp32_no_tf32 slow_dataset blocking_save}; do
  run python3 -m gpudiag profile --try-fixes --out "$out/$script" -- \
    python3 "examples/$script.py" 2>&1 | grep -v '^USDT'
done
# SIGTERM 25 s into a dgca run of two stages: the first is kept, the second is marked
# interrupted with the steps it had timed, exit 143.
python3 -m gpudiag run --model dgca --stages train-fp16,full-loop --iters 400 --evidence-steps 0 \
  --out "$out/sigterm" --quiet &
pid=$!
sleep "${SIGTERM_AFTER_S:-25}"
kill -TERM "$pid"
start=$(date +%s%N)
wait "$pid"
code=$?
echo "sigterm: exit $code after $(( ($(date +%s%N) - start) / 1000000 )) ms"
