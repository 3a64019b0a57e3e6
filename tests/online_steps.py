"""Drive the online loop's update passes directly on a hand-made rollout (tests only)."""

from __future__ import annotations

import torch

from rlhflab.trainers.online.algorithm import Advantages, ScoredRollout
from rlhflab.trainers.online.loop import scored_batch, update_passes


def scored(rollout, scores=None, group_size: int = 1) -> ScoredRollout:
    """Every row valid; scores 0 unless given."""
    batch = rollout.batch_size
    scores = torch.zeros(batch) if scores is None else scores
    return scored_batch(rollout, scores, torch.ones(batch, dtype=torch.bool), group_size)


def run_passes(algorithm, roles, optimizer, scheduler, rollout, advantages, returns, cfg, generator) -> dict:
    """The algorithm's passes over `rollout` with the given (B, T) advantages and returns."""
    return update_passes(algorithm, roles, optimizer, scheduler, scored(rollout), Advantages(advantages, returns, {}),
                         cfg, generator)
