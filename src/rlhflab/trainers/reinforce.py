"""REINFORCE with a baseline (Williams 1992): the plainest critic-free policy gradient.

    rlhflab reinforce --model runs/demo-.../sft/model --baseline moving_average

Advantages: per-token rewards -kl_coef x KL_t (k1) on every real token plus the score on the last one;
the reward-to-go G_t (gamma 1) less one baseline per response: the batch's mean return, a moving average
of past batches' mean returns, or the mean return of the prompt's other samples (`leave_one_out`, with
`num_generations` >= 2). Loss: -A_t x ratio_t, a token mean over the step, one pass per rollout: the
ratio is 1 there, so the gradient is the policy gradient -A_t grad log pi(a_t); no clipping.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhflab.config import REINFORCEConfig
from rlhflab.core import (MovingAverageBaseline, discounted_returns, masked_mean, rloo_advantages, token_rewards,
                          whiten)
from rlhflab.errors import UserInputError
from rlhflab.tracking import RunDir, RunResult
from rlhflab.trainers.given import NOTHING, Given
from rlhflab.trainers.online.algorithm import (Advantages, AlgorithmDefaults, ScoredRollout, StepShare,
                                               weighted_advantages)
from rlhflab.trainers.online.controls import EntropyControl, truncation_metrics
from rlhflab.trainers.online.loop import train_online
from rlhflab.trainers.online.monitor import Monitor
from rlhflab.trainers.online.setup import check_online_config


class REINFORCE(AlgorithmDefaults):
    name = "reinforce"
    critic = False
    whole_groups = False
    epochs = 1  # on-policy: a second pass would need a ratio clip, i.e. PPO
    step_names = {"loss": "loss", "ratio_mean": "policy/ratio_mean", "grad_norm": "grad_norm"}

    def __init__(self, cfg: REINFORCEConfig):
        if cfg.baseline == "leave_one_out" and cfg.num_generations < 2:
            raise UserInputError("baseline=leave_one_out needs num_generations >= 2", "--num_generations",
                                 "e.g. --num_generations 4, or --baseline batch_mean")
        if cfg.num_generations < 1:
            raise UserInputError(f"num_generations must be >= 1, got {cfg.num_generations}", "--num_generations")
        if not 0.0 <= cfg.baseline_decay < 1.0:
            raise UserInputError(f"baseline_decay must be in [0, 1), got {cfg.baseline_decay}", "--baseline_decay",
                                 "e.g. --baseline_decay 0.9 (the weight of the old average)")
        self.cfg = cfg
        self.samples_per_prompt = cfg.num_generations
        self.group_relative = cfg.baseline == "leave_one_out"  # the other baselines are the batch's or the past's
        self.moving = MovingAverageBaseline(cfg.baseline_decay)
        self.entropy = EntropyControl(cfg)  # --entropy_coef, --use_adaptive_entropy, --top_entropy_quantile
        self.entropy_in_loss = self.entropy.in_loss

    def baselines(self, returns: Tensor, valid: Tensor, group_size: int) -> Tensor:
        """(B,) one baseline per response from the (B,) sequence returns."""
        if self.cfg.baseline == "batch_mean":
            return returns[valid].mean().expand_as(returns)
        if self.cfg.baseline == "moving_average":
            baseline = torch.full_like(returns, self.moving.value)  # from earlier batches only
            self.moving.update(returns[valid])
            return baseline
        scored = torch.where(valid, returns, torch.full_like(returns, float("nan")))
        return returns - rloo_advantages(scored, group_size)  # the mean of the siblings' returns

    def advantages(self, batch: ScoredRollout) -> Advantages:
        rewards, _ = token_rewards(batch.scores, batch.kl, batch.mask, self.cfg.kl_coef)
        to_go = discounted_returns(rewards, batch.mask, 1.0)  # (B, T)
        returns = to_go[:, 0]  # each response's whole return
        baseline = self.baselines(returns, batch.valid, batch.group_size)
        advantages = torch.where(batch.mask, to_go - baseline.unsqueeze(1), torch.zeros_like(to_go))
        if self.cfg.normalize_advantages:
            advantages = whiten(advantages, batch.mask)
        scores = batch.scores[batch.valid]
        # reward / reward_std: TRL 1.16's GRPO / RLOO meaning (the scores before any KL penalty, their std over the
        # rollout: grpo_trainer.py:2828-2829); the return the baseline sees, score - kl_coef x KL, is TRL's PPO name
        metrics = {"reward": scores.mean().item(), "reward_std": scores.std().item() if scores.numel() > 1 else 0.0,
                   "objective/rlhf_reward": returns[batch.valid].mean().item(),
                   "baseline": baseline[batch.valid].mean().item(),
                   **truncation_metrics(batch, self.cfg.mask_truncated_completions)}
        return self.entropy.prepare(batch, Advantages(advantages, None, metrics))

    def loss(self, logprobs: Tensor, values, batch: ScoredRollout, adv: Advantages, idx: Tensor,
             share: StepShare, entropy: Tensor | None = None) -> tuple[Tensor, dict]:
        mask = batch.mask[idx]
        ratio = torch.exp(torch.where(mask, logprobs - batch.rollout.logprobs[idx], torch.zeros_like(logprobs)))
        per_token = -weighted_advantages(batch, adv, idx) * ratio  # 0 outside a --top_entropy_quantile mask
        loss = torch.where(mask, per_token, torch.zeros_like(per_token)).sum() / share.tokens
        loss = loss + self.entropy.bonus(entropy, batch, adv, idx, share)
        stats = {"loss": loss.detach() * share.rows / len(idx), "ratio_mean": masked_mean(ratio.detach(), mask)}
        return loss, stats

    def state_dict(self) -> dict:
        return {"moving_baseline": self.moving.state_dict(), **self.entropy.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.moving.load_state_dict(state["moving_baseline"])
        self.entropy.load_state_dict(state)


def check_config(cfg: REINFORCEConfig) -> None:
    """Every check `train` makes before loading anything."""
    algorithm = REINFORCE(cfg)
    check_online_config(cfg, algorithm.epochs, algorithm.samples_per_prompt)


def train(cfg: REINFORCEConfig, run: RunDir | None = None, reward_fn=None, monitor: Monitor | None = None,
          given: Given = NOTHING) -> RunResult:
    """Run REINFORCE as configured (trainers/online/loop.py's `train_online` says what each argument does)."""
    return train_online(cfg, REINFORCE(cfg), run, reward_fn, monitor, given)
