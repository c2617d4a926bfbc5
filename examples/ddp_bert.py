"""BERT-base masked-LM training under DDP, for `gpudiag profile` on several GPUs.

Small per-GPU batches with small gradient buckets make every step wait on the all-reduce;
large batches with the default buckets hide it behind the backward pass. Run with e.g.
  torchrun --nproc-per-node 2 examples/ddp_bert.py --batch 2 --bucket-mb 1
  torchrun --nproc-per-node 2 examples/ddp_bert.py --batch 64
  torchrun --nproc-per-node 2 examples/ddp_bert.py --batch 32 --accum 8   # 8 micro-steps
With --accum N each optimizer step takes N micro-steps, every backward all-reducing (no
`model.no_sync()`, as many accumulation loops are written).
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import BertConfig, BertForMaskedLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64, help="samples per GPU")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--accum", type=int, default=1, help="micro-steps per optimizer step")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(vocab_size=21128)).to(device)
    model = DistributedDataParallel(model, device_ids=[local] if cuda else None,
                                    bucket_cap_mb=args.bucket_mb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    scaler = torch.amp.GradScaler(device.type, enabled=cuda)
    ids = torch.randint(1000, 21128, (args.batch, args.seq), device=device)
    for _ in range(args.steps):
        for _ in range(args.accum):
            with torch.autocast(device.type, dtype=torch.float16 if cuda else torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            scaler.scale(loss / args.accum).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
