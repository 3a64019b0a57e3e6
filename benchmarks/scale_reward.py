"""The reward of benchmarks/scale.py's GRPO rows, on both sides (stdlib only).

rlhflab: `--reward_fn benchmarks/scale_reward.py:length_reward`; TRL 1.16: the same function passed as a reward
function (TRL adds `completion_ids`, `trainer_state` and the dataset's columns as keywords). The answer's length in
characters mod 7: cheap, and it varies between the answers of a group, so advantages are not all zero.
"""

from __future__ import annotations


def length_reward(prompts, completions, **_) -> list[float]:
    return [float(len(c if isinstance(c, str) else c[0]["content"]) % 7) for c in completions]
