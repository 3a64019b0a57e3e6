"""Masked reductions over (B, T) tensors.

`mask` is bool and True means a real token. Masked positions contribute nothing,
whatever value they hold (NaN included), so padding can never leak into a loss.
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `x` over real positions. x, mask: same shape."""
    zeros = torch.zeros_like(x)
    picked = torch.where(mask, x, zeros)
    return picked.sum() if dim is None else picked.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over real positions; 0 where there are none."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of `x` over all real positions (a scalar).

    Unbiased (Bessel's correction) by default, like TRL and torchtune.
    """
    mean = masked_mean(x, mask)
    centered_sq = (x - mean) ** 2
    count = mask.sum()
    total = masked_sum(centered_sq, mask)
    if unbiased:
        if count < 2:
            return torch.zeros((), dtype=x.dtype, device=x.device)
        return total / (count - 1)
    return total / count.clamp(min=1)


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise `x` to unit variance over real positions (and zero mean if `shift_mean`).

    Masked positions are returned as 0.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask, out, torch.zeros_like(out))


def mask_from_lengths(lengths: Tensor, max_len: int) -> Tensor:
    """(B,) lengths -> (B, T) bool mask, True on the first `length` positions."""
    positions = torch.arange(max_len, device=lengths.device)
    return positions.unsqueeze(0) < lengths.unsqueeze(1)
