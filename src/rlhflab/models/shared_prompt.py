"""Response logits with each distinct prompt computed once: the lean forward for k answers per prompt.

GRPO, RLOO, online DPO (and REINFORCE with `num_generations`) answer every prompt k times, so a batch
holds each prompt k times over. A plain forward runs the prompt k times in the policy's forward (with
its backward) and again in the reference's; here the prompt's keys and values are computed once per
distinct prompt and each answer attends to them. Same math, different summation order: the gradient
through a shared prompt is the sum over its answers, as it is when every copy runs on its own
(tests/models/test_shared_prompt.py holds both to ~1e-6). Llama layout only (`models.lean`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhflab.models.lean import LeanPlan, _rope, causal_allowed, rotary_tables
from rlhflab.models.prompt_pass import prompt_pass


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


@dataclass
class _Chunk:
    """Rows of similar answer length, run as one block cut at their longest answer."""

    rows: Tensor  # (b,) rows of the batch
    prompt: Tensor  # (b,) each row's distinct prompt
    ids: Tensor  # (b, t) answer tokens
    allowed: Tensor  # (b, 1, t, P + t) keys each answer token reads
    cos: Tensor
    sin: Tensor
    h: Tensor  # (b, t, H) the running hidden states


def _chunks(plan: LeanPlan, query_mask: Tensor, response_ids: Tensor, response_mask: Tensor, inverse: Tensor,
            count: int) -> list[_Chunk]:
    """The batch's rows sorted by answer length, cut into `count` blocks: answers are padded to the longest
    in their block only (a batch's mean answer is often a third of its longest)."""
    lengths = response_mask.sum(dim=1)
    chunks = []
    for rows in torch.argsort(lengths, stable=True).chunk(count):
        t = max(int(lengths[rows].max()), 1)
        ids, mask, prompt_mask = response_ids[rows, :t], response_mask[rows, :t], query_mask[rows]
        positions = prompt_mask.long().sum(dim=1, keepdim=True) + torch.arange(t, device=ids.device)
        cos, sin = rotary_tables(plan, positions)
        # an answer token reads its prompt's real tokens and the real answer tokens up to itself
        allowed = torch.cat([prompt_mask.bool()[:, None, :].expand(len(rows), t, prompt_mask.shape[1]),
                             causal_allowed(mask)], dim=2).unsqueeze(1)
        embedded = F.embedding(ids, plan.embed, padding_idx=plan.padding_idx)
        chunks.append(_Chunk(rows, inverse[rows], ids, allowed, cos, sin, embedded))
    return chunks


def shared_prompt_logits(plan: LeanPlan, query_ids: Tensor, query_mask: Tensor, response_ids: Tensor,
                         response_mask: Tensor, first: Tensor, inverse: Tensor) -> Tensor:
    """(B, T, V) logits predicting each response token (those at the last prompt position and at every
    response token but the last), the prompts run once per distinct prompt (`distinct_prompts`); 0 past
    a row's block (see `_chunks`; those positions are past its answer, masked by every caller).

    The left-padded prompts (B, P) and right-padded responses (B, T) are the rollout's; attention is
    causal over real tokens, as `lean_hidden` on the joined rows."""
    heads, kv_heads, dim = plan.num_heads, plan.num_kv_heads, plan.head_dim
    prompt_mask = query_mask[first]
    prompt_positions = (prompt_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    prompts = prompt_pass(plan, query_ids[first], prompt_mask, prompt_positions)
    batch, t = response_ids.shape
    chunks = _chunks(plan, query_mask, response_ids, response_mask, inverse, max(1, min(4, batch // 8)))
    gqa = heads != kv_heads
    for layer, k_prompt, v_prompt in zip(plan.layers, prompts.keys, prompts.values):
        for c in chunks:
            rows, length = len(c.rows), c.ids.shape[1]
            x = layer.input_norm(c.h)
            q = _rope(layer.q(x).view(rows, length, heads, dim).transpose(1, 2), c.cos, c.sin)
            k = _rope(layer.k(x).view(rows, length, kv_heads, dim).transpose(1, 2), c.cos, c.sin)
            k = torch.cat([k_prompt[c.prompt], k], dim=2)
            v = torch.cat([v_prompt[c.prompt], layer.v(x).view(rows, length, kv_heads, dim).transpose(1, 2)], dim=2)
            out = _attention(q, k, v, c.allowed, layer.scaling, gqa)
            c.h = _feed_forward(layer, c.h + layer.o(out.transpose(1, 2).reshape(rows, length, heads * dim)))
    last_prompt = prompts.last_hidden.unsqueeze(1)  # (N, 1, H): predicts the first response token
    blocks = [F.pad(plan.lm_head(torch.cat([last_prompt[c.prompt], plan.norm(c.h[:, :-1])], dim=1)),
                    (0, 0, 0, t - c.ids.shape[1])) for c in chunks]
    order = torch.cat([c.rows for c in chunks])
    return torch.cat(blocks)[torch.argsort(order)]


def _feed_forward(layer, h: Tensor) -> Tensor:
    x = layer.post_norm(h)
    return h + layer.down(layer.act(layer.gate(x)) * layer.up(x))
