"""DAPO's dynamic sampling (`--dynamic_sampling`; Yu et al. 2025, section 3.2): a group whose scores are all equal
(every answer passed, or every one failed) has zero group-relative advantage, so it costs generation and
training time and carries no policy gradient. Such groups are dropped and the batch is refilled from the next
prompts of the same ordered stream, one batch of prompts per extra round, until it holds as many informative
groups as configured or `max_refill_rounds` extra rounds were generated. At that cap the batch is filled with
the earliest dropped groups (zero advantage: no policy gradient, only their KL term where the method has one), so
every update trains on `batch_size` answers whatever was found: the same shapes and loss normalisers as without
dynamic sampling, and every rank (each holds the whole scored batch) takes the same decisions.

Round r of update u samples with a generator seeded by (seed, u, r) and draws its prompts from the run's prompt
order, which a checkpoint keeps: a resumed run refills exactly as the uninterrupted one did.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhflab.rollout.rollout import Rollout, rows_of_rollouts


@dataclass(frozen=True)
class Round:
    """One generation round of an update: its prompts (one train index per answer), the scored rollout."""

    batch_ids: list[int]
    rollout: Rollout
    scores: Tensor  # (B,)
    valid: Tensor  # (B,) bool
    scoring_s: float


def informative_groups(scores: Tensor, valid: Tensor, group: int) -> Tensor:
    """(B,) scores, validity -> (B / group,) bool: the group's valid answers do not all score the same (a group
    with fewer than two valid answers has nothing to compare either)."""
    s, v = scores.view(-1, group), valid.view(-1, group)
    high = torch.where(v, s, torch.full_like(s, -torch.inf)).max(dim=1).values
    low = torch.where(v, s, torch.full_like(s, torch.inf)).min(dim=1).values
    return (v.sum(dim=1) >= 2) & (high > low)


def group_counts(rounds: list[Round], group: int) -> dict[str, int]:
    """All-equal groups of every round: at the update's highest score (all pass, with 0 / 1 rewards) or at a lower
    one (all fail: with the missing-EOS penalty a failing group may score 0 or -1)."""
    top = torch.cat([r.scores[r.valid] for r in rounds]).max()
    counts = {"all_pass": 0, "all_fail": 0}
    for r in rounds:
        scores, valid = r.scores.view(-1, group), r.valid.view(-1, group)
        for g in (~informative_groups(r.scores, r.valid, group)).nonzero().flatten().tolist():
            row = scores[g][valid[g]]
            counts["all_pass" if row.numel() and row[0] == top else "all_fail"] += 1
    return counts


def refill(first: Round, sample_round: Callable[[int], Round], groups: int, group: int, max_rounds: int,
           pad_id: int) -> tuple[Round, dict]:
    """The update's batch of `groups` groups, informative ones first in the order generated (round 0's, then
    round 1's ...), topped up with the earliest dropped groups at the cap; and the update's `dynamic/*` metrics.
    `sample_round(r)` draws the next prompts and generates and scores round r."""
    rounds = [first]
    kept = [(0, g) for g in informative_groups(first.scores, first.valid, group).nonzero().flatten().tolist()]
    while len(kept) < groups and len(rounds) <= max_rounds:
        rounds.append(sample_round(len(rounds)))
        r = len(rounds) - 1
        kept += [(r, g) for g in informative_groups(rounds[r].scores, rounds[r].valid, group).nonzero().flatten()
                 .tolist()]
    informative = min(len(kept), groups)
    dropped = [(r, g) for r, one in enumerate(rounds) for g in range(len(one.batch_ids) // group)
               if (r, g) not in set(kept)]
    chosen = kept[:groups] + dropped[: groups - informative]
    rows = [(r, g * group + k) for r, g in chosen for k in range(group)]
    batch = Round(batch_ids=[rounds[r].batch_ids[i] for r, i in rows],
                  rollout=rounds[0].rollout if len(rounds) == 1 and chosen == [(0, g) for g in range(groups)]
                  else rows_of_rollouts([one.rollout for one in rounds], rows, pad_id),
                  scores=torch.stack([rounds[r].scores[i] for r, i in rows]),
                  valid=torch.stack([rounds[r].valid[i] for r, i in rows]),
                  scoring_s=sum(one.scoring_s for one in rounds))
    counts = group_counts(rounds, group)
    metrics = {"dynamic/refill_rounds": len(rounds) - 1, "dynamic/generated": sum(len(one.batch_ids) for one in rounds),
               "dynamic/informative_groups": informative, "dynamic/padded_groups": groups - informative,
               "dynamic/surplus_groups": len(kept) - informative,  # informative, generated, not trained
               "dynamic/dropped_all_pass": counts["all_pass"], "dynamic/dropped_all_fail": counts["all_fail"]}
    return batch, metrics


def check_dynamic(cfg, name: str, group: int, group_relative: bool) -> None:
    """--dynamic_sampling where it means something, refused before anything is loaded."""
    from rlhflab.errors import UserInputError

    if not cfg.dynamic_sampling:
        return
    if not group_relative or group < 2:
        raise UserInputError(f"dynamic_sampling drops groups whose answers all score the same, which {name}'s "
                             "advantages do not compare" + ("" if group_relative else " (they are not relative to "
                                                                                        "the prompt's group)"),
                             "--dynamic_sampling", "use it with GRPO, RLOO, online DPO or REINFORCE with baseline "
                                                   "leave_one_out, and num_generations >= 2")
    if cfg.max_refill_rounds < 0:
        raise UserInputError(f"max_refill_rounds must be >= 0, got {cfg.max_refill_rounds}", "--max_refill_rounds")
    if cfg.async_generation:
        raise UserInputError("dynamic_sampling with async_generation is not supported (a refill round would wait on "
                             "the generator)", "--async_generation", "drop one of the two")
