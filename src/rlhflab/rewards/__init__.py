"""Reward sources and verifiers behind one call each.

    reward = CombinedReward([(CheckerReward(), 1.0), (ModelReward(rm, rm_tokenizer), 0.5)])
    out = reward(prompts, responses, rows)   # out.scores (B,), out.valid (B,)
    checks = verifier(prompts, responses, rows)   # [Check(passed, kind, reason), ...]

A user's own functions (TRL's `reward_funcs` signature) become sources with
`FunctionReward(load_function("my_rewards.py:exact"))` and verifiers with `FunctionVerifier`.
"""

from rlhflab.rewards.base import Check, RewardSource, ScoreContext, Scored, Verifier, as_scored, score
from rlhflab.rewards.checker import CheckerReward, CheckerVerifier, task_item
from rlhflab.rewards.combine import CombinedReward
from rlhflab.rewards.deadline import CallTimedOut, call_with_deadline
from rlhflab.rewards.functions import (CallLimits, FunctionReward, FunctionVerifier, error_summary, function_name,
                                       load_function, lost_rows)
from rlhflab.rewards.model import ModelReward, ReloadedModelReward, random_model_reward

# config name -> constructor
REWARD_KINDS = {
    "checker": CheckerReward,
    "model": ModelReward,
    "random": random_model_reward,
    "combined": CombinedReward,
}

__all__ = [
    "REWARD_KINDS",
    "CallLimits",
    "CallTimedOut",
    "Check",
    "CheckerReward",
    "CheckerVerifier",
    "CombinedReward",
    "FunctionReward",
    "FunctionVerifier",
    "ModelReward",
    "ReloadedModelReward",
    "RewardSource",
    "ScoreContext",
    "Scored",
    "Verifier",
    "as_scored",
    "call_with_deadline",
    "error_summary",
    "function_name",
    "load_function",
    "lost_rows",
    "random_model_reward",
    "score",
    "task_item",
]
