"""`bert`: BertForMaskedLM in the bert-base-chinese shape, random weights, synthetic MLM data."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch

from gpudiag.measure.models import Example, ModelBundle, ModelOptions, ModelSpec, register_model

if TYPE_CHECKING:
    from transformers import BertConfig

    from gpudiag.model.config import ModelShape

# bert-base-chinese special token ids.
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = 0, 100, 101, 102, 103
FIRST_WORD_ID = 104  # ids below are special tokens
MLM_MASK_RATE = 0.15
IGNORE_INDEX = -100


def bert_config(shape: ModelShape) -> BertConfig:
    """A BertConfig of the given shape; never downloads anything."""
    from transformers import BertConfig  # noqa: PLC0415 (transformers takes seconds to import)

    return BertConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        intermediate_size=shape.intermediate_size,
        hidden_act="gelu",
        max_position_embeddings=shape.max_positions,
        type_vocab_size=2,
        layer_norm_eps=1e-12,
        pad_token_id=PAD_ID,
    )


def example_generator(options: ModelOptions, index: int) -> torch.Generator:
    """A generator seeded by (run seed, example index): any worker rebuilds the same example."""
    return torch.Generator().manual_seed(options.seed * 1_000_003 + index)


def random_words(n: int, vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(FIRST_WORD_ID, vocab_size, (n,), generator=generator)


def mlm_example(options: ModelOptions, index: int) -> Example:
    """`[CLS] words [SEP] [PAD]...` of random length; 15% of words masked and labelled."""
    g = example_generator(options, index)
    seq = options.seq_len
    n_words = int(torch.randint(seq // 2, seq - 1, (1,), generator=g))
    words = random_words(n_words, options.shape.vocab_size, g)
    input_ids = torch.full((seq,), PAD_ID, dtype=torch.long)
    input_ids[0], input_ids[n_words + 1] = CLS_ID, SEP_ID
    input_ids[1 : n_words + 1] = words
    labels = torch.full((seq,), IGNORE_INDEX, dtype=torch.long)
    masked = torch.rand(n_words, generator=g) < MLM_MASK_RATE
    positions = torch.arange(1, n_words + 1)[masked]
    labels[positions] = input_ids[positions]
    input_ids[positions] = MASK_ID
    attention_mask = (torch.arange(seq) < n_words + 2).long()
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "token_type_ids": torch.zeros(seq, dtype=torch.long),
        "labels": labels,
    }


def block_generator(options: ModelOptions, start: int, count: int) -> torch.Generator:
    """A generator for rows start..start+count-1 built together (make_batch)."""
    return torch.Generator().manual_seed((options.seed * 1_000_003 + start) * 7_919 + count)


def mlm_batch(options: ModelOptions, start: int, count: int) -> Example:
    """`count` rows laid out as mlm_example's, built with tensor ops over the whole batch."""
    g = block_generator(options, start, count)
    seq = options.seq_len
    n_words = torch.randint(seq // 2, seq - 1, (count, 1), generator=g)
    pos = torch.arange(seq).expand(count, seq)
    is_word = (pos >= 1) & (pos <= n_words)
    words = torch.randint(FIRST_WORD_ID, options.shape.vocab_size, (count, seq), generator=g)
    input_ids = torch.where(is_word, words, PAD_ID)
    input_ids = torch.where(pos == 0, CLS_ID, torch.where(pos == n_words + 1, SEP_ID, input_ids))
    masked = is_word & (torch.rand(count, seq, generator=g) < MLM_MASK_RATE)
    return {
        "input_ids": torch.where(masked, MASK_ID, input_ids),
        "attention_mask": (pos < n_words + 2).long(),
        "token_type_ids": torch.zeros(count, seq, dtype=torch.long),
        "labels": torch.where(masked, input_ids, IGNORE_INDEX),
    }


def build_bert(options: ModelOptions) -> ModelBundle:
    from transformers import BertForMaskedLM  # noqa: PLC0415 (transformers takes seconds to import; only the models that use it pay)

    shape = options.shape
    return ModelBundle(
        model=BertForMaskedLM(bert_config(shape)),
        make_example=partial(mlm_example, options),
        make_batch=partial(mlm_batch, options),
        description=(f"BertForMaskedLM {shape.num_layers}L/{shape.hidden_size}H/"
                     f"{shape.num_heads}A, vocab {shape.vocab_size}"),
        infer_inputs=("input_ids", "attention_mask", "token_type_ids"),
    )


register_model(ModelSpec(
    name="bert",
    summary="BertForMaskedLM in the bert-base-chinese shape, random init, synthetic MLM batches",
    build=build_bert,
))
