"""What every reward source returns, and the one call they all answer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from rlhflab.tasks import TaskItem


@dataclass(frozen=True)
class Scored:
    """Scores for a batch of finished responses."""

    scores: Tensor  # (B,) float32; 0.0 where valid is False
    valid: Tensor  # (B,) bool; False where the source failed for that row (no item, non-finite score)

    def __post_init__(self) -> None:
        if self.scores.shape != self.valid.shape or self.scores.dim() != 1:
            raise ValueError(f"scores {tuple(self.scores.shape)} and valid {tuple(self.valid.shape)} must be (B,)")


class RewardSource(Protocol):
    """prompts, responses (text up to EOS, EOS excluded) and task items (None when unknown) -> Scored."""

    def __call__(self, prompts: list[str], responses: list[str], items: Sequence[TaskItem | None]) -> Scored: ...


def check_lengths(prompts: Sequence, responses: Sequence, items: Sequence) -> int:
    """B, after checking the three lists line up."""
    if not len(prompts) == len(responses) == len(items):
        raise ValueError(f"got {len(prompts)} prompts, {len(responses)} responses and {len(items)} items")
    return len(prompts)


def scored(scores: Tensor, valid: Tensor) -> Scored:
    """Scored with invalid rows zeroed (so a sum over rows never picks up NaN)."""
    scores = scores.detach().to(device="cpu", dtype=torch.float32)
    valid = valid.to(device="cpu", dtype=torch.bool) & torch.isfinite(scores)
    return Scored(scores=torch.where(valid, scores, torch.zeros_like(scores)), valid=valid)


def as_scored(result) -> Scored:
    """A user reward function's output as `Scored`: a Scored, a tensor, or a list of floats.

    NaN, inf or None marks a row the reward failed on: it is masked out and counted.
    """
    if isinstance(result, Scored):
        return result
    values = [float("nan") if v is None else float(v) for v in (result.tolist() if isinstance(result, Tensor) else result)]
    scores = torch.tensor(values, dtype=torch.float32)
    valid = torch.isfinite(scores)
    return Scored(torch.where(valid, scores, torch.zeros_like(scores)), valid)
