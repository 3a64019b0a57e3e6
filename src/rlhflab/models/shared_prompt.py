"""Response logits with each distinct prompt computed once: the lean forward for k answers per prompt.

GRPO, RLOO, online DPO (and REINFORCE with `num_generations`) answer every prompt k times, so a batch
holds each prompt k times over. A plain forward runs the prompt k times in the policy's forward (with
its backward) and again in the reference's. Here each distinct prompt and its k answers form one group,

    prompt | answer 1 | answer 2 | ... | answer k

in which every answer token reads the prompt and its own answer's earlier tokens, never another answer,
with the positions it would have after its prompt alone. Groups are packed back to back into few rows
(`packed_groups`, as the prompt pass packs prompts), so no position is padding but a row's tail, and
each layer runs as a handful of ops on all answers at once. The last layer runs at the positions whose
logits are read only (each prompt's last token, each answer token but its last). Same math, different
summation order: the gradient through a shared prompt is the sum over its answers, as it is when every
copy runs on its own (tests/models/test_shared_prompt.py holds both to ~1e-6). Llama layout only
(`models.lean`).

Measured on the GRPO benchmark's model (d 128, 4 layers, 8 prompts x 4 sampled answers, 1 thread): a
forward 22-25 ms and a forward with its backward 63-73 ms, against 35 and 99-111 ms when the answers ran
in four length-sorted padded blocks beside separately computed prompt keys.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhflab.models.lean import LeanPlan, lean_hidden
from rlhflab.models.prompt_groups import group_mask
from rlhflab.models.prompt_pass import packed_groups
from rlhflab.models.token_head import HeadInputs


def distinct_prompts(query_ids: Tensor, query_mask: Tensor, every: bool = False) -> tuple[Tensor, Tensor] | None:
    """(first row of each distinct prompt (N,), each row's prompt number (B,)), or None when no prompt
    repeats (then there is nothing to share) unless `every`: then groups of one answer each, whose packed rows
    hold no padding but a row's tail (k = 1 rollouts; numbered in the same sorted order, so the layout
    depends on which rows a batch holds, not their order)."""
    keyed = torch.cat([query_ids, query_mask.long()], dim=1)
    unique, inverse = torch.unique(keyed, dim=0, return_inverse=True)
    if unique.shape[0] == keyed.shape[0] and not every:
        return None
    first = torch.full((unique.shape[0],), keyed.shape[0], dtype=torch.long, device=keyed.device)
    first = first.scatter_reduce(0, inverse, torch.arange(keyed.shape[0], device=keyed.device), "amin")
    return first, inverse


@dataclass(frozen=True)
class AnswerRows:
    """The rollout's groups (a prompt and its answers) packed into R rows of width W."""

    input_ids: Tensor  # (R, W)
    position_ids: Tensor  # (R, W): a prompt's own positions from 0, its answers' continuing after it
    allowed: Tensor  # (R, W, W) bool: query i may read key j
    read: Tensor  # (R, m) columns whose logits are read (repeats fill a row)
    logit_index: Tensor  # (B, T) each response position's logits as a flat index into (R * m + 1); R * m = zeros


def _long(values: list[int], device: torch.device) -> Tensor:
    """A 1-D long tensor of a Python list (through an array: ~10x faster than torch.tensor at a rollout's sizes)."""
    return torch.frombuffer(array("q", values), dtype=torch.long).to(device) if values else \
        torch.zeros(0, dtype=torch.long, device=device)


class _Layout:
    """Where each token of each group goes, laid group by group in Python (a rollout has a few dozen answers)."""

    def __init__(self, rows: int, width: int):
        self.width = width
        self.slots: list[int] = []  # flat slots in (R * W) of every real token
        self.sources: list[int] = []  # each one's flat index into the prompts (N * P) + the responses (B * T)
        self.group = [-1] * (rows * width)  # each slot's group; -1 = padding
        self.part = [0] * (rows * width)  # 0 = the prompt, j + 1 = answer j
        self.positions = [0] * (rows * width)
        self.read: list[list[int]] = [[] for _ in range(rows)]

    def place(self, slot: int, source: int, count: int, group: int, part: int, position: int) -> range:
        span = range(slot, slot + count)
        self.slots.extend(span)
        self.sources.extend(range(source, source + count))
        self.group[slot:slot + count] = [group] * count
        self.part[slot:slot + count] = [part] * count
        self.positions[slot:slot + count] = range(position, position + count)
        return span

    def read_at(self, row: int, slots: range) -> int:
        """Read these slots of `row`; the index of the first among the row's reads."""
        at = len(self.read[row])
        self.read[row].extend(s - row * self.width for s in slots)
        return at


def answer_rows(query_ids: Tensor, query_mask: Tensor, response_ids: Tensor, response_mask: Tensor,
                first: Tensor, inverse: Tensor, pad_id: int) -> AnswerRows:
    """Pack the left-padded prompts (B, P) and right-padded responses (B, T) of a rollout into group rows (see
    module doc); `first` / `inverse` from `distinct_prompts`. Every prompt needs a real token."""
    prompts, prompt_width = query_ids[first], query_ids.shape[1]
    batch, answer_width = response_ids.shape
    prompt_lengths = query_mask[first].sum(dim=1).tolist()
    answer_lengths = response_mask.sum(dim=1).tolist()
    group_of = inverse.tolist()
    # the layout depends on which rows the batch holds, not their order (distinct prompts come numbered in
    # torch.unique's sorted order; a group's answers go in the order of their tokens): a shuffled batch gives
    # the same numbers bit for bit, so a training pass over the rollout's rows in any order has ratio exactly 1
    tokens_of = [tuple(row[:n]) for row, n in zip(response_ids.tolist(), answer_lengths)]
    answers_of = [sorted((b for b, g in enumerate(group_of) if g == n), key=tokens_of.__getitem__)
                  for n in range(len(prompt_lengths))]
    sizes = [p + sum(answer_lengths[b] for b in answers_of[n]) for n, p in enumerate(prompt_lengths)]
    groups, width = packed_groups(sizes)
    layout = _Layout(len(groups), width)
    responses_at = prompts.numel()  # responses follow the prompts in the sources' numbering
    prompt_read, answer_read = {}, {}  # group -> (row, read index) of its last prompt token; answer -> its first's
    for r, members in enumerate(groups):
        slot = r * width
        for n in members:
            length = prompt_lengths[n]
            span = layout.place(slot, n * prompt_width + prompt_width - length, length, n, 0, 0)
            prompt_read[n] = (r, layout.read_at(r, span[-1:]))
            slot += length
            for j, b in enumerate(answers_of[n]):
                span = layout.place(slot, responses_at + b * answer_width, answer_lengths[b], n, j + 1, length)
                answer_read[b] = (r, layout.read_at(r, span[:-1]))  # an answer's last token predicts nothing
                slot += answer_lengths[b]
    device, rows = query_ids.device, len(groups)
    tokens = torch.cat([prompts.reshape(-1), response_ids.reshape(-1)])
    ids = torch.full((rows * width,), pad_id, dtype=torch.long, device=device)
    ids[_long(layout.slots, device)] = tokens[_long(layout.sources, device)]
    m = max(max(len(r) for r in layout.read), 1)
    read = _long([c for r in layout.read for c in r + [r[0] if r else 0] * (m - len(r))], device).view(rows, m)
    index = _logit_index(group_of, prompt_read, answer_read, answer_lengths, m, rows * m, answer_width)
    return AnswerRows(ids.view(rows, width), _long(layout.positions, device).view(rows, width),
                      _allowed(layout, device), read, _long(index, device).view(batch, answer_width))


def _logit_index(group_of: list[int], prompt_read: dict, answer_read: dict, answer_lengths: list[int], m: int,
                 zero: int, answer_width: int) -> list[int]:
    """(B, T) flat, each response position's read index in (R * m): `zero` (the zero row) past an answer."""
    index = []
    for b, n in enumerate(group_of):
        r, c = prompt_read[n]
        index.append(r * m + c)  # the prompt's last token predicts every answer's first
        r, c = answer_read[b]
        predicted = max(answer_lengths[b] - 1, 0)  # answer tokens 1 .. n-1 are predicted from tokens 0 .. n-2
        index += list(range(r * m + c, r * m + c + predicted)) + [zero] * (answer_width - 1 - predicted)
    return index


def _allowed(layout: _Layout, device: torch.device) -> Tensor:
    """(R, W, W): a token reads the earlier tokens of its group's prompt and of its own part; padding itself."""
    rows, width = len(layout.read), layout.width
    return group_mask(_long(layout.group, device).view(rows, width), _long(layout.part, device).view(rows, width))


def shared_prompt_logits(plan: LeanPlan, query_ids: Tensor, query_mask: Tensor, response_ids: Tensor,
                         response_mask: Tensor, first: Tensor, inverse: Tensor) -> HeadInputs:
    """What predicts each response token, (B, T) positions of `HeadInputs` (the final hidden states at the last
    prompt position and at every response token but the last, with the LM head), each distinct prompt
    (`distinct_prompts`) run once in its group (see module doc); zero states past a row's answer (positions every
    caller masks). The left-padded prompts (B, P) and right-padded responses (B, T) are the rollout's; every
    prompt needs a real token."""
    pad_id = plan.padding_idx if plan.padding_idx is not None else 0
    rows = answer_rows(query_ids, query_mask, response_ids, response_mask, first, inverse, pad_id)
    hidden = lean_hidden(plan, rows.input_ids, None, rows.position_ids, allowed=rows.allowed, read=rows.read)
    flat = hidden.reshape(-1, hidden.shape[-1])  # (R * m, H)
    picked = torch.cat([flat, flat.new_zeros(1, flat.shape[1])]).index_select(0, rows.logit_index.reshape(-1))
    return HeadInputs.of(picked.view(*rows.logit_index.shape, flat.shape[1]), plan.lm_head)
