"""Token log-probabilities and entropy from logits.

The log-prob of token t comes from the logits at position t-1, divided by the
same temperature used for sampling (DESIGN.md, correctness rules).
"""

from __future__ import annotations

import torch
from torch import Tensor


def selective_log_softmax(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature) picked at `tokens`.

    logits: (B, T, V); tokens: (B, T) -> (B, T), float32 whatever the logits' dtype:
    in bf16 a log-prob near -4 moves in steps of ~0.03, which would put noise of the
    order of the clip range into ratios and KL. logsumexp avoids a (B, T, V) log-softmax.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = torch.gather(logits, dim=-1, index=tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / temperature) per position. (B, T, V) -> (B, T), float32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def shifted_token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-prob of each token given the ones before it.

    logits: (B, L, V) from a forward pass over input_ids (B, L) -> (B, L-1),
    where entry j is log p(input_ids[:, j+1] | input_ids[:, :j+1]).
    """
    return selective_log_softmax(logits[:, :-1], input_ids[:, 1:], temperature)
