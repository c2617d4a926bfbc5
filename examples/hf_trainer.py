"""transformers' Trainer as its documentation shows it, on a small BERT with synthetic data:
fp32 training (no fp16/bf16 flag, TF32 left off) and a checkpoint every `save_steps`.

    python hf_trainer.py [MAX_STEPS] [SAVE_STEPS]   (defaults 120 and 40)
"""

import sys
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

SEQ, VOCAB = 128, 8192


class Synthetic(Dataset):
    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(0, VOCAB, (SEQ,), generator=g),
                "labels": torch.tensor(i % 2)}


def main() -> None:
    max_steps = int(sys.argv[1]) if len(sys.argv) > 1 else 120
    save_steps = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    config = BertConfig(vocab_size=VOCAB, hidden_size=512, num_hidden_layers=6,
                        num_attention_heads=8, intermediate_size=2048)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=max_steps, save_steps=save_steps,
                                 per_device_train_batch_size=64, report_to=[],
                                 logging_steps=1000, dataloader_num_workers=2,
                                 disable_tqdm=True)
        Trainer(model=BertForSequenceClassification(config), args=args,
                train_dataset=Synthetic()).train()


if __name__ == "__main__":
    main()
