"""`dgca`: a faithful synthetic DGCA-ReLM (docs/field-cases.md#case-1), the workload of the first
field case.

The baseline stages (infer, train, train-fp16, data-train) run its BERT backbone alone, as the
seed's staged script did; the `loop` and `vectorized` variants are the whole model, differing
only in how the P-tuning prompt embeddings are written into the input embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from gpudiag.measure.models import Example, ModelBundle, ModelOptions, ModelSpec, register_model
from gpudiag.measure.models.bert import (
    CLS_ID,
    FIRST_WORD_ID,
    IGNORE_INDEX,
    MASK_ID,
    PAD_ID,
    SEP_ID,
    bert_config,
    block_generator,
    build_bert,
    example_generator,
    random_words,
)

PromptImpl = Literal["loop", "vectorized"]

MAX_SOURCE_LEN = 60  # synthetic source sentences are 20..60 tokens at seq 128
ERROR_RATE = 0.15  # share of source tokens the synthetic target corrects
DETECTOR_POS_WEIGHT = 3.0
ERROR_TOKEN_WEIGHT = 2.0
RANKING_WEIGHT = 0.5
RANKING_MARGIN = 0.1
FUSION_EPS = 1e-10


def source_length_range(seq_len: int, prompt_length: int) -> tuple[int, int]:
    """Rows hold 2P prompt slots plus source and target of equal length n."""
    longest = min(MAX_SOURCE_LEN, (seq_len - 2 * prompt_length) // 2)
    return max(1, longest // 3), longest


def relm_example(options: ModelOptions, index: int) -> Example:
    """One row in ReLM's layout: `[CLS]*P + src + [SEP]*P + [MASK]*n`, padded to seq_len."""
    g = example_generator(options, index)
    p, seq, k = options.prompt_length, options.seq_len, options.candidates
    vocab = options.shape.vocab_size
    shortest, longest = source_length_range(seq, p)
    n = int(torch.randint(shortest, longest + 1, (1,), generator=g))
    src = random_words(n, vocab, g)
    trg = src.clone()
    corrected = torch.rand(n, generator=g) < ERROR_RATE
    trg[corrected] = random_words(int(corrected.sum()), vocab, g)
    is_error = (src != trg).float()

    input_ids = torch.full((seq,), PAD_ID, dtype=torch.long)
    input_ids[:p] = CLS_ID
    input_ids[p : p + n] = src
    input_ids[p + n : 2 * p + n] = SEP_ID
    input_ids[2 * p + n : 2 * p + 2 * n] = MASK_ID
    prompt_mask = torch.zeros(seq, dtype=torch.long)
    prompt_mask[:p] = 1
    prompt_mask[p + n : 2 * p + n] = 1
    target = slice(2 * p + n, 2 * p + 2 * n)
    labels = torch.full((seq,), IGNORE_INDEX, dtype=torch.long)
    labels[target] = trg
    source_mask = torch.zeros(seq)
    source_mask[p : p + n] = 1.0
    detection_labels = torch.zeros(seq)
    detection_labels[p : p + n] = is_error
    error_mask = torch.zeros(seq)
    error_mask[target] = is_error

    # Confusion-set candidates for each target position: K slots, a variable number valid, the
    # gold token in one of them, padding (id 0) after; rows of other positions are all padding.
    valid = torch.randint(k // 2, k + 1, (n,), generator=g)
    gold = (torch.rand(n, generator=g) * valid).long()
    cands = random_words(n * k, vocab, g).view(n, k)
    cands[torch.arange(n), gold] = trg
    cands[torch.arange(k)[None, :] >= valid[:, None]] = PAD_ID
    candidate_ids = torch.zeros(seq, k, dtype=torch.long)
    candidate_ids[target] = cands
    gold_index = torch.zeros(seq, dtype=torch.long)
    gold_index[target] = gold
    return {
        "input_ids": input_ids,
        "attention_mask": (torch.arange(seq) < 2 * p + 2 * n).long(),
        "prompt_mask": prompt_mask,
        "labels": labels,
        "source_mask": source_mask,
        "detection_labels": detection_labels,
        "error_mask": error_mask,
        "candidate_ids": candidate_ids,
        "gold_index": gold_index,
    }


def relm_batch(options: ModelOptions, start: int, count: int) -> Example:
    """`count` rows laid out as relm_example's, built with tensor ops over the whole batch:
    each position is classified (prompt, source, separator, target) from the row's length,
    and its token gathered from the row's source or target."""
    g = block_generator(options, start, count)
    p, seq, k = options.prompt_length, options.seq_len, options.candidates
    vocab = options.shape.vocab_size
    shortest, longest = source_length_range(seq, p)
    n = torch.randint(shortest, longest + 1, (count, 1), generator=g)
    word = torch.arange(longest).expand(count, longest)  # index within source / target
    src = torch.randint(FIRST_WORD_ID, vocab, (count, longest), generator=g)
    corrected = (torch.rand(count, longest, generator=g) < ERROR_RATE) & (word < n)
    trg = torch.where(corrected, torch.randint(FIRST_WORD_ID, vocab, (count, longest),
                                               generator=g), src)
    is_error = (src != trg).float()

    pos = torch.arange(seq).expand(count, seq)
    in_src = (pos >= p) & (pos < p + n)
    in_sep = (pos >= p + n) & (pos < 2 * p + n)
    in_trg = (pos >= 2 * p + n) & (pos < 2 * p + 2 * n)
    at_src = (pos - p).clamp(0, longest - 1)  # the source word each position would hold
    at_trg = (pos - 2 * p - n).clamp(0, longest - 1)
    input_ids = torch.where(pos < p, CLS_ID, PAD_ID)
    input_ids = torch.where(in_src, src.gather(1, at_src), input_ids)
    input_ids = torch.where(in_sep, SEP_ID, torch.where(in_trg, MASK_ID, input_ids))

    # Confusion-set candidates per target word, as in relm_example: K slots, some valid, the
    # gold token in one of them, padding after.
    valid = torch.randint(k // 2, k + 1, (count, longest, 1), generator=g)
    gold = (torch.rand(count, longest, 1, generator=g) * valid).long()
    cands = torch.randint(FIRST_WORD_ID, vocab, (count, longest, k), generator=g)
    cands = cands.scatter(2, gold, trg.unsqueeze(-1))
    cands = torch.where(torch.arange(k) >= valid, PAD_ID, cands)
    candidate_ids = cands.gather(1, at_trg.unsqueeze(-1).expand(count, seq, k))
    return {
        "input_ids": input_ids,
        "attention_mask": (pos < 2 * p + 2 * n).long(),
        "prompt_mask": ((pos < p) | in_sep).long(),
        "labels": torch.where(in_trg, trg.gather(1, at_trg), IGNORE_INDEX),
        "source_mask": in_src.float(),
        "detection_labels": torch.where(in_src, is_error.gather(1, at_src), 0.0),
        "error_mask": torch.where(in_trg, is_error.gather(1, at_trg), 0.0),
        "candidate_ids": torch.where(in_trg.unsqueeze(-1), candidate_ids, PAD_ID),
        "gold_index": torch.where(in_trg, gold.squeeze(-1).gather(1, at_trg), 0),
    }


def apply_prompt_loop(
    inputs_embeds: torch.Tensor, prompt_mask: torch.Tensor, replace_embeds: torch.Tensor,
    prompt_length: int,
) -> torch.Tensor:
    """The seed's `_apply_prompt`: one tiny indexing assignment per (row, slot).

    On CUDA every `blocked[i, j]` used as an index is a device-to-host read (a blocking sync),
    and every assignment a copy; autograd adds a copy of the whole gradient per assignment.
    """
    batch_size = inputs_embeds.shape[0]
    blocked = (prompt_mask == 1).nonzero().reshape(batch_size, 2 * prompt_length, 2)[:, :, 1]
    for i in range(batch_size):
        for j in range(2 * prompt_length):
            inputs_embeds[i, blocked[i, j], :] = replace_embeds[j, :]
    return inputs_embeds


def apply_prompt_vectorized(
    inputs_embeds: torch.Tensor, prompt_mask: torch.Tensor, replace_embeds: torch.Tensor,
) -> torch.Tensor:
    """The same result in one op, with no host sync.

    `masked_scatter` fills masked positions in row-major order; each row has exactly 2P prompt
    slots in ascending position, so row i receives replace_embeds[0..2P-1] in slot order, exactly
    what the loop writes, whatever each row's source length. (The seed's own fix, `index_copy_`
    over row 0's positions, is wrong whenever rows differ in length.)
    """
    batch_size = inputs_embeds.shape[0]
    slots = prompt_mask.bool().unsqueeze(-1)
    source = replace_embeds.to(inputs_embeds.dtype).expand(batch_size, -1, -1)
    return inputs_embeds.masked_scatter(slots, source)


class PromptEncoder(nn.Module):
    """P-tuning prompt encoder: Embedding(2P, H) -> 2-layer BiLSTM -> MLP, giving (2P, H)."""

    def __init__(self, slots: int, hidden: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(slots, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=2, bidirectional=True, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden))
        self.register_buffer("slot_ids", torch.arange(slots), persistent=False)

    def forward(self) -> torch.Tensor:
        states, _ = self.lstm(self.embedding(self.slot_ids).unsqueeze(0))
        return self.mlp(states.squeeze(0))


@dataclass
class DgcaOutput:
    loss: torch.Tensor
    log_probs: torch.Tensor


class DgcaRelm(nn.Module):
    """BERT MLM + prompt encoder + detector head + candidate head + gated vocabulary fusion."""

    detector_pos_weight: torch.Tensor  # a buffer, registered in __init__

    def __init__(self, options: ModelOptions, prompt_impl: PromptImpl) -> None:
        super().__init__()
        from transformers import BertForMaskedLM  # noqa: PLC0415 (transformers takes seconds to import; only the models that use it pay)

        hidden = options.shape.hidden_size
        self.prompt_length = options.prompt_length
        self.prompt_impl = prompt_impl
        self.bert = BertForMaskedLM(bert_config(options.shape))
        self.prompt_encoder = PromptEncoder(2 * options.prompt_length, hidden)
        self.detector = nn.Sequential(nn.Dropout(0.1), nn.Linear(hidden, hidden), nn.Tanh(),
                                      nn.Dropout(0.1), nn.Linear(hidden, 1))
        self.candidate_proj = nn.Linear(hidden, hidden)
        self.gate = nn.Linear(hidden + 1, 1)
        self.register_buffer("detector_pos_weight", torch.tensor(DETECTOR_POS_WEIGHT),
                             persistent=False)

    @property
    def word_embeddings(self) -> nn.Embedding:
        return self.bert.bert.embeddings.word_embeddings

    def embed(self, input_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
        """Word embeddings with the 2P prompt slots of every row replaced by the prompt."""
        inputs_embeds = self.word_embeddings(input_ids)
        replace_embeds = self.prompt_encoder()
        if self.prompt_impl == "loop":
            return apply_prompt_loop(inputs_embeds, prompt_mask, replace_embeds,
                                     self.prompt_length)
        return apply_prompt_vectorized(inputs_embeds, prompt_mask, replace_embeds)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_mask: torch.Tensor,
        labels: torch.Tensor,
        source_mask: torch.Tensor,
        detection_labels: torch.Tensor,
        error_mask: torch.Tensor,
        candidate_ids: torch.Tensor,
        gold_index: torch.Tensor,
    ) -> DgcaOutput:
        embeds = self.embed(input_ids, prompt_mask)
        hs = self.bert.bert(inputs_embeds=embeds, attention_mask=attention_mask).last_hidden_state
        vocab_logits = self.bert.cls(hs)
        vocab_size = vocab_logits.shape[-1]

        detector_logits = self.detector(hs).squeeze(-1).float()
        detector_prob = torch.sigmoid(detector_logits)

        # Candidate head: score each of the K confusion-set candidates against the hidden state.
        h = torch.tanh(self.candidate_proj(hs))
        candidate_embeds = self.word_embeddings(candidate_ids)  # (B, S, K, H)
        scores = torch.einsum("bsh,bskh->bsk", h, candidate_embeds).float()
        padding = candidate_ids == PAD_ID
        # A finite floor, not -inf: all-padding rows then give a uniform, not a NaN, softmax.
        scores = scores.masked_fill(padding, torch.finfo(scores.dtype).min)
        candidate_probs = torch.softmax(scores, dim=-1)

        # Gated fusion over the vocabulary, in place (the seed saved ~1.3 GB of temporaries).
        gate_in = torch.cat([hs, detector_prob.unsqueeze(-1).to(hs.dtype)], dim=-1)
        alpha = torch.sigmoid(self.gate(gate_in)).float()
        fused = (1 - alpha) * torch.softmax(vocab_logits, dim=-1, dtype=torch.float32)
        fused.scatter_add_(-1, candidate_ids, alpha * candidate_probs)
        log_probs = torch.log(fused + FUSION_EPS)

        active = (labels != IGNORE_INDEX).float()
        token_nll = F.nll_loss(log_probs.view(-1, vocab_size), labels.view(-1),
                               ignore_index=IGNORE_INDEX, reduction="none").view_as(active)
        weights = active * (1 + (ERROR_TOKEN_WEIGHT - 1) * error_mask)
        correction = (token_nll * weights).sum() / weights.sum().clamp_min(1)

        detection = F.binary_cross_entropy_with_logits(
            detector_logits, detection_labels, pos_weight=self.detector_pos_weight,
            reduction="none")
        detection = (detection * source_mask).sum() / source_mask.sum().clamp_min(1)

        gold_prob = candidate_probs.gather(-1, gold_index.unsqueeze(-1)).squeeze(-1)
        not_gold = padding | F.one_hot(gold_index, candidate_ids.shape[-1]).bool()
        best_wrong = candidate_probs.masked_fill(not_gold, 0.0).amax(dim=-1)
        ranking = F.margin_ranking_loss(gold_prob, best_wrong, torch.ones_like(gold_prob),
                                        margin=RANKING_MARGIN, reduction="none")
        ranking = (ranking * active).sum() / active.sum().clamp_min(1)

        auxiliary_mlm = F.cross_entropy(vocab_logits.view(-1, vocab_size), labels.view(-1),
                                        ignore_index=IGNORE_INDEX)
        loss = correction + detection + RANKING_WEIGHT * ranking + auxiliary_mlm
        return DgcaOutput(loss=loss, log_probs=log_probs)


def build_dgca(options: ModelOptions, prompt_impl: PromptImpl) -> ModelBundle:
    shape = options.shape
    return ModelBundle(
        model=DgcaRelm(options, prompt_impl),
        make_example=partial(relm_example, options),
        make_batch=partial(relm_batch, options),
        description=(f"DGCA-ReLM on BERT {shape.num_layers}L/{shape.hidden_size}H, "
                     f"P={options.prompt_length}, K={options.candidates}, "
                     f"prompt: {prompt_impl}"),
    )


register_model(ModelSpec(
    name="dgca",
    summary=("DGCA-ReLM spelling correction (seed report 1): BERT backbone for the baseline "
             "stages; full model with looped or vectorized prompt for full-loop/-vectorized"),
    build=build_bert,
    variants={"loop": partial(build_dgca, prompt_impl="loop"),
              "vectorized": partial(build_dgca, prompt_impl="vectorized")},
))
