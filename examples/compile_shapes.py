"""A compiled GPT-style model fed a new sequence length every step, timing itself: with
`torch.compile(dynamic=False)` (the default here) every new length recompiles until Dynamo's
recompile limit, after which the model runs eagerly; `--dynamic auto` leaves the choice to
Dynamo (one recompile, then a dynamic length), `--dynamic true` compiles for any length from
the start, `--bucket N` pads each batch to a multiple of N. Writes truth.json in the working
directory: every step's time (CUDA-synchronised perf_counter) and the length it ran, Dynamo's
total compile time and the script's own wall, the ground truth for gpudiag's compile figures
(reports/examples/h100-compile)."""

import argparse
import json
import time

started_script = time.perf_counter()

import torch  # noqa: E402  (the script's own wall starts before torch's import)
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--dynamic", choices=["false", "auto", "true"], default="false")
parser.add_argument("--bucket", type=int, default=0, help="pad lengths to a multiple of this")
parser.add_argument("--width", type=int, default=256)
parser.add_argument("--layers", type=int, default=2)
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
VOCAB = 1024


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(layers)])
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


model = GPT(args.width, args.layers).to(device)
dynamic = {"false": False, "auto": None, "true": True}[args.dynamic]
compiled = torch.compile(model, dynamic=dynamic)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
truth: dict[str, list[float]] = {"step_ms": [], "length": []}
for step in range(args.steps):
    started = time.perf_counter()
    length = 64 + 16 * (step % 12)  # twelve lengths, a new one every step for the first 12
    if args.bucket:
        length = -(-length // args.bucket) * args.bucket
    tokens = torch.randint(0, VOCAB, (8, length + 1), device=device)
    logits = compiled(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
    truth["step_ms"].append((time.perf_counter() - started) * 1e3)
    truth["length"].append(length)
# Dynamo's own compile times (the same measure with and without gpudiag), and the script's wall.
metrics = torch._dynamo.utils.get_compilation_metrics()
truth["compile_s"] = [sum((m.duration_us or 0) for m in metrics) / 1e6]
truth["script_s"] = [time.perf_counter() - started_script]
with open("truth.json", "w") as f:
    json.dump(truth, f)
