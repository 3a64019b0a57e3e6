"""PPO-RLHF (Ouyang et al. 2022; TRL's PPOTrainer): the critic's algorithm in the online loop.

    rlhflab ppo --model runs/demo-.../sft/model --reward checker

Advantages: per-token rewards r_t = -beta * KL_t on every real token plus the score on the last one,
GAE (gamma, lam) against the value head's estimates, whitened over the rollout. Loss: the clipped
surrogate plus vf_coef x the clipped value loss, a token mean over the minibatch, for `num_ppo_epochs`
passes. beta may adapt towards a KL target (Ziegler et al. 2019). The critic: the value head takes its
own learning rate (`value_head_learning_rate`) and the first `value_warmup_rollouts` rollouts train it
alone (issue 16: at the policy's rate the demo's value head never predicted returns). The cycle itself
(prompts, rollout, scores, steps, evaluation, monitor, checkpoints) is trainers/online/loop.py's, shared
with GRPO, RLOO and REINFORCE.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from rlhflab import core, parallel
from rlhflab.config import PPOConfig
from rlhflab.core import KL_ESTIMATORS, clipped_value_loss, gae, ppo_policy_loss, token_rewards, whiten
from rlhflab.errors import UserInputError
from rlhflab.tracking import RunDir, RunResult
from rlhflab.trainers.given import NOTHING, Given
from rlhflab.trainers.online.algorithm import (Advantages, AlgorithmDefaults, ScoredRollout, StepPart, StepShare,
                                               weighted_advantages)
from rlhflab.trainers.online.controls import EntropyControl, truncation_metrics
from rlhflab.trainers.online.loop import train_online
from rlhflab.trainers.online.monitor import Monitor
from rlhflab.trainers.online.setup import check_online_config

log = logging.getLogger("rlhflab")


def kl_controller(cfg: PPOConfig):
    if cfg.adaptive_kl:
        return core.AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
    return core.FixedKLController(cfg.kl_coef)


def value_head_parameters(roles) -> list[torch.nn.Parameter]:
    """The scalar value head's trainable tensors (on the shared trunk, the value adapter or the value model):
    the one part of the critic that starts from nothing (a zero or random head) instead of pretrained weights."""
    head = roles.value_head if roles.value_head is not None else getattr(roles.value_model, "value_head", None)
    return [p for p in head.parameters() if p.requires_grad] if head is not None else []


def masked_var_of(x, mask):
    return core.masked_var(x, mask) if mask.sum() > 1 else torch.zeros((), device=x.device)


# the averaged loss stats under TRL's PPO metric names
STEP_NAMES = {"loss/policy": "loss/policy_avg", "loss/value": "loss/value_avg", "policy/clipfrac": "policy/clipfrac_avg",
              "policy/approxkl": "policy/approxkl_avg", "val/clipfrac": "val/clipfrac_avg", "policy/ratio_mean": "val/ratio",
              "ratio_var": "val/ratio_var", "policy/ratio_max": "policy/ratio_max", "policy/ratio_min": "policy/ratio_min",
              "grad_norm": "grad_norm", "value_grad_norm": "val/grad_norm"}


class PPO(AlgorithmDefaults):
    name = "ppo"
    critic = True
    whole_groups = False
    samples_per_prompt = 1
    step_names = STEP_NAMES

    def __init__(self, cfg: PPOConfig):
        if cfg.num_ppo_epochs <= 0:
            raise UserInputError(f"num_ppo_epochs must be > 0, got {cfg.num_ppo_epochs}", "--num_ppo_epochs")
        if cfg.adaptive_kl and (cfg.kl_target <= 0 or cfg.kl_horizon <= 0):
            raise UserInputError("adaptive_kl needs kl_target > 0 and kl_horizon > 0", "--kl_target / --kl_horizon")
        if cfg.value_head_learning_rate < 0 or cfg.value_warmup_rollouts < 0:
            raise UserInputError("value_head_learning_rate and value_warmup_rollouts must be >= 0",
                                 "--value_head_learning_rate / --value_warmup_rollouts",
                                 "0 = learning_rate / no warm-up")
        if cfg.value_mode == "lora_adapter" and cfg.lora_r <= 0:
            raise UserInputError("value_mode=lora_adapter needs a LoRA policy", "--value_mode", "set --lora_r 8 (or more)")
        check_value_step(cfg)
        updates = cfg.total_episodes // max(cfg.batch_size, 1)
        if cfg.value_warmup_rollouts and cfg.value_warmup_rollouts >= updates:
            log.warning("value_warmup_rollouts %d >= the run's %d updates: the policy never trains",
                        cfg.value_warmup_rollouts, updates)
        self.cfg = cfg
        self.epochs = cfg.num_ppo_epochs
        self.kl_ctl = kl_controller(cfg)
        self.entropy = EntropyControl(cfg)  # --entropy_coef (classic PPO's c2 S), adaptive, --top_entropy_quantile
        self.entropy_in_loss = self.entropy.in_loss
        self.updates = 0  # rollouts trained on so far: the first value_warmup_rollouts train the critic alone

    def param_groups(self, roles) -> list[dict]:
        """Everything at learning_rate but the value head, at value_head_learning_rate (when set)."""
        head = {id(p) for p in value_head_parameters(roles)}
        params = roles.trainable_parameters()
        lr = self.cfg.value_head_learning_rate or self.cfg.learning_rate
        return [{"params": [p for p in params if id(p) not in head]},
                {"params": [p for p in params if id(p) in head], "lr": lr}]

    def step_parts(self) -> tuple[StepPart, ...]:
        """value_step=after_policy: the policy's step, then the value model's (only the value model's in a critic
        warm-up rollout); else one joint step."""
        if self.cfg.value_step == "joint":
            return ("all",)
        return ("value",) if self.updates < self.cfg.value_warmup_rollouts else ("policy", "value")

    def advantages(self, batch: ScoredRollout) -> Advantages:
        cfg, rollout, mask = self.cfg, batch.rollout, batch.mask
        kl = KL_ESTIMATORS[cfg.kl_estimator](rollout.logprobs, rollout.ref_logprobs, mask)
        rewards, non_score = token_rewards(batch.scores, kl, mask, self.kl_ctl.value)
        if cfg.whiten_rewards:
            rewards = whiten(rewards, mask, shift_mean=False)
        advantages, returns = gae(rewards, rollout.values, mask, cfg.gamma, cfg.lam)
        finite = torch.isfinite(advantages + returns).all(dim=1)
        if cfg.whiten_advantages and finite.all():  # a non-finite row would spread to every row
            advantages = whiten(advantages, mask)
        self._penalty = kl  # what the KL controller follows, once the update is done
        non_score_seq = (non_score * rollout.response_mask).sum(dim=1)
        valid, scores = batch.valid, batch.scores
        metrics = {
            "objective/non_score_reward": non_score_seq[valid].mean().item(),
            "objective/rlhf_reward": (scores + non_score_seq)[valid].mean().item(),
            "val/explained_variance": core.explained_variance(rollout.values, returns, mask).item(),
            "kl_coef": self.kl_ctl.value,
            **({"completions/masked_truncated": truncation_metrics(batch, True)["completions/masked_truncated"]}
               if cfg.mask_truncated_completions else {}),
        }
        return self.entropy.prepare(batch, Advantages(advantages, returns, metrics))

    def loss(self, logprobs: Tensor | None, values: Tensor | None, batch: ScoredRollout, adv: Advantages,
             idx: Tensor, share: StepShare, part: StepPart = "all", entropy: Tensor | None = None
             ) -> tuple[Tensor, dict]:
        """The clipped surrogate + vf_coef x the clipped value loss (`part` "all"), or one of them ("policy":
        `values` may be None; "value": `logprobs` may be None), a token mean over the minibatch; less
        entropy_coef x the policy's mean token entropy (`entropy`, with its gradient) when the bonus is on."""
        cfg, rollout = self.cfg, batch.rollout
        mask = batch.mask[idx]
        weight = mask.sum().item() / share.tokens  # token mean over the minibatch
        loss, stats = torch.zeros((), device=mask.device), {}
        bonus = torch.zeros((), device=mask.device)
        if part != "value":
            pg_loss, pg_stats = ppo_policy_loss(logprobs, rollout.logprobs[idx], weighted_advantages(batch, adv, idx),
                                                mask, cfg.cliprange)
            ratio = torch.exp(logprobs - rollout.logprobs[idx]).detach()
            stats.update({"loss/policy": pg_loss.detach(), **{f"policy/{k}": v for k, v in pg_stats.items()},
                          "ratio_var": masked_var_of(ratio, mask)})
            # a critic warm-up rollout: the policy's loss is off, its weights see only the value loss's gradient
            policy_on = self.updates >= cfg.value_warmup_rollouts
            loss = (1.0 if policy_on else 0.0) * pg_loss
            if policy_on:  # the bonus is a token mean over the step already: outside the `weight` below
                bonus = self.entropy.bonus(entropy, batch, adv, idx, share)
        if part != "policy":
            vf_loss, vf_stats = clipped_value_loss(values, rollout.values[idx], adv.returns[idx], mask,
                                                   cfg.cliprange_value)
            stats.update({"loss/value": vf_loss.detach(), "val/clipfrac": vf_stats["clipfrac"]})
            loss = loss + cfg.vf_coef * vf_loss
        return loss * weight + bonus, stats

    def after_update(self, batch: ScoredRollout) -> None:
        kl = self._penalty
        self.kl_ctl.update((kl * batch.mask).sum(dim=1)[batch.valid].mean().item(), self.cfg.batch_size)  # NaN: β as is
        self.updates += 1

    def state_dict(self) -> dict:
        return {"kl_controller": self.kl_ctl.state_dict(), "updates": self.updates, **self.entropy.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.kl_ctl.load_state_dict(state["kl_controller"])
        self.updates = state.get("updates", 0)  # checkpoints written before the warm-up existed
        self.entropy.load_state_dict(state)


def check_value_step(cfg: PPOConfig) -> None:
    """value_step=after_policy needs a value model of its own, stepped in one process."""
    if cfg.value_step == "joint":
        return
    if cfg.value_mode != "separate":
        raise UserInputError(f"value_step=after_policy steps a separate value model after the policy; value_mode="
                             f"{cfg.value_mode} trains the critic on the policy's own weights", "--value_step",
                             "use --value_mode separate, or --value_step joint")
    processes = parallel.launched_ranks()[1]
    if processes > 1:
        raise UserInputError(f"value_step=after_policy runs in one process; this run has {processes}", "--value_step",
                             "use --value_step joint with several processes")


def check_config(cfg: PPOConfig) -> None:
    """Every check `train` makes before loading anything."""
    check_online_config(cfg, PPO(cfg).epochs, PPO.samples_per_prompt)


def train(cfg: PPOConfig, run: RunDir | None = None, reward_fn=None, monitor: Monitor | None = None,
          given: Given = NOTHING) -> RunResult:
    """Run PPO as configured (trainers/online/loop.py's `train_online` says what each argument does)."""
    return train_online(cfg, PPO(cfg), run, reward_fn, monitor, given)
