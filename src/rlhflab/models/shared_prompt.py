"""Response logits with each distinct prompt computed once: the lean forward for k answers per prompt.

GRPO, RLOO, online DPO (and REINFORCE with `num_generations`) answer every prompt k times, so a batch
holds each prompt k times over. A plain forward runs the prompt k times in the policy's forward (with
its backward) and again in the reference's; here the prompt's keys and values are computed once per
distinct prompt and each answer attends to them. Same math, different summation order: the gradient
through a shared prompt is the sum over its answers, as it is when every copy runs on its own
(tests/models/test_shared_prompt.py holds both to ~1e-6). Llama layout only (`models.lean`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhflab.models.lean import LeanPlan, _rope, causal_allowed, rotary_tables


def distinct_prompts(query_ids: Tensor, query_mask: Tensor) -> tuple[Tensor, Tensor] | None:
    """(first row of each distinct prompt (N,), each row's prompt number (B,)), or None when no prompt
    repeats (then there is nothing to share)."""
    keyed = torch.cat([query_ids, query_mask.long()], dim=1)
    unique, inverse = torch.unique(keyed, dim=0, return_inverse=True)
    if unique.shape[0] == keyed.shape[0]:
        return None
    first = torch.full((unique.shape[0],), keyed.shape[0], dtype=torch.long, device=keyed.device)
    first = first.scatter_reduce(0, inverse, torch.arange(keyed.shape[0], device=keyed.device), "amin")
    return first, inverse


def _attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scaling: float, gqa: bool) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling, enable_gqa=gqa)


def shared_prompt_logits(plan: LeanPlan, query_ids: Tensor, query_mask: Tensor, response_ids: Tensor,
                         response_mask: Tensor, first: Tensor, inverse: Tensor) -> Tensor:
    """(B, T, V) logits predicting each response token (those at the last prompt position and at every
    response token but the last), the prompts run once per distinct prompt (`distinct_prompts`).

    The left-padded prompts (B, P) and right-padded responses (B, T) are the rollout's; attention is
    causal over real tokens, as `lean_hidden` on the joined rows."""
    heads, kv_heads, dim = plan.num_heads, plan.num_kv_heads, plan.head_dim
    prompt_ids, prompt_mask = query_ids[first], query_mask[first]
    n, p = prompt_ids.shape
    batch, t = response_ids.shape
    prompt_positions = (prompt_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    response_positions = query_mask.long().sum(dim=1, keepdim=True) + torch.arange(t, device=response_ids.device)
    prompt_cos, prompt_sin = rotary_tables(plan, prompt_positions)
    cos, sin = rotary_tables(plan, response_positions)
    prompt_allowed = causal_allowed(prompt_mask).unsqueeze(1)  # (N, 1, P, P)
    # a response token reads its prompt's real tokens and the real response tokens up to itself
    own = causal_allowed(response_mask)  # (B, T, T)
    allowed = torch.cat([query_mask.bool()[:, None, :].expand(batch, t, p), own], dim=2).unsqueeze(1)
    gqa = heads != kv_heads
    h_prompt = F.embedding(prompt_ids, plan.embed)
    h = F.embedding(response_ids, plan.embed)
    for layer in plan.layers:
        x = layer.input_norm(h_prompt)
        q = _rope(layer.q(x).view(n, p, heads, dim).transpose(1, 2), prompt_cos, prompt_sin)
        k_prompt = _rope(layer.k(x).view(n, p, kv_heads, dim).transpose(1, 2), prompt_cos, prompt_sin)
        v_prompt = layer.v(x).view(n, p, kv_heads, dim).transpose(1, 2)
        attn = _attention(q, k_prompt, v_prompt, prompt_allowed, layer.scaling, gqa)
        x = layer.input_norm(h)
        q = _rope(layer.q(x).view(batch, t, heads, dim).transpose(1, 2), cos, sin)
        k = torch.cat([k_prompt[inverse], _rope(layer.k(x).view(batch, t, kv_heads, dim).transpose(1, 2), cos, sin)], 2)
        v = torch.cat([v_prompt[inverse], layer.v(x).view(batch, t, kv_heads, dim).transpose(1, 2)], dim=2)
        response_attn = _attention(q, k, v, allowed, layer.scaling, gqa)
        h_prompt = _feed_forward(layer, h_prompt + layer.o(attn.transpose(1, 2).reshape(n, p, heads * dim)))
        h = _feed_forward(layer, h + layer.o(response_attn.transpose(1, 2).reshape(batch, t, heads * dim)))
    last_prompt = plan.norm(h_prompt[:, -1:])[inverse]  # (B, 1, H): predicts the first response token
    return plan.lm_head(torch.cat([last_prompt, plan.norm(h[:, :-1])], dim=1))


def _feed_forward(layer, h: Tensor) -> Tensor:
    x = layer.post_norm(h)
    return h + layer.down(layer.act(layer.gate(x)) * layer.up(x))
