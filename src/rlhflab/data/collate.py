"""Pad token ids into typed batches.

SFT batches are right-padded; generation prompts are left-padded and need
explicit position ids so that a sequence's positions do not depend on how much
padding its batch needed (docs: DESIGN.md, correctness rules).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlhflab.data.tokenize import TokenizedSFT

IGNORE_INDEX = -100  # label value that torch's cross-entropy (and HF models) skip


@dataclass(frozen=True)
class SFTBatch:
    input_ids: Tensor  # (B, L) long; prompt then completion then pad_id
    attention_mask: Tensor  # (B, L) long; 1 on real tokens, 0 on padding
    labels: Tensor  # (B, L) long; = input_ids on completion tokens, -100 on prompt and padding
    num_label_tokens: int  # number of labels != -100 (completion tokens, EOS included)


def collate_sft(items: list[TokenizedSFT], pad_id: int) -> SFTBatch:
    """Right-pad prompt+completion sequences; labels are unshifted (HF models shift them).

    Labels come from the prompt / completion lengths, never from `input_ids != pad_id`,
    so a real EOS stays a trained label when pad == eos.
    """
    if not items:
        raise ValueError("collate_sft needs at least one item")
    lengths = [len(it.prompt_ids) + len(it.completion_ids) for it in items]
    b, l = len(items), max(lengths)
    input_ids = torch.full((b, l), pad_id, dtype=torch.long)  # (B, L)
    attention_mask = torch.zeros((b, l), dtype=torch.long)  # (B, L)
    labels = torch.full((b, l), IGNORE_INDEX, dtype=torch.long)  # (B, L)
    for i, (it, n) in enumerate(zip(items, lengths)):
        p = len(it.prompt_ids)
        input_ids[i, :n] = torch.tensor(it.prompt_ids + it.completion_ids, dtype=torch.long)
        attention_mask[i, :n] = 1
        labels[i, p:n] = input_ids[i, p:n]
    # the first position has no left context, so a label there is never predicted
    num_label_tokens = int((labels[:, 1:] != IGNORE_INDEX).sum())
    return SFTBatch(input_ids, attention_mask, labels, num_label_tokens)


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad prompts for generation -> (input_ids (B, P), attention_mask (B, P)), both long."""
    if not seqs:
        raise ValueError("left_pad needs at least one sequence")
    b, p = len(seqs), max(len(s) for s in seqs)
    input_ids = torch.full((b, p), pad_id, dtype=torch.long)  # (B, P)
    attention_mask = torch.zeros((b, p), dtype=torch.long)  # (B, P)
    for i, s in enumerate(seqs):
        if s:
            input_ids[i, p - len(s):] = torch.tensor(s, dtype=torch.long)
            attention_mask[i, p - len(s):] = 1
    return input_ids, attention_mask


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """(B, P) positions counting real tokens only: cumsum - 1, clamped at 0 on left padding."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)
