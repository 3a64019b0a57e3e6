"""Several whole sequences packed into one row, for SFT without padding.

An SFT step on the built-in suite pads its sequences (27-77 tokens, mean 37) to the longest in
each micro-batch; even sorted by length and cut in two, ~29 % of the tokens it runs are padding.
Packed, a row holds several sequences back to back:

    sequence a | sequence b | sequence c | padding

with positions that restart at 0 for each sequence and an attention mask that lets a token read
only the earlier tokens of its own sequence. With causal attention and rotary positions every
token then sees exactly what it would see alone, so the logits (and the loss and its gradient)
are those of the padded batch up to float summation order (tests/models/test_packed_sequences.py).
Rows are never longer than the step's longest sequence, so no row attends over more keys than
the padded batch would: the work saved is the padding, nothing is added.

Only the positions whose next token is a trained label go through the LM head and the last layer's
queries and MLP (a quarter of the suite's tokens: its prompts are long, its answers short).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rlhflab.models.lean import lean_hidden, plan_lean, read_columns
from rlhflab.models.token_head import HeadInputs

IGNORE = -100  # a target that is not trained (prompt, padding, the last token of a sequence)


@dataclass(frozen=True)
class PackedSequences:
    input_ids: Tensor  # (B, L) long: sequences back to back, then pad_id
    position_ids: Tensor  # (B, L) long: each sequence's own positions from 0 (0 on padding)
    allowed: Tensor  # (B, L, L) bool: query i may read key j (same sequence, j <= i)
    targets: Tensor  # (B, L) long: the token after position t when it is a trained label, else IGNORE
    num_label_tokens: int  # targets != IGNORE


def fill_rows(lengths: list[int], row_length: int) -> list[list[int]]:
    """Indices grouped into rows of at most `row_length` tokens: best fit, longest first.

    Each index goes into the fullest row it still fits in (a new row when none), so rows end up
    close to full; a sequence longer than `row_length` gets a row of its own."""
    rows: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = [r for r in range(len(rows)) if used[r] + lengths[i] <= row_length]
        if fits:
            best = max(fits, key=used.__getitem__)
            rows[best].append(i)
            used[best] += lengths[i]
        else:
            rows.append([i])
            used.append(lengths[i])
    return rows


def pack_sequences(sequences: list[tuple[list[int], int]], pad_id: int,
                   row_length: int | None = None) -> PackedSequences:
    """Pack (token ids, label start) pairs into right-padded rows (see module doc); `row_length`
    defaults to the longest sequence, so no row is longer than the padded batch's."""
    if not sequences:
        raise ValueError("pack_sequences needs at least one sequence")
    lengths = [len(ids) for ids, _ in sequences]
    return pack_rows(sequences, fill_rows(lengths, row_length or max(lengths)), pad_id)


def pack_rows(sequences: list[tuple[list[int], int]], rows: list[list[int]], pad_id: int) -> PackedSequences:
    """The rows `fill_rows` chose (indices into `sequences`), as tensors.

    A sequence's tokens from its label start on are trained labels (an SFT completion), each
    predicted from the position before it; the first token of a sequence is never a target."""
    if not rows or any(not sequences[i][0] for row in rows for i in row):
        raise ValueError("pack_rows needs at least one row of non-empty sequences")
    length = max(sum(len(sequences[i][0]) for i in row) for row in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), length), dtype=torch.long)
    segment = torch.full((len(rows), length), -1, dtype=torch.long)  # which sequence of the row; -1 = padding
    targets = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    for b, row in enumerate(rows):
        start = 0
        for s, i in enumerate(row):
            ids, label_start = sequences[i]
            end = start + len(ids)
            input_ids[b, start:end] = torch.tensor(ids)
            position_ids[b, start:end] = torch.arange(len(ids))
            segment[b, start:end] = s
            first = max(label_start, 1)  # position 0 has no left context: never predicted
            if first < len(ids):
                targets[b, start + first - 1 : end - 1] = torch.tensor(ids[first:])
            start = end
    causal = torch.ones(length, length, dtype=torch.bool).tril()  # (L, L) key j <= query i
    query, key = segment[:, :, None], segment[:, None, :]  # (B, L, 1), (B, 1, L)
    allowed = (causal & (query == key) & (key >= 0)) | torch.eye(length, dtype=torch.bool)  # padding reads itself
    return PackedSequences(input_ids, position_ids, allowed, targets, int((targets != IGNORE).sum()))


def can_pack_sequences(model: nn.Module) -> bool:
    """Whether `packed_target_logits` can run `model`: a causal LM whose trunk the lean forward runs
    (Llama / Qwen2 layout; in training mode, no dropout)."""
    plan = plan_lean(model, allow_training=True)
    return plan is not None and plan.lm_head is not None


def packed_target_logits(model: nn.Module, packed: PackedSequences) -> tuple[HeadInputs, Tensor]:
    """What predicts the N positions with a target (`HeadInputs`: (N, H) hidden states and the LM head; their
    logits are `head(hidden)`), and the (N,) targets. Differentiable.
    Only for models where `can_pack_sequences` holds."""
    plan = plan_lean(model, allow_training=True)
    if plan is None or plan.lm_head is None:
        raise ValueError("packed_target_logits needs a Llama-layout causal LM (see can_pack_sequences)")
    device = plan.embed.device
    targets = packed.targets.to(device)
    trained = targets != IGNORE
    read, valid = read_columns(trained)  # the last layer runs at the trained positions only
    hidden = lean_hidden(plan, packed.input_ids.to(device), None, packed.position_ids.to(device),
                         allowed=packed.allowed.to(device), read=read)  # (B, m, H)
    return HeadInputs.of(hidden[valid], plan.lm_head), targets[trained]
