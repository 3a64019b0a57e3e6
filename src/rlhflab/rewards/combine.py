"""Several reward sources as one: a weighted sum, valid only where every source is."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhflab.errors import UserInputError
from rlhflab.data.prompt_rows import PromptRow
from rlhflab.rewards.base import RewardSource, ScoreContext, Scored, check_lengths, score, scored


class CombinedReward:
    """sum_k weight_k * score_k; a row is valid only if valid in every source."""

    def __init__(self, sources: Sequence[tuple[RewardSource, float]]):
        if not sources:
            raise UserInputError("a combined reward needs at least one (source, weight) pair",
                                 where="reward sources", fix="e.g. [(CheckerReward(), 1.0), (ModelReward(...), 0.5)]")
        self.sources = list(sources)

    def __call__(self, prompts: list[str], responses: list[str], rows: Sequence[PromptRow],
                 context: ScoreContext | None = None) -> Scored:
        n = check_lengths(prompts, responses, rows)
        total = torch.zeros(n)
        valid = torch.ones(n, dtype=torch.bool)
        for source, weight in self.sources:
            part = score(source, prompts, responses, rows, context)
            total = total + weight * part.scores
            valid = valid & part.valid
        return scored(total, valid)
