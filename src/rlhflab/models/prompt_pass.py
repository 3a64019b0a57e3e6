"""The prompt pass of generation and of the k-answers forward: distinct prompts packed, the last layer at their ends.

Both the prefill (models/lean_decoder.py) and the forward that runs each distinct prompt once for its k
answers (models/shared_prompt.py) need the same two things from the prompts: every layer's keys and
values, in the left-padded (N, P) layout the answers' attention reads, and the final hidden state at
each prompt's last token. Here
- the prompts are packed into few rows (models/packed_sequences.py's best fit, `packed_groups`), each token reading only its own prompt's earlier tokens with its own positions: a
  batch of the built-in suite's prompts (12-54 tokens) is ~40 % padding when left-padded;
- the last layer runs its queries, attention output and MLP at the prompts' last tokens only
  (`lean_hidden`'s `read`): the answers read the other positions through their keys and values only.
The numbers are those of the padded pass up to float summation order (tests/models/test_prompt_pass.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlhflab.models.lean import LeanPlan, causal_allowed, lean_hidden
from rlhflab.models.packed_sequences import fill_rows

# Pack only when it saves at least this share of the padded tokens: a packed row's attention mask is
# built per call and its keys are copied back to the padded layout, which a few tokens do not repay.
PACK_WHEN_SAVING = 0.1
ROW_WIDTHS = (1.0, 1.25, 1.5, 1.75, 2.0)  # packed rows up to these multiples of the longest prompt (`packed_groups`)
# `packed_groups` weighs a layout of R rows of width W as R * W * (W + ATTENTION_KEYS): a token's projections and
# MLP cost about what its attention over ATTENTION_KEYS keys costs (masked attention runs every key of its row).
# On the GRPO benchmark's rollouts (1 thread), 100-400 all gave the same layouts and a k-answers forward with its
# backward 62.5 ms (median of 8) against 67.4 when the fewest tokens in all (R * W) chose
ATTENTION_KEYS = 200


@dataclass(frozen=True)
class PromptRows:
    """N left-padded prompts (N, P) as the R rows (R, W) a prompt pass runs."""

    input_ids: Tensor  # (R, W)
    position_ids: Tensor  # (R, W)
    allowed: Tensor  # (R, W, W) bool: query i may read key j
    read: Tensor  # (R, m) columns of the prompts' last tokens in each row (repeated to fill)
    last: Tensor  # (N,) prompt n's last token as a flat index into (R, m)
    slots: Tensor | None  # (N, P) each padded slot's flat index into (R * W); 0 on padding; None: rows == prompts


def prompt_rows(query_ids: Tensor, query_mask: Tensor, positions: Tensor, pad_id: int) -> PromptRows:
    """The rows of a prompt pass over left-padded prompts: packed when that saves PACK_WHEN_SAVING of the tokens,
    else the prompts themselves."""
    count, width = query_ids.shape
    device = query_ids.device
    lengths = query_mask.sum(dim=1).tolist()
    groups, longest = packed_groups(lengths)
    # an empty prompt has no last token of its own in a packed row: such a batch runs as it is
    if min(lengths) == 0 or len(groups) * longest > (1 - PACK_WHEN_SAVING) * count * width:
        read = torch.full((count, 1), width - 1, dtype=torch.long, device=device)
        return PromptRows(query_ids, positions, causal_allowed(query_mask), read,
                          torch.arange(count, device=device), None)
    slots = torch.zeros((count, width), dtype=torch.long)
    segment = torch.full((len(groups), longest), -1, dtype=torch.long)  # which prompt of the row; -1 = padding
    ends = [[] for _ in groups]
    for row, members in enumerate(groups):
        start = 0
        for n in members:
            size = lengths[n]
            slots[n, width - size:] = torch.arange(row * longest + start, row * longest + start + size)
            segment[row, start:start + size] = n
            start += size
            ends[row].append(start - 1)
    slots, segment = slots.to(device), segment.to(device)
    real = query_mask.bool()
    input_ids = query_ids.new_full((len(groups) * longest,), pad_id).index_put_((slots[real],), query_ids[real])
    position_ids = positions.new_zeros((len(groups) * longest,)).index_put_((slots[real],), positions[real])
    causal = torch.ones(longest, longest, dtype=torch.bool, device=device).tril()
    allowed = (causal & (segment[:, :, None] == segment[:, None, :]) & (segment[:, None, :] >= 0)) \
        | torch.eye(longest, dtype=torch.bool, device=device)  # a padding query reads itself only
    m = max(len(e) for e in ends)
    read = torch.tensor([e + [e[0]] * (m - len(e)) for e in ends], dtype=torch.long, device=device)
    # prompt n's last token sits at row slots[n, -1] // W, column slots[n, -1] % W: its place in `read`
    row_of, column_of = slots[:, -1] // longest, slots[:, -1] % longest
    place = (read[row_of] == column_of[:, None]).long().argmax(dim=1)
    return PromptRows(input_ids.view(len(groups), longest), position_ids.view(len(groups), longest), allowed, read,
                      row_of * m + place, slots)


def packed_groups(lengths: list[int]) -> tuple[list[list[int]], int]:
    """The prompts grouped into rows (`fill_rows`) and the row width: of rows up to 1 ... 2 times the longest
    prompt, the layout with the least work by ATTENTION_KEYS' measure (rows no longer than the longest prompt
    leave much space unfilled when a batch has a few long prompts; a row's attention grows with its square)."""
    longest = max(max(lengths), 1)
    best = None
    for factor in ROW_WIDTHS:
        groups = fill_rows(lengths, int(longest * factor))
        width = max(max(sum(lengths[n] for n in g) for g in groups), 1)
        work = len(groups) * width * (width + ATTENTION_KEYS)
        if best is None or work < best[0]:
            best = (work, groups, width)
    return best[1], best[2]


@dataclass(frozen=True)
class PromptPass:
    last_hidden: Tensor  # (N, H) final-norm hidden state at each prompt's last token
    keys: list[Tensor]  # per layer (N, H_kv, P, D), rotated, in the left-padded layout
    values: list[Tensor]  # per layer (N, H_kv, P, D)


def prompt_pass(plan: LeanPlan, query_ids: Tensor, query_mask: Tensor, positions: Tensor) -> PromptPass:
    """Run N left-padded prompts (N, P) (see module doc). Differentiable when grad is on."""
    pad_id = plan.padding_idx if plan.padding_idx is not None else 0
    rows = prompt_rows(query_ids, query_mask, positions, pad_id)
    kv: list[tuple[Tensor, Tensor]] = []
    hidden = lean_hidden(plan, rows.input_ids, None, rows.position_ids, allowed=rows.allowed, read=rows.read,
                         kv_keep=kv)  # (R, m, H)
    last_hidden = hidden.reshape(-1, hidden.shape[-1])[rows.last]
    if rows.slots is None:
        return PromptPass(last_hidden, [k for k, _ in kv], [v for _, v in kv])
    return PromptPass(last_hidden, [padded(k, rows.slots) for k, _ in kv], [padded(v, rows.slots) for _, v in kv])


def padded(t: Tensor, slots: Tensor) -> Tensor:
    """(R, H_kv, W, D) keys or values of packed rows -> (N, H_kv, P, D) in the prompts' left-padded layout."""
    rows, heads, width, dim = t.shape
    flat = t.transpose(1, 2).reshape(rows * width, heads, dim).index_select(0, slots.reshape(-1))
    return flat.view(*slots.shape, heads, dim).transpose(1, 2)
