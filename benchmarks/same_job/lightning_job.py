"""A tiny deterministic Lightning job (benchmarks/same_job.py): 30 steps of batch 8, one line
per step. `python lightning_job.py [DEVICES]`: 1 device, or DDP on CPU over DEVICES ranks
(Lightning starts the other ranks itself, re-running this script)."""

from __future__ import annotations

import json
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

STEPS, BATCH = 30, 8


def say(step: str) -> None:
    """One step's line, in one write: a job's ranks share one pipe."""
    sys.stdout.write(f"SAMEJOB {step}\n")
    sys.stdout.flush()


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 4)

    def training_step(self, batch: list[torch.Tensor], _index: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.layer(x), y)
        say(json.dumps({"rank": self.global_rank, "step": self.global_step,
                                       "batch": len(x), "loss": repr(loss.item())}))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    devices = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    torch.set_num_threads(1)  # one reduction order: losses comparable bit for bit
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(STEPS * BATCH * devices, 16, generator=generator),
                         torch.randint(0, 4, (STEPS * BATCH * devices,), generator=generator))
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=devices,
                        strategy="ddp" if devices > 1 else "auto", max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True)
    trainer.fit(Model(), DataLoader(data, batch_size=BATCH, shuffle=False))


if __name__ == "__main__":
    main()
