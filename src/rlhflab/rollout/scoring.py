"""Forward passes over (query + response) that give per-response-token numbers.

A model-agnostic reference implementation (e.g. for evaluating a saved model's
log-probs); PPO's roles (`rollout/roles.py`) build their inputs the same way,
through `joined`, and a test checks both against left-padding changes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhflab import models
from rlhflab.data import position_ids_from_mask


def response_logits(
    model: torch.nn.Module, query_ids: Tensor, query_mask: Tensor, response_ids: Tensor, response_mask: Tensor
) -> Tensor | models.HeadInputs:
    """What predicts each response token: (B, T) positions of `models.HeadInputs` (the model's final hidden states
    and output layer; its logits are `head(hidden)`), or (B, T, V) logits where the model's output layer is not a
    plain one (models/token_head.py).

    query_ids/query_mask: (B, P), left-padded; response_ids/response_mask: (B, T).
    Position ids count real tokens only, so left padding cannot shift them.
    """
    input_ids = torch.cat([query_ids, response_ids], dim=1)  # (B, P+T)
    attention = torch.cat([query_mask, response_mask], dim=1).long()
    positions = position_ids_from_mask(attention)
    scores = models.head_inputs(model, input_ids, attention, positions)
    prompt_len = query_ids.shape[1]
    return scores[:, prompt_len - 1 : -1]  # position t-1 predicts token t


def response_logprobs(
    model: torch.nn.Module,
    query_ids: Tensor,
    query_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    temperature: float = 1.0,
) -> Tensor:
    """log pi(a_t | s_t) for every response token, chunked over the vocabulary when it is large. -> (B, T); 0 where
    response_mask is False."""
    scores = response_logits(model, query_ids, query_mask, response_ids, response_mask)
    logprobs = models.token_logprobs(scores, response_ids, temperature)
    return logprobs.masked_fill(~response_mask, 0.0)
