"""GRPO (Shao et al. 2024, DeepSeekMath §4.1) with TRL's variants: the critic-free group method.

    rlhflab grpo --model runs/demo-.../sft/model --num_generations 4 --batch_size 64

Advantages: each prompt is answered `num_generations` times; a response's advantage is its reward
minus its group's mean, divided by the group's std (`scale_rewards group`), the batch's std (`batch`)
or nothing (`none`, Dr. GRPO). Loss: the clipped ratio (per token, or per response: GSPO's
`importance_sampling_level sequence`) with DAPO's clip-higher `epsilon_high`, plus beta x the k3 KL to
the reference per token (or, with `kl_in_reward`, beta x the sequence KL off the reward instead);
tokens summed as `loss_type` says (grpo / bnpo / dr_grpo / dapo); `num_iterations` passes (mu).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhflab.config import GRPOConfig
from rlhflab.core import grpo_advantages
from rlhflab.tracking import RunDir, RunResult
from rlhflab.trainers.given import NOTHING, Given
from rlhflab.trainers.online.algorithm import Advantages, AlgorithmDefaults, ScoredRollout, StepShare
from rlhflab.trainers.online.clipped import (STEP_NAMES, ClipSettings, check_group, clipped_policy_loss,
                                             group_metrics, sequence_advantages)
from rlhflab.trainers.online.controls import EntropyControl
from rlhflab.trainers.online.loop import train_online
from rlhflab.trainers.online.monitor import Monitor
from rlhflab.trainers.online.setup import check_online_config


class GRPO(AlgorithmDefaults):
    name = "grpo"
    critic = False
    whole_groups = False
    group_relative = True  # advantages against the prompt's other answers
    step_names = STEP_NAMES

    def __init__(self, cfg: GRPOConfig):
        check_group(cfg)
        self.cfg = cfg
        self.samples_per_prompt = cfg.num_generations
        self.epochs = cfg.num_iterations
        self.entropy = EntropyControl(cfg)  # --entropy_coef, --use_adaptive_entropy, --top_entropy_quantile
        self.entropy_in_loss = self.entropy.in_loss
        ratio = "token" if cfg.importance_sampling_level == "token" else "sequence_mean"
        self.settings = ClipSettings(cfg.epsilon, cfg.epsilon_high or cfg.epsilon, ratio, cfg.loss_type,
                                     0.0 if cfg.kl_in_reward else cfg.beta)

    def rewards(self, batch: ScoredRollout) -> Tensor:
        """(B,) the score, less beta x the sequence KL when KL is in the reward."""
        return batch.scores - self.cfg.beta * batch.sequence_kl if self.cfg.kl_in_reward else batch.scores

    def advantages(self, batch: ScoredRollout) -> Advantages:
        rewards = self.rewards(batch)
        scored = torch.where(batch.valid, rewards, torch.full_like(rewards, float("nan")))
        per_response = grpo_advantages(scored, batch.group_size, scale=self.cfg.scale_rewards)
        metrics = group_metrics(batch, rewards, self.cfg.mask_truncated_completions)
        return self.entropy.prepare(batch, Advantages(sequence_advantages(per_response, batch.mask), None, metrics))

    def loss(self, logprobs: Tensor, values, batch: ScoredRollout, adv: Advantages, idx: Tensor,
             share: StepShare, entropy: Tensor | None = None) -> tuple[Tensor, dict]:
        return clipped_policy_loss(logprobs, batch, adv, idx, share, self.settings, self.entropy, entropy)

    def state_dict(self) -> dict:
        return self.entropy.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.entropy.load_state_dict(state)


def check_config(cfg: GRPOConfig) -> None:
    """Every check `train` makes before loading anything."""
    algorithm = GRPO(cfg)
    check_online_config(cfg, algorithm.epochs, algorithm.samples_per_prompt)


def train(cfg: GRPOConfig, run: RunDir | None = None, reward_fn=None, monitor: Monitor | None = None,
          given: Given = NOTHING) -> RunResult:
    """Run GRPO as configured (trainers/online/loop.py's `train_online` says what each argument does)."""
    return train_online(cfg, GRPO(cfg), run, reward_fn, monitor, given)
