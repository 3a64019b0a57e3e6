"""Sequences that share a prompt, scored with each prompt computed once: a reward model's batch.

A reward model's training rows on the built-in suite hold each prompt several times over: its
reference answer against three kinds of rejected answer, the policy's own failing answers, two of
its sampled answers for the calibration term. Prompts run ~30 tokens, answers ~7, so scoring the
rows even two by two (models/packing.py: one row per pair) still runs each prompt once per pair,
~2.8x the tokens of running it once. Here the distinct sequences of one prompt form one group,

    shared prefix | rest of sequence 1 | rest of sequence 2 | ... | rest of sequence k

in which each rest reads the prefix and its own earlier tokens, never another rest, at the
positions it would have alone. Groups are packed back to back into few rows (`fill_into_rows`, as
the prompt pass packs prompts), and the last layer runs at the sequences' last tokens only, where
the score is read. Same math as scoring each sequence on its own, up to float summation order
(tests/models/test_prompt_groups.py); the gradient through a shared prefix is the sum over its
sequences, as it is when every copy runs alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlhflab.models.packing import common_prefix_length
from rlhflab.models.prompt_pass import packed_groups as fill_into_rows


@dataclass(frozen=True)
class PackedGroups:
    """Groups of sequences as R rows of width W."""

    input_ids: Tensor  # (R, W) long: each group's prefix, then its sequences' rests; pad_id after the last group
    position_ids: Tensor  # (R, W) long: each sequence's own positions (0 on padding)
    group: Tensor  # (R, W) long: each slot's group; -1 on padding
    part: Tensor  # (R, W) long: 0 on a group's prefix, j + 1 on its sequence j's rest
    read: Tensor  # (R, m) long: the columns of each row's sequences' last tokens (a row's first repeats to fill)
    score_index: Tensor  # (N,) long: sequence n's place in the flat (R * m) reads; n counts the groups' sequences in order

    def allowed(self, device: torch.device | str = "cpu") -> Tensor:
        """(R, W, W) bool on `device` (`group_mask`)."""
        return group_mask(self.group.to(device), self.part.to(device))


def group_mask(group: Tensor, part: Tensor) -> Tensor:
    """(R, W) group ids (-1 = padding) and parts (0 = the shared prefix, j + 1 = continuation j) -> (R, W, W) bool:
    a token reads the earlier tokens of its group's prefix and of its own part; padding reads itself."""
    width, device = group.shape[1], group.device
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    same_group = (group[:, :, None] == group[:, None, :]) & (group[:, None, :] >= 0)
    own_part = (part[:, None, :] == 0) | (part[:, None, :] == part[:, :, None])
    return (causal & same_group & own_part) | torch.eye(width, dtype=torch.bool, device=device)


def group_prefix_length(sequences: list[list[int]]) -> int:
    """Tokens every sequence of a group shares at the start, leaving each at least one token of its own (its
    last token, where the score is read, must be its own)."""
    first = sequences[0]
    shared = min(common_prefix_length(first, s) for s in sequences[1:]) if len(sequences) > 1 else len(first)
    return min(shared, min(map(len, sequences)) - 1)


def pack_groups(groups: list[list[list[int]]], pad_id: int) -> PackedGroups:
    """Pack groups of non-empty token sequences (see module doc); the sequences are numbered group by group."""
    if not groups or any(not g or not all(g) for g in groups):
        raise ValueError("pack_groups needs at least one group, each of non-empty sequences")
    prefixes = [group_prefix_length(g) for g in groups]
    sizes = [k + sum(len(s) - k for s in g) for k, g in zip(prefixes, groups)]
    rows, width = fill_into_rows(sizes)
    ids, positions = [pad_id] * (len(rows) * width), [0] * (len(rows) * width)
    group_of, part_of = [-1] * (len(rows) * width), [0] * (len(rows) * width)  # -1: padding; 0: the prefix
    ends: list[list[int]] = [[] for _ in rows]  # each row's last-token columns, in the sequences' order
    read_at = {}  # (group, j) -> (row, its place among the row's ends)
    for r, members in enumerate(rows):
        slot = r * width
        for g in members:
            k = prefixes[g]
            _place(ids, positions, group_of, part_of, slot, groups[g][0][:k], 0, g, 0)
            slot += k
            for j, sequence in enumerate(groups[g]):
                rest = sequence[k:]
                _place(ids, positions, group_of, part_of, slot, rest, k, g, j + 1)
                slot += len(rest)
                read_at[g, j] = (r, len(ends[r]))
                ends[r].append(slot - 1 - r * width)
    m = max(map(len, ends))
    score_index = [read_at[g, j][0] * m + read_at[g, j][1] for g, group in enumerate(groups) for j in range(len(group))]
    read = [cols + [cols[0]] * (m - len(cols)) for cols in ends]
    shape = (len(rows), width)
    return PackedGroups(torch.tensor(ids).view(shape), torch.tensor(positions).view(shape),
                        torch.tensor(group_of).view(shape), torch.tensor(part_of).view(shape), torch.tensor(read),
                        torch.tensor(score_index))


def _place(ids: list[int], positions: list[int], group_of: list[int], part_of: list[int], slot: int,
           tokens: list[int], position: int, group: int, part: int) -> None:
    """Lay `tokens` from flat slot `slot` on: their ids, positions from `position`, their group and part."""
    end = slot + len(tokens)
    ids[slot:end] = tokens
    positions[slot:end] = range(position, position + len(tokens))
    group_of[slot:end] = [group] * len(tokens)
    part_of[slot:end] = [part] * len(tokens)

