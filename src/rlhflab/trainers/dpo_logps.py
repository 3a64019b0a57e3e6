"""Completion log-probs of preference pairs: the one forward DPO, IPO and SimPO train through.

A batch of B pairs is run either packed (one row per pair: the shared prompt once, then the chosen
rest, then the rejected rest, `models.pack_shared_prefix`; Llama / Qwen2 layouts) or as 2B right-padded
rows (any causal LM). Either way only the positions that predict a completion token are read:
`predictors[n]` is the flat (row, position) index whose output predicts token `targets[n]`, and
`owners[n]` says whose sequence it belongs to (chosen of pair i: i, rejected of pair i: B + i).
So prompt tokens and padding never enter a log-prob (DESIGN.md: log-prob of token t from the
output at t - 1, in float32), and the LM head runs on completion positions only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from rlhflab import models, parallel
from rlhflab.models.packing import common_prefix_length
from rlhflab.trainers.dpo_data import PreferencePair


@dataclass(frozen=True)
class PairBatch:
    input_ids: Tensor  # (R, L) long; R = B packed rows, or 2B rows (chosen..., rejected...)
    position_ids: Tensor  # (R, L) long: each sequence's own positions
    attention_mask: Tensor  # (R, L) long, 1 on real tokens
    allowed: Tensor | None  # (R, L, L) bool for packed rows (query i may read key j); None = causal
    predictors: Tensor  # (N,) long: flat index r * L + t of the output that predicts each scored token
    targets: Tensor  # (N,) long: the scored tokens, every completion token of every sequence
    owners: Tensor  # (N,) long: i = chosen of pair i, B + i = rejected of pair i
    num_pairs: int


class SequenceLogps(NamedTuple):
    """Summed completion log-probs and completion lengths per pair, each (B,) float32."""

    chosen: Tensor
    rejected: Tensor
    chosen_tokens: Tensor
    rejected_tokens: Tensor

    def averaged(self) -> SequenceLogps:
        """Mean per completion token (IPO, SimPO: the paper's (1/|y|) log pi(y|x), as TRL)."""
        return SequenceLogps(self.chosen / self.chosen_tokens.clamp(min=1),
                             self.rejected / self.rejected_tokens.clamp(min=1), self.chosen_tokens,
                             self.rejected_tokens)


def scored_positions(start: int, length: int, position_of) -> list[tuple[int, int]]:
    """(position of the predicting output, index of the token) for each completion token of a sequence.
    A completion that starts at 0 (no prompt) loses its first token: nothing predicts it."""
    return [(position_of(j - 1), j) for j in range(max(start, 1), length)]


def packed_batch(pairs: list[PreferencePair], pad_id: int) -> PairBatch:
    """One row per pair: shared prefix | chosen rest | rejected rest (models/packing.py)."""
    packed = models.pack_shared_prefix([(p.chosen, p.rejected) for p in pairs], pad_id)
    length = packed.input_ids.shape[1]
    predictors, targets, owners = [], [], []
    for i, pair in enumerate(pairs):
        shared = common_prefix_length(pair.chosen, pair.rejected)
        in_rejected = lambda j, a=len(pair.chosen), k=shared: j if j < k else a + j - k  # noqa: E731
        for seq, start, where, owner in ((pair.chosen, pair.chosen_start, lambda j: j, i),
                                         (pair.rejected, pair.rejected_start, in_rejected, len(pairs) + i)):
            for position, j in scored_positions(start, len(seq), where):
                predictors.append(i * length + position)
                targets.append(seq[j])
                owners.append(owner)
    lengths = torch.tensor([models.packed_length(p.chosen, p.rejected) for p in pairs])
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()  # (B, L) real tokens of each row
    return PairBatch(packed.input_ids, packed.position_ids, mask, packed.allowed, torch.tensor(predictors),
                     torch.tensor(targets), torch.tensor(owners), len(pairs))


def padded_batch(pairs: list[PreferencePair], pad_id: int) -> PairBatch:
    """2B right-padded rows: every chosen sequence, then every rejected one."""
    seqs = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    starts = [p.chosen_start for p in pairs] + [p.rejected_start for p in pairs]
    length = max(map(len, seqs))
    input_ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), length), dtype=torch.long)
    predictors, targets, owners = [], [], []
    for r, (seq, start) in enumerate(zip(seqs, starts)):
        input_ids[r, : len(seq)] = torch.tensor(seq)
        attention_mask[r, : len(seq)] = 1
        for position, j in scored_positions(start, len(seq), lambda j: j):
            predictors.append(r * length + position)
            targets.append(seq[j])
            owners.append(r)
    positions = torch.arange(length).expand(len(seqs), length)
    return PairBatch(input_ids, positions, attention_mask, None, torch.tensor(predictors), torch.tensor(targets),
                     torch.tensor(owners), len(pairs))


def pair_batch(pairs: list[PreferencePair], pad_id: int, packed: bool) -> PairBatch:
    return packed_batch(pairs, pad_id) if packed else padded_batch(pairs, pad_id)


def can_pack(model: torch.nn.Module) -> bool:
    """Whether the lean forward runs this model (a Llama / Qwen2 layout without dropout): packed rows need
    its explicit attention mask."""
    plan = models.plan_lean(model, allow_training=True)
    return plan is not None and plan.lm_head is not None


def token_logps(model: torch.nn.Module, batch: PairBatch) -> Tensor:
    """(N,) float32 log-prob of each scored token. Differentiable when grad is on. A model sharded by FSDP2
    runs its own forward (its layers gather their weights there; the lean forward reads them whole)."""
    device = next(model.parameters()).device
    ids, positions = batch.input_ids.to(device), batch.position_ids.to(device)
    predictors = batch.predictors.to(device)
    plan = None if parallel.holds_shards(model) else models.plan_lean(model, allow_training=True)
    if plan is not None and plan.lm_head is not None:
        allowed = batch.allowed.to(device) if batch.allowed is not None else None
        mask = None if allowed is not None else batch.attention_mask.to(device)
        rows, length = ids.shape
        flags = torch.zeros(rows * length, dtype=torch.bool, device=device).index_fill_(0, predictors, True)
        read, valid = models.read_columns(flags.view(rows, length))  # the last layer runs at the predictors only
        hidden = models.lean_hidden(plan, ids, mask, positions, allowed=allowed, read=read)  # (R, m, H)
        places = (torch.arange(rows, device=device)[:, None] * length + read)[valid]  # ascending flat positions
        scores = models.HeadInputs.of(hidden[valid][torch.searchsorted(places, predictors)], plan.lm_head)  # (N,)
    else:
        if batch.allowed is not None:
            raise ValueError("packed pairs need a model the lean forward runs (see can_pack)")
        scores = models.head_inputs(model, ids, batch.attention_mask.to(device), positions)  # predicts (R, L)
        scores = scores.reshape(ids.numel(), -1)[predictors]  # (N,)
    return models.token_logprobs(scores, batch.targets.to(device))


def sequence_logps(model: torch.nn.Module, batch: PairBatch) -> SequenceLogps:
    """Summed completion log-probs of chosen and rejected, and their token counts, each (B,)."""
    logps = token_logps(model, batch)  # (N,)
    owners = batch.owners.to(logps.device)
    n = batch.num_pairs
    sums = torch.zeros(2 * n, dtype=logps.dtype, device=logps.device).index_add(0, owners, logps)  # (2B,)
    counts = torch.bincount(owners, minlength=2 * n).to(logps.dtype)  # (2B,)
    return SequenceLogps(sums[:n], sums[n:], counts[:n], counts[n:])


def row_length(pair: PreferencePair, packed: bool) -> int:
    """Tokens of the pair's longest row: its packed row, or the longer of its two sequences."""
    return models.packed_length(pair.chosen, pair.rejected) if packed else max(len(pair.chosen), len(pair.rejected))


def chunked_logps(model: torch.nn.Module, pairs: list[PreferencePair], pad_id: int, packed: bool,
                  chunks: int) -> SequenceLogps:
    """`sequence_logps` of `pairs`, (B,) each in their order, from `chunks` forward passes over the pairs sorted
    by length, each padded only to its own longest row. On the suite a batch of 32 packed rows is ~46 % padding
    in one pass and ~29 % in two; one backward still runs through all of them."""
    if chunks <= 1:
        return sequence_logps(model, pair_batch(pairs, pad_id, packed))
    order = sorted(range(len(pairs)), key=lambda i: row_length(pairs[i], packed))
    size = math.ceil(len(pairs) / chunks)
    parts = [sequence_logps(model, pair_batch([pairs[i] for i in order[s : s + size]], pad_id, packed))
             for s in range(0, len(order), size)]
    inverse = torch.argsort(torch.tensor(order, device=parts[0].chosen.device))
    return SequenceLogps(*(torch.cat(field)[inverse] for field in zip(*parts)))


@torch.no_grad()
def precompute_logps(model: torch.nn.Module, pairs: list[PreferencePair], pad_id: int, packed: bool,
                     batch_size: int = 64) -> SequenceLogps:
    """Summed log-probs of every pair, (N,) each, in batches of pairs sorted by length (less padding)."""
    was_training = model.training
    model.eval()
    order = sorted(range(len(pairs)), key=lambda i: row_length(pairs[i], packed))
    parts = [sequence_logps(model, pair_batch([pairs[i] for i in order[s : s + batch_size]], pad_id, packed))
             for s in range(0, len(order), batch_size)]
    model.train(was_training)
    inverse = torch.argsort(torch.tensor(order))
    return SequenceLogps(*(torch.cat([getattr(p, f) for p in parts]).cpu()[inverse] for f in SequenceLogps._fields))


def select(logps: SequenceLogps, indices: list[int]) -> SequenceLogps:
    """The rows `indices` of precomputed log-probs, in that order."""
    index = torch.tensor(indices, dtype=torch.long)
    return SequenceLogps(*(t[index] for t in logps))
