"""Verifiable reward: the task's own exact checker (RL from verifiable rewards)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhflab.rewards.base import Scored, check_lengths, scored
from rlhflab.tasks import TaskItem, check


class CheckerReward:
    """`pass_score` when `tasks.check(item, response)` passes, else `fail_score`; no item -> invalid row.

    Responses are the text up to EOS. Whether the policy produced an EOS is the
    trainer's business: it applies `missing_eos_penalty` on top of this score.
    """

    def __init__(self, pass_score: float = 1.0, fail_score: float = 0.0):
        self.pass_score = pass_score
        self.fail_score = fail_score

    def __call__(self, prompts: list[str], responses: list[str], items: Sequence[TaskItem | None]) -> Scored:
        n = check_lengths(prompts, responses, items)
        scores = torch.zeros(n)
        valid = torch.zeros(n, dtype=torch.bool)
        for i, (response, item) in enumerate(zip(responses, items)):
            if item is None:
                continue
            scores[i] = self.pass_score if check(item, response).passed else self.fail_score
            valid[i] = True
        return scored(scores, valid)
