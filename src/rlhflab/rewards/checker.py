"""The built-in suite's exact checker, as a verifiable reward and as a verifier.

It reads the prompt row's `family` and `reference` columns (the suite's prompt source sets
them; `rlhflab tasks export` writes them too), so it also checks a user file in that format.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhflab.data.prompt_rows import PromptRow
from rlhflab.rewards.base import Check, ScoreContext, Scored, check_lengths, scored
from rlhflab.tasks import FAMILIES, TaskItem, check


def task_item(row: PromptRow | TaskItem | None) -> TaskItem | None:
    """The suite item a prompt row describes; None when it has no known `family` or no `reference`."""
    if row is None or isinstance(row, TaskItem):
        return row
    family, reference = row.columns.get("family"), row.columns.get("reference")
    if family not in FAMILIES or not isinstance(reference, str):
        return None
    return TaskItem(family, row.prompt, reference, tuple(row.columns.get("content") or ()))


class CheckerReward:
    """`pass_score` when `tasks.check(item, response)` passes, else `fail_score`; no item -> invalid row.

    Responses are the text up to EOS. Whether the policy produced an EOS is the
    trainer's business: it applies `missing_eos_penalty` on top of this score.
    """

    def __init__(self, pass_score: float = 1.0, fail_score: float = 0.0):
        self.pass_score = pass_score
        self.fail_score = fail_score

    def __call__(self, prompts: list[str], responses: list[str], rows: Sequence[PromptRow | TaskItem | None],
                 context: ScoreContext | None = None) -> Scored:
        n = check_lengths(prompts, responses, rows)
        scores = torch.zeros(n)
        valid = torch.zeros(n, dtype=torch.bool)
        for i, (response, row) in enumerate(zip(responses, rows)):
            item = task_item(row)
            if item is None:
                continue
            scores[i] = self.pass_score if check(item, response).passed else self.fail_score
            valid[i] = True
        return scored(scores, valid)


class CheckerVerifier:
    """The suite's checker as the verifier of validation and evaluation (a row without an item fails)."""

    name = "checker"

    def __call__(self, prompts: list[str], completions: list[str], rows: Sequence[PromptRow | TaskItem | None],
                 ended_with_eos: Sequence[bool] | None = None) -> list[Check]:
        check_lengths(prompts, completions, rows)
        ended = ended_with_eos if ended_with_eos is not None else [True] * len(completions)
        checks = []
        for completion, row, eos in zip(completions, rows, ended):
            item = task_item(row)
            if item is None:
                checks.append(Check(False, "unverified", "no suite family / reference to check against"))
                continue
            verdict = check(item, completion, eos)
            checks.append(Check(verdict.passed, verdict.kind, verdict.reason))
        return checks
