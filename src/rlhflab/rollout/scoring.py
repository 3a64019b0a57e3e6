"""Forward passes over (query + response) that give per-response-token numbers.

A model-agnostic reference implementation (e.g. for evaluating a saved model's
log-probs); PPO's roles (`rollout/roles.py`) build their inputs the same way,
through `joined`, and a test checks both against left-padding changes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhflab.core.logprobs import selective_log_softmax
from rlhflab.data import position_ids_from_mask


def response_logits(
    model: torch.nn.Module, query_ids: Tensor, query_mask: Tensor, response_ids: Tensor, response_mask: Tensor
) -> Tensor:
    """Logits that predict each response token. -> (B, T, V).

    query_ids/query_mask: (B, P), left-padded; response_ids/response_mask: (B, T).
    Position ids count real tokens only, so left padding cannot shift them.
    """
    input_ids = torch.cat([query_ids, response_ids], dim=1)  # (B, P+T)
    attention = torch.cat([query_mask, response_mask], dim=1).long()
    positions = position_ids_from_mask(attention)
    logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions).logits
    prompt_len = query_ids.shape[1]
    return logits[:, prompt_len - 1 : -1]  # logits at t-1 predict token t


def response_logprobs(
    model: torch.nn.Module,
    query_ids: Tensor,
    query_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    temperature: float = 1.0,
) -> Tensor:
    """log pi(a_t | s_t) for every response token. -> (B, T); 0 where response_mask is False."""
    logits = response_logits(model, query_ids, query_mask, response_ids, response_mask)
    logprobs = selective_log_softmax(logits, response_ids, temperature)
    return logprobs.masked_fill(~response_mask, 0.0)
