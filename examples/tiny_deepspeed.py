"""DeepSpeed ZeRO stage 2 with bf16, the stack of the field report gpudiag was born from
(../shared/SEEDS.md): a small Transformer language model trained with deepspeed.initialize's
engine (engine.backward, engine.step), the optimizer a client torch AdamW that ZeRO shards.
Run with torchrun --nproc-per-node 2 tiny_deepspeed.py [STEPS] (default 60) on GPUs; NCCL
carries ZeRO's reduce-scatters and all-gathers. Prints the script's own step timer."""

import json
import os
import statistics
import sys
import time

import deepspeed
import torch
from torch import nn

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 60
CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7},
    "zero_allow_untested_optimizer": True,
    "gradient_clipping": 1.0,
    "steps_per_print": 10**9,
}


class LanguageModel(nn.Module):
    def __init__(self, vocab: int = 8192, width: int = 512, layers: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        block = nn.TransformerEncoderLayer(width, 8, 4 * width, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def main() -> None:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    deepspeed.init_distributed(dist_backend="nccl")
    torch.manual_seed(0)
    model = LanguageModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=CONFIG)
    tokens = torch.randint(0, 8192, (8, 256), device=engine.device)
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        logits = engine(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    if engine.global_rank == 0 and len(times) > 5:
        print("SCRIPT_TIMER " + json.dumps({"median_ms": statistics.median(times[5:])}))


if __name__ == "__main__":
    main()
