#!/usr/bin/env bash
# The two-GPU DDP runs behind reports/examples/h200x2-ddp: the ddp stage over NVLink and over
# NCCL's socket transport (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1, the safe way to make a
# communication-bound job on an NVLink machine), the knob sweep over sockets, and
# `gpudiag profile` on small-batch, 1 MB-bucket DDP (NVLink and sockets) and a healthy
# large-batch DDP script (examples/ddp_bert.py).
# Run from the project root on a host with two GPUs; writes under $1.
set -uo pipefail
out=${1:-reports/ddp-two-gpus}
mkdir -p "$out"
# Multicast off everywhere (the lending machines' rule; harmless elsewhere).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi topo -m > "$out/topology.txt" 2>&1
run() { echo "== $*"; "$@" || echo "exit $?"; }
run python3 -m gpudiag run --model dgca --stages train-fp16,ddp --nproc 2 --out "$out/nvlink" --quiet
sockets=(env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1)
run "${sockets[@]}" python3 -m gpudiag run --model dgca --stages train-fp16,ddp --nproc 2 \
  --out "$out/sockets" --quiet
run "${sockets[@]}" python3 -m gpudiag run --model dgca --stages ddp --nproc 2 --ddp-sweep \
  --out "$out/sockets-sweep" --quiet
job=(python3 -m torch.distributed.run --nproc_per_node 2 examples/ddp_bert.py --steps 50)
run python3 -m gpudiag profile --out "$out/profile-small-batch" -- "${job[@]}" --batch 2 \
  --bucket-mb 1
run "${sockets[@]}" python3 -m gpudiag profile --out "$out/profile-small-batch-sockets" -- \
  "${job[@]}" --batch 2 --bucket-mb 1
run python3 -m gpudiag profile --out "$out/profile-large-batch" -- "${job[@]}" --batch 64
