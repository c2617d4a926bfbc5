"""FSDP2 (`fully_shard`) on a small MLP with a small per-device batch: each layer's parameters
are all-gathered before its forward and backward and its gradients reduce-scattered after, so
the collectives cost about as much as the compute. Run with torchrun --nproc-per-node 2 (gloo
on CPUs, NCCL on GPUs), with an optional number of steps (default 60). Each layer frees its
gathered parameters after forward and gathers them again for backward (fully_shard's default);
RESHARD=0 keeps them gathered (reshard_after_forward=False), the fix gpudiag names."""

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 60


def main() -> None:
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).to(device)
    reshard = os.environ.get("RESHARD", "1") != "0"
    for layer in model:
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    x = torch.randn(4, 1024, device=device)
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    if dist.get_rank() == 0 and len(times) > 5:  # the script's own timer, for a plain A/B
        print("SCRIPT_TIMER " + json.dumps({"median_ms": statistics.median(times[5:])}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
