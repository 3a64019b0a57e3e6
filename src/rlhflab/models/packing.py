"""Two sequences that share a prefix, packed into one row that computes the prefix once.

A reward-model pair is prompt + chosen and prompt + rejected: on the built-in suite the
shared part is ~86 % of each sequence, so scoring the two separately spends most of the
work twice. Packed, a row is

    shared prefix | rest of the first sequence | rest of the second sequence | padding

with positions that restart for the second rest where the prefix ends, and an attention mask
that lets each rest read the prefix and its own earlier tokens but never the other rest.
With causal attention and rotary positions, every token then sees exactly what it would see
in its own unpacked sequence, so the hidden states (and a score read at a last token) are
the same up to float summation order (tests/models/test_packing.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

PREFIX, FIRST, SECOND, PAD = 0, 1, 2, -1  # segment ids


@dataclass(frozen=True)
class PackedPairs:
    input_ids: Tensor  # (B, L) long: prefix, first's rest, second's rest, pad_id
    position_ids: Tensor  # (B, L) long: each sequence's own positions (0 on padding)
    allowed: Tensor  # (B, L, L) bool: query i may read key j
    first_last: Tensor  # (B,) long: index of the first sequence's last token
    second_last: Tensor  # (B,) long: index of the second sequence's last token


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def packed_length(a: list[int], b: list[int]) -> int:
    """Tokens in the packed row of `a` and `b` (before padding)."""
    return len(a) + len(b) - common_prefix_length(a, b)


class PackedRow(NamedTuple):
    ids: list[int]
    segments: list[int]  # PREFIX / FIRST / SECOND per token
    positions: list[int]
    first_last: int  # index of a's last token
    second_last: int  # index of b's last token


def packed_row(a: list[int], b: list[int]) -> PackedRow:
    """One pair's row before padding: shared prefix, a's rest, b's rest (see module doc)."""
    k = common_prefix_length(a, b)
    second_last = len(a) + len(b) - k - 1 if len(b) > k else len(b) - 1  # b may lie wholly inside the prefix
    return PackedRow(ids=a + b[k:],
                     segments=[PREFIX] * k + [FIRST] * (len(a) - k) + [SECOND] * (len(b) - k),
                     positions=list(range(len(a))) + list(range(k, len(b))),
                     first_last=len(a) - 1, second_last=second_last)


def pack_shared_prefix(pairs: list[tuple[list[int], list[int]]], pad_id: int) -> PackedPairs:
    """Pack each (a, b) pair of non-empty token lists into one right-padded row (see module doc)."""
    if not pairs or any(not a or not b for a, b in pairs):
        raise ValueError("pack_shared_prefix needs at least one pair of non-empty sequences")
    rows = [packed_row(a, b) for a, b in pairs]
    length = max(len(r.ids) for r in rows)
    batch = len(rows)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    segment = torch.full((batch, length), PAD, dtype=torch.long)
    position_ids = torch.zeros((batch, length), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row.ids)] = torch.tensor(row.ids)
        segment[i, : len(row.ids)] = torch.tensor(row.segments)
        position_ids[i, : len(row.ids)] = torch.tensor(row.positions)
    causal = torch.ones(length, length, dtype=torch.bool).tril()  # (L, L) key j <= query i
    query, key = segment[:, :, None], segment[:, None, :]  # (B, L, 1), (B, 1, L)
    same_branch = (key == PREFIX) | (key == query)
    real = (query != PAD) & (key != PAD)
    allowed = (causal & same_branch & real) | torch.eye(length, dtype=torch.bool)  # padding reads itself only
    first_last = torch.tensor([r.first_last for r in rows])
    second_last = torch.tensor([r.second_last for r in rows])
    return PackedPairs(input_ids, position_ids, allowed, first_last, second_last)
