"""RLOO (Ahmadian et al. 2024, "Back to Basics", §3.2) as TRL 1.16 runs it: the critic-free leave-one-out method.

    rlhflab rloo --model runs/demo-.../sft/model --num_generations 4 --batch_size 64

Advantages: each prompt is answered `num_generations` times; a response's reward is its score less
beta x its sequence KL to the reference (k1, summed over tokens); its advantage is that reward minus
the mean reward of its siblings (leave-one-out), whitened over the rollout with `normalize_advantages`.
Loss: one clipped ratio per response, the ratio of the whole sequence's probability, averaged over
responses, for `num_iterations` passes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhflab.config import RLOOConfig
from rlhflab.core import rloo_advantages
from rlhflab.tracking import RunDir, RunResult
from rlhflab.trainers.given import NOTHING, Given
from rlhflab.trainers.online.algorithm import Advantages, AlgorithmDefaults, ScoredRollout, StepShare
from rlhflab.trainers.online.clipped import (STEP_NAMES, ClipSettings, check_group, clipped_policy_loss,
                                             group_metrics, sequence_advantages)
from rlhflab.trainers.online.controls import EntropyControl
from rlhflab.trainers.online.loop import train_online
from rlhflab.trainers.online.monitor import Monitor
from rlhflab.trainers.online.setup import check_online_config


class RLOO(AlgorithmDefaults):
    name = "rloo"
    critic = False
    whole_groups = False
    group_relative = True  # advantages against the prompt's other answers
    step_names = STEP_NAMES

    def __init__(self, cfg: RLOOConfig):
        check_group(cfg)
        self.cfg = cfg
        self.samples_per_prompt = cfg.num_generations
        self.epochs = cfg.num_iterations
        self.entropy = EntropyControl(cfg)  # --entropy_coef, --use_adaptive_entropy, --top_entropy_quantile
        self.entropy_in_loss = self.entropy.in_loss
        self.settings = ClipSettings(cfg.epsilon, cfg.epsilon_high or cfg.epsilon, "sequence_sum", "grpo", 0.0)

    def advantages(self, batch: ScoredRollout) -> Advantages:
        rewards = batch.scores - self.cfg.beta * batch.sequence_kl
        scored = torch.where(batch.valid, rewards, torch.full_like(rewards, float("nan")))
        per_response = rloo_advantages(scored, batch.group_size)
        if self.cfg.normalize_advantages:
            kept = per_response[batch.valid]
            per_response = (per_response - kept.mean()) / (kept.std() + 1e-4) if kept.numel() > 1 else per_response
        kl_per_token = (batch.kl.sum() / batch.mask.sum().clamp(min=1)).item()  # TRL's RLOO "kl"
        metrics = {**group_metrics(batch, rewards, self.cfg.mask_truncated_completions), "kl": kl_per_token}
        return self.entropy.prepare(batch, Advantages(sequence_advantages(per_response, batch.mask), None, metrics))

    def loss(self, logprobs: Tensor, values, batch: ScoredRollout, adv: Advantages, idx: Tensor,
             share: StepShare, entropy: Tensor | None = None) -> tuple[Tensor, dict]:
        loss, stats = clipped_policy_loss(logprobs, batch, adv, idx, share, self.settings, self.entropy, entropy)
        stats.pop("kl")  # RLOO's kl is the sequence KL in its reward, logged with the rollout
        return loss, stats

    def state_dict(self) -> dict:
        return self.entropy.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.entropy.load_state_dict(state)


def check_config(cfg: RLOOConfig) -> None:
    """Every check `train` makes before loading anything."""
    algorithm = RLOO(cfg)
    check_online_config(cfg, algorithm.epochs, algorithm.samples_per_prompt)


def train(cfg: RLOOConfig, run: RunDir | None = None, reward_fn=None, monitor: Monitor | None = None,
          given: Given = NOTHING) -> RunResult:
    """Run RLOO as configured (trainers/online/loop.py's `train_online` says what each argument does)."""
    return train_online(cfg, RLOO(cfg), run, reward_fn, monitor, given)
