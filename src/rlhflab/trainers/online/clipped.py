"""The clipped policy-gradient loss of the critic-free methods (GRPO and RLOO), with TRL's GRPO metrics.

Each response carries one advantage (B,); the ratio is per token, or one per response (GSPO's token
mean of the log-ratio, or RLOO's sum: the ratio of the whole sequence's probability); a k3 KL term to
the reference may be added per token; `loss_type` says how tokens are summed (core.aggregate_token_loss).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlhflab.core import (KL_ESTIMATORS, aggregate_token_loss, clipped_ratio_loss, group_std, masked_mean,
                          sequence_log_ratio)
from rlhflab.errors import UserInputError
from rlhflab.trainers.online.algorithm import Advantages, ScoredRollout, StepShare
from rlhflab.trainers.online.controls import EntropyControl, truncation_metrics


def check_group(cfg) -> None:
    """What GRPO and RLOO ask of their group fields (config.GroupFields)."""
    if cfg.num_generations < 2:
        raise UserInputError(f"num_generations must be >= 2 (a group baseline needs siblings), got {cfg.num_generations}",
                             "--num_generations", "e.g. --num_generations 4")
    if cfg.epsilon <= 0 or cfg.epsilon_high < 0:
        raise UserInputError(f"epsilon must be > 0 and epsilon_high >= 0, got {cfg.epsilon}, {cfg.epsilon_high}",
                             "--epsilon / --epsilon_high")


@dataclass(frozen=True)
class ClipSettings:
    epsilon_low: float
    epsilon_high: float
    ratio: str  # "token", "sequence_mean" (GSPO) or "sequence_sum" (TRL's RLOO)
    loss_type: str  # grpo / bnpo / dr_grpo / dapo
    kl_loss_coef: float  # beta of the k3 KL loss term; 0 = none


def clipped_policy_loss(logprobs: Tensor, batch: ScoredRollout, adv: Advantages, idx: Tensor, share: StepShare,
                        settings: ClipSettings, entropy: EntropyControl | None = None,
                        entropies: Tensor | None = None) -> tuple[Tensor, dict]:
    """Loss of micro-batch `idx`, scaled so that a step's micro-batches add up to the step's loss. `entropy`: the
    algorithm's entropy settings, with `entropies` (B_idx, T) the policy's (with their gradient) when the bonus is
    on."""
    rollout = batch.rollout
    mask = batch.mask[idx]
    old = rollout.logprobs[idx]
    if settings.ratio == "token":
        log_ratio = torch.where(mask, logprobs - old, torch.zeros_like(logprobs))
    else:
        log_ratio = sequence_log_ratio(logprobs, old, mask, settings.ratio.removeprefix("sequence_"))
    advantages = adv.advantages[idx][:, :1]  # one per response, broadcast over its tokens
    per_token, low, high = clipped_ratio_loss(log_ratio, advantages, settings.epsilon_low, settings.epsilon_high)
    per_token = per_token.expand_as(logprobs)
    if batch.sampler_weights is not None:  # --sampler_correction: on the policy-gradient term, not on the KL term
        per_token = per_token * batch.sampler_weights[idx]
    if adv.policy_mask is not None:  # --top_entropy_quantile: the same (TRL: before the KL term is added)
        per_token = torch.where(adv.policy_mask[idx], per_token, torch.zeros((), dtype=per_token.dtype))
    kl = KL_ESTIMATORS["k3"](logprobs, rollout.ref_logprobs[idx], mask)
    if settings.kl_loss_coef:
        per_token = per_token + settings.kl_loss_coef * kl
    tokens = share.rollout_tokens / share.steps if settings.loss_type == "dapo" else share.tokens
    loss = aggregate_token_loss(per_token, mask, settings.loss_type, rows=share.rows, tokens=tokens,
                                max_length=share.response_length)
    if entropy is not None and entropy.in_loss:  # a token mean over the step whatever the loss_type (TRL)
        loss = loss + entropy.bonus(entropies, batch, adv, idx, share)
    with torch.no_grad():
        low, high = low.expand_as(mask).float(), high.expand_as(mask).float()
        ratio = torch.exp(log_ratio).expand_as(mask)
        stats = {"clip_ratio/low_mean": masked_mean(low, mask), "clip_ratio/high_mean": masked_mean(high, mask),
                 "clip_ratio/region_mean": masked_mean(torch.maximum(low, high), mask), "kl": masked_mean(kl, mask),
                 "ratio_mean": masked_mean(ratio, mask),
                 "ratio_min": torch.where(mask, ratio, torch.full_like(ratio, float("inf"))).min(),
                 "ratio_max": torch.where(mask, ratio, torch.full_like(ratio, float("-inf"))).max(),
                 # the micro-batches' losses add up to the step's; the loop averages the logged ones over the
                 # step's (equal-sized) micro-batches, so each is scaled by their count, whatever the loss_type
                 "loss": loss.detach() * share.rows / len(idx)}
    return loss, stats


def group_metrics(batch: ScoredRollout, rewards: Tensor, mask_truncated: bool = False) -> dict:
    """TRL 1.16's GRPO / RLOO rollout metrics. `reward` and `reward_std` read the scores, before any KL penalty,
    over the whole rollout (TRL's nanmean / nanstd of the summed reward functions); `frac_reward_zero_std` is
    the share of groups whose `rewards` (what the baseline sees) have no spread, i.e. no learning signal;
    `completions/clipped_ratio` the share of responses cut at the cap (and --mask_truncated_completions' count)."""
    valid = batch.valid
    scores = batch.scores[valid]
    spread = group_std(torch.where(valid, rewards, torch.full_like(rewards, float("nan"))), batch.group_size)
    return {
        "reward": scores.mean().item(),
        "reward_std": scores.std().item() if scores.numel() > 1 else 0.0,
        "frac_reward_zero_std": (spread == 0).float().mean().item(),
        "completions/mean_length": batch.rollout.response_mask.sum(dim=1).float().mean().item(),
        "entropy": masked_mean(batch.rollout.entropy, batch.rollout.response_mask).item(),
        **truncation_metrics(batch, mask_truncated),
    }


# averaged loss stats -> metric names (TRL's where it has them)
STEP_NAMES = {"loss": "loss", "kl": "kl", "clip_ratio/low_mean": "clip_ratio/low_mean",
              "clip_ratio/high_mean": "clip_ratio/high_mean", "clip_ratio/region_mean": "clip_ratio/region_mean",
              "ratio_mean": "policy/ratio_mean", "ratio_min": "policy/ratio_min", "ratio_max": "policy/ratio_max",
              "grad_norm": "grad_norm"}


def sequence_advantages(per_response: Tensor, mask: Tensor) -> Tensor:
    """(B,) -> (B, T): each response's advantage on its real tokens, 0 elsewhere."""
    return torch.where(mask, per_response.unsqueeze(1).expand_as(mask), torch.zeros((), dtype=per_response.dtype))
