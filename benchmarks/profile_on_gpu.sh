# Sourced by the benchmarks/*_on_gpu.sh calls: `profile NAME LIMIT_S OPTIONS... -- COMMAND...`
# runs `gpudiag profile` into "$out/NAME" with a time limit (so that a call ends inside the
# device's 10 minutes), its terminal output in "$out/NAME.txt", its exit in "$out/exits.txt".
profile() {
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" python3 -m gpudiag profile --out "$out/$name" "$@" > "$out/$name.txt" 2>&1
  echo "$name exit $? in $((SECONDS - start)) s" | tee -a "$out/exits.txt"
}
: > "$out/exits.txt"
