"""rlhflab from Python: a trainer per stage in TRL's shape, and the other commands as functions.

    from rlhflab import GRPOConfig, GRPOTrainer

    def correct(prompts, completions, answer, **kwargs):
        return [1.0 if c[0]["content"].strip() == a else 0.0 for c, a in zip(completions, answer)]

    result = GRPOTrainer(model="runs/sft/model", reward_funcs=[correct], train_dataset=rows,
                         args=GRPOConfig(total_episodes=512, output_dir="runs/grpo")).train()
    print(result.summary["validation_reward"], result.model_dir)
"""

from rlhflab.api.commands import compare_methods, diagnose, evaluate, write_report
from rlhflab.api.trainers import (DPOTrainer, GRPOTrainer, OnlineDPOTrainer, PPOTrainer, ReinforceTrainer,
                                  RewardTrainer, RLOOTrainer, SFTTrainer, Trainer, run_stage)

__all__ = ["DPOTrainer", "GRPOTrainer", "OnlineDPOTrainer", "PPOTrainer", "RLOOTrainer", "ReinforceTrainer",
           "RewardTrainer", "SFTTrainer", "Trainer", "compare_methods", "diagnose", "evaluate", "run_stage",
           "write_report"]
