"""Score shaping by response length: the missing-EOS penalty and DAPO's soft overlong punishment.

Both are subtracted from a response's score before any advantage is formed (trainers/online/loop.py, step 3), and
they add up: a response that runs to the cap without EOS pays `missing_eos_penalty` and the whole overlong
penalty; one that ends with EOS inside the last `buffer` tokens pays only its share of the overlong penalty.
Shapes: B responses.
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, factor: float) -> Tensor:
    """(B,) DAPO's soft overlong punishment (Yu et al. 2025, eq. 13; TRL's `get_soft_overlong_punishment`) as an
    amount to subtract: 0 up to max_len − buffer tokens, then rising linearly to `factor` at max_len:
        factor × clamp((length − (max_len − buffer)) / buffer, 0, 1).
    `lengths` (B,): response tokens, EOS included (TRL's `len(completion_ids)`); buffer 0 or factor 0 = off.
    E.g. max_len 20, buffer 4, factor 1: lengths 16, 17, 18, 20 -> 0, 0.25, 0.5, 1."""
    if buffer <= 0 or factor == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)
    over = (lengths.float() - (max_len - buffer)) / buffer
    return factor * over.clamp(min=0.0, max=1.0)


def length_shaped_scores(scores: Tensor, lengths: Tensor, ended_with_eos: Tensor, missing_eos_penalty: float,
                         max_len: int, buffer: int = 0, factor: float = 0.0) -> Tensor:
    """(B,) score − missing_eos_penalty × [no EOS] − overlong_penalty(length): the two length penalties together.
    scores, lengths (B,); ended_with_eos (B,) bool."""
    return (scores.float() - missing_eos_penalty * (~ended_with_eos).float()
            - overlong_penalty(lengths, max_len, buffer, factor).to(scores.device))
