"""Reward sources behind one call: `source(prompts, responses, items) -> Scored`.

    reward = CombinedReward([(CheckerReward(), 1.0), (ModelReward(rm, rm_tokenizer), 0.5)])
    out = reward(prompts, responses, items)   # out.scores (B,), out.valid (B,)
"""

from rlhflab.rewards.base import RewardSource, Scored, as_scored
from rlhflab.rewards.checker import CheckerReward
from rlhflab.rewards.combine import CombinedReward
from rlhflab.rewards.model import ModelReward, random_model_reward

# config name -> constructor
REWARD_KINDS = {
    "checker": CheckerReward,
    "model": ModelReward,
    "random": random_model_reward,
    "combined": CombinedReward,
}

__all__ = [
    "REWARD_KINDS",
    "CheckerReward",
    "CombinedReward",
    "ModelReward",
    "RewardSource",
    "Scored",
    "as_scored",
    "random_model_reward",
]
