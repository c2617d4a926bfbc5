"""A tiny deterministic Hugging Face Trainer job (benchmarks/same_job.py): 30 steps of batch 8
per device, one line per step. `python hf_job.py OUTPUT_DIR`, or under torchrun for DDP on
CPU (gloo)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainingArguments

STEPS, BATCH = 30, 8


def say(step: str) -> None:
    """One step's line, in one write: a job's ranks share one pipe."""
    sys.stdout.write(f"SAMEJOB {step}\n")
    sys.stdout.flush()


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 4)
        self.step = 0  # the Trainer's global step, set by StepSeen

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        loss = torch.nn.functional.cross_entropy(self.layer(x), labels)
        if self.training:
            rank = dist.get_rank() if dist.is_initialized() else 0
            say(json.dumps({"rank": rank, "step": self.step, "batch": len(x),
                                           "loss": repr(loss.item())}))
        return {"loss": loss}


class StepSeen(TrainerCallback):
    def __init__(self, model: Model) -> None:
        self.model = model

    def on_step_begin(self, _args: Any, state: Any, _control: Any, **_: Any) -> None:
        self.model.step = state.global_step


def main() -> None:
    torch.set_num_threads(1)  # one reduction order: losses comparable bit for bit
    generator = torch.Generator().manual_seed(0)
    xs = torch.randn(STEPS * BATCH * 2, 16, generator=generator)
    ys = torch.randint(0, 4, (STEPS * BATCH * 2,), generator=generator)
    data = [{"x": x, "labels": y} for x, y in zip(xs, ys, strict=True)]
    torch.manual_seed(0)
    model = Model()
    args = TrainingArguments(
        output_dir=sys.argv[1], per_device_train_batch_size=BATCH, max_steps=STEPS,
        learning_rate=0.1, lr_scheduler_type="constant", optim="sgd", weight_decay=0.0,
        use_cpu=True, ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,  # torchrun's
        seed=0, data_seed=0, report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0)
    Trainer(model=model, args=args, train_dataset=data,
            callbacks=[StepSeen(model)]).train()
    if dist.is_initialized():  # before exit, as accelerate_job.py's
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
