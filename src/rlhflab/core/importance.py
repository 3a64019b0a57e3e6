"""Truncated / masked importance weights between the trainer's log-probs and the sampler's (TRL's
`vllm_importance_sampling_mode`): the tokens were drawn by the sampler, the loss reads the trainer's old log-probs
as the behaviour policy, and where the two disagree (another engine's kernels, another precision) each token's
policy-gradient term is weighted by trainer / sampler probability, kept within [low, high]."""

from __future__ import annotations

from torch import Tensor
import torch

SAMPLER_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def sampler_correction_weights(trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, mode: str,
                               low: float, high: float) -> Tensor:
    """(B, T) weights on the response tokens (0 elsewhere). token_*: exp(log p_trainer - log p_sampler) of each
    token; sequence_*: of the whole response (the sum over its tokens), on every one of its tokens. *_truncate:
    clamped to [low, high]; *_mask: as they are inside [low, high], 0 outside (those tokens / responses drop out).
    Equal log-probs give weights of exactly 1."""
    if mode not in SAMPLER_CORRECTIONS[1:]:
        raise ValueError(f"unknown sampler correction {mode!r}: expected one of {SAMPLER_CORRECTIONS[1:]}")
    log_ratio = torch.where(mask, trainer_logprobs - sampler_logprobs, torch.zeros_like(trainer_logprobs))
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(log_ratio)
    ratio = torch.exp(log_ratio)
    if mode.endswith("truncate"):
        weights = ratio.clamp(min=low, max=high)
    else:
        weights = torch.where((ratio >= low) & (ratio <= high), ratio, torch.zeros_like(ratio))
    return torch.where(mask, weights, torch.zeros_like(weights))
