"""How much reward does a reward model give for length alone?

A reward model trained on human or synthetic preferences often learns "longer is
better", and PPO then pads answers to collect it (the length drift the alarms watch
for). The probe makes that bias a number before any PPO run: each reference answer
is scored plain and again with content-free filler appended ("Hope this helps!", the
last sentence repeated, ...). Everything else in the pair is identical, so
score(padded) - score(plain) is reward for length alone. A good RM scores the padded
answer the same or lower (the filler breaks the requested format); a length-biased
one scores it higher.

    probe = length_bias_probe(rm, rm_tokenizer, items)
    probe["mean_change"], probe["share_raised"], probe["per_filler"]["hope_this_helps"]
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

import torch
from torch import nn

from rlhflab.rewards import ModelReward
from rlhflab.tasks import TaskItem

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


def repeat_last_sentence(answer: str) -> str:
    """'A. B.' -> 'A. B. B.'; an answer of one sentence (or a list, a JSON object) is repeated whole."""
    sentences = [s for s in _SENTENCE_END.split(answer.strip()) if s]
    last = sentences[-1] if sentences else answer
    joiner = "\n" if "\n" in answer.strip() else " "
    return f"{answer}{joiner}{last}"


def appended(filler: str) -> Callable[[str], str]:
    return lambda answer: answer + filler


# name -> answer -> answer padded with filler that adds no content (one visible table)
FILLERS: dict[str, Callable[[str], str]] = {
    "hope_this_helps": appended(" Hope this helps!"),
    "let_me_know": appended(" Let me know if you need anything else."),
    "restate": appended(" I hope this answer is clear and complete."),
    "repeat_last_sentence": repeat_last_sentence,
}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def change_summary(changes: Sequence[float], added_tokens: Sequence[int]) -> dict[str, float]:
    """Mean score change, share of pairs it was > 0, tokens the filler added, change per added token."""
    added = sum(added_tokens)
    return {
        "mean_change": _mean(changes),
        "share_raised": _mean([1.0 if c > 0 else 0.0 for c in changes]),
        "mean_added_tokens": _mean(added_tokens),
        "change_per_token": sum(changes) / added if added else float("nan"),
    }


def length_bias_probe(reward_model: nn.Module, tokenizer, items: Sequence[TaskItem],
                      fillers: dict[str, Callable[[str], str]] | None = None, batch_size: int = 64,
                      append_eos: bool = True) -> dict:
    """Score each item's reference answer plain and padded with each filler; report the reward for length.

    Returns `pairs` (items x fillers), overall `mean_change` = mean of score(padded) - score(plain),
    `share_raised` (share of pairs where padding raised the score), `mean_added_tokens`,
    `change_per_token`, `plain_score_std` (std of the plain scores, the scale to read the
    change against) and `per_filler` with the same numbers per filler. Scores are raw RM
    outputs, tokenised as in PPO and the diagnosis (`ModelReward`: prompt + answer + EOS).
    """
    fillers = FILLERS if fillers is None else fillers
    reward = ModelReward(reward_model, tokenizer, batch_size=batch_size, append_eos=append_eos)
    prompts, plain = [i.prompt for i in items], [i.reference for i in items]
    with torch.no_grad():
        base = reward(prompts, plain, list(items)).scores.tolist()
    base_len = [len(row) for row in reward.encode(prompts, plain)]
    per_filler, changes, added = {}, [], []
    for name, pad in fillers.items():
        padded = [pad(answer) for answer in plain]
        with torch.no_grad():
            scores = reward(prompts, padded, list(items)).scores.tolist()
        filler_changes = [s - b for s, b in zip(scores, base)]
        filler_added = [len(row) - n for row, n in zip(reward.encode(prompts, padded), base_len)]
        per_filler[name] = change_summary(filler_changes, filler_added)
        changes += filler_changes
        added += filler_added
    spread = math.sqrt(_mean([(b - _mean(base)) ** 2 for b in base])) if base else float("nan")
    return {"pairs": len(changes), "fillers": list(fillers), **change_summary(changes, added),
            "plain_score_std": spread, "per_filler": per_filler}


def describe(probe: dict) -> str:
    """One line for the console: the reward for length alone, in score units and in plain-score stds."""
    std = probe["plain_score_std"]
    scale = f" ({probe['mean_change'] / std:+.2f} std of the plain scores)" if std and math.isfinite(std) else ""
    return (f"length bias: padding the reference answer with filler (~{probe['mean_added_tokens']:.0f} tokens) "
            f"changed the reward by {probe['mean_change']:+.3f} on average{scale}; it raised the reward in "
            f"{probe['share_raised']:.0%} of {probe['pairs']} pairs")
