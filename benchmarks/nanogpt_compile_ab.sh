#!/usr/bin/env bash
# ABBA: nanoGPT compiled, plain and under gpudiag profile --compile-lines, each with a fresh
# Inductor cache; process wall and nanoGPT's own iteration times (iteration 0 holds the
# compilation). Copy into a nanoGPT checkout whose data/shakespeare_char is prepared, set OUT
# to a folder for the logs, and run it there (reports/examples/h100-compile/README.md).
set -u
cd "$(dirname "$0")"
ARGS="config/train_shakespeare_char.py --compile=True --max_iters=60 --eval_interval=1000 --eval_iters=20 --log_interval=1 --always_save_checkpoint=False"
mkdir -p $OUT/ab
for run in plain-1 gpudiag-1 gpudiag-2 plain-2; do
  export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-$run TRITON_CACHE_DIR=/tmp/triton-$run
  start=$(date +%s.%N)
  if [[ $run == plain* ]]; then
    python3 train.py $ARGS > $OUT/ab/$run.log 2>&1
  else
    python3 -m gpudiag profile --compile-lines --out /tmp/res/$run -- python3 train.py $ARGS > $OUT/ab/$run.log 2>&1
  fi
  end=$(date +%s.%N)
  echo "$run wall $(python3 -c "print(round($end-$start,2))")" | tee -a $OUT/ab/walls.txt
done
cd /tmp/res && rm -rf */trace.json */*.png */*.json.gz */parts */samples.csv && tar czf $OUT/res.tgz .
