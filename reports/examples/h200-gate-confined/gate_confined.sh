set -u
G="python3 -m gpudiag"
cd .gpu/nanogpt
python3 -c "from gpudiag.measure.childexec import landlock_abi; print('landlock ABI', landlock_abi())"
uname -r
hash_tree() { find . -path ./.git -prune -o -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum; }
before=$(hash_tree); gitbefore=$(git status --porcelain; git rev-parse HEAD)
CMD="python3 train.py config/train_shakespeare_char.py --max_iters=60 --compile=False --eval_iters=20"
SH="--share data/shakespeare_char/train.bin --share data/shakespeare_char/val.bin --share data/shakespeare_char/meta.pkl"
run_job() { name=$1; shift; s=$(date +%s); "$@" > $OUT/$name.txt 2>&1; rc=$?; echo "$name exit $rc in $(( $(date +%s) - s )) s" | tee -a $OUT/summary.txt; tail -25 $OUT/$name.txt; }
run_job aa $G gate --base-ref HEAD --max-trials 2 --max-regression 10 --max-regression device=1 --max-regression syncs=0 --samples-per-step 64 $SH --out /tmp/aa -- $CMD
run_job absolute $G gate --base-ref HEAD --max-trials 1 $SH --out /tmp/abs -- $CMD --out_dir=/tmp/nanogpt-abs-out
ls -d /tmp/nanogpt-abs-out 2>&1 | tee -a $OUT/summary.txt
mkdir -p /tmp/allowed
run_job allowed $G gate --base-ref HEAD --max-trials 1 --rerun-writable /tmp/allowed $SH --out /tmp/allowed-job -- $CMD --out_dir=/tmp/allowed/out
ls /tmp/allowed 2>&1 | tee -a $OUT/summary.txt
after=$(hash_tree); gitafter=$(git status --porcelain; git rev-parse HEAD)
[ "$before" = "$after" ] && echo "user's folder unchanged (sha256 of every file)" | tee -a $OUT/summary.txt || echo "user's folder CHANGED" | tee -a $OUT/summary.txt
[ "$gitbefore" = "$gitafter" ] && echo "git status and HEAD unchanged" | tee -a $OUT/summary.txt
git worktree list | tee -a $OUT/summary.txt
cp /tmp/aa/gate.md $OUT/aa-gate.md 2>/dev/null || true
