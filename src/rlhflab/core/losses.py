"""Losses: PPO policy and value, Bradley–Terry reward model, DPO / IPO / SimPO.

Each loss returns `(loss, stats)`: a scalar tensor to backpropagate and a dict
of detached scalar tensors to log (names as TRL logs them, without prefixes).
Per-token inputs are (B, T) with a bool `response_mask`; padded positions are
replaced by 0 before any maths, so NaN / inf there reach neither the loss nor
its gradient. Sequence-level inputs are (B,).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhflab.core.masked import masked_mean, masked_var

Stats = dict[str, Tensor]


def _zero_pad(x: Tensor, response_mask: Tensor) -> Tensor:
    return torch.where(response_mask, x, torch.zeros_like(x))


# --- PPO ---------------------------------------------------------------------


def clipped_surrogate(ratio: Tensor, advantages: Tensor, cliprange: float) -> Tensor:
    """Per-token PPO objective min(ρA, clip(ρ, 1−ε, 1+ε)A) (Schulman et al. 2017, eq. 7).

    ratio, advantages: (B, T) -> (B, T). To be maximised.
    """
    return torch.min(ratio * advantages, torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange) * advantages)


def ppo_policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, response_mask: Tensor, cliprange: float
) -> tuple[Tensor, Stats]:
    """Clipped-surrogate policy loss, −masked_mean over real tokens. All inputs (B, T).

    stats: clipfrac (share of real tokens where the clipped term is the active one),
    approxkl (½ mean (log ρ)², as TRL), ratio_mean / ratio_min / ratio_max.
    """
    log_ratio = _zero_pad(logprobs - old_logprobs, response_mask)  # (B, T)
    advantages = _zero_pad(advantages, response_mask)
    ratio = torch.exp(log_ratio)  # exactly 1 where logprobs == old_logprobs
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    # max of the negated terms == −min of the objective terms (clipped_surrogate).
    loss = masked_mean(torch.max(pg_losses, pg_losses2), response_mask)
    with torch.no_grad():
        big = torch.full_like(ratio, float("inf"))
        stats = {
            "clipfrac": masked_mean((pg_losses2 > pg_losses).to(ratio.dtype), response_mask),
            "approxkl": 0.5 * masked_mean(log_ratio**2, response_mask),
            "ratio_mean": masked_mean(ratio, response_mask),
            "ratio_min": torch.where(response_mask, ratio, big).min(),
            "ratio_max": torch.where(response_mask, ratio, -big).max(),
        }
    return loss, {k: v.detach() for k, v in stats.items()}


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, response_mask: Tensor, cliprange_value: float
) -> tuple[Tensor, Stats]:
    """½ masked_mean(max((V − R)², (clip(V, V_old ± ε_v) − R)²)). All inputs (B, T).

    Value clipping as in OpenAI baselines' PPO2 / TRL (see Engstrom et al. 2020,
    "Implementation Matters", §3, on its effect). stats: clipfrac, mean_abs_error.
    """
    values = _zero_pad(values, response_mask)
    old_values = _zero_pad(old_values, response_mask)
    returns = _zero_pad(returns, response_mask)
    values_clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    vf_losses1 = (values - returns) ** 2
    vf_losses2 = (values_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(vf_losses1, vf_losses2), response_mask)
    stats = {
        "clipfrac": masked_mean((vf_losses2 > vf_losses1).to(values.dtype), response_mask),
        "mean_abs_error": masked_mean((values - returns).abs(), response_mask),
    }
    return loss, {k: v.detach() for k, v in stats.items()}


def explained_variance(values: Tensor, returns: Tensor, response_mask: Tensor) -> Tensor:
    """1 − Var(R − V) / Var(R) over real tokens: 1 is a perfect critic, 0 no better
    than a constant, < 0 worse. NaN when Var(R) == 0, as in CleanRL. (B, T) -> scalar."""
    values = _zero_pad(values.detach(), response_mask)
    returns = _zero_pad(returns.detach(), response_mask)
    var_returns = masked_var(returns, response_mask)
    if var_returns == 0:
        return torch.full((), float("nan"), dtype=returns.dtype, device=returns.device)
    return 1.0 - masked_var(returns - values, response_mask) / var_returns


# --- critic-free policy gradients (GRPO, RLOO) ---------------------------------------


def clipped_ratio_loss(
    log_ratio: Tensor, advantages: Tensor, epsilon_low: float, epsilon_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-element −min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A) with ρ = exp(log_ratio), and where the low / high
    clip is the active term (ρ < 1−ε_low with A < 0; ρ > 1+ε_high with A > 0), as TRL's GRPO counts them.

    Shapes broadcast: log_ratio (B, T) per token or (B, 1) per sequence (GSPO), advantages (B, 1) or (B, T).
    ε_high > ε_low is DAPO's clip-higher (Yu et al. 2025, §3.1).
    """
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    low = (ratio < 1.0 - epsilon_low) & (advantages < 0)
    high = (ratio > 1.0 + epsilon_high) & (advantages > 0)
    return loss, low, high


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, response_mask: Tensor, reduce: str) -> Tensor:
    """One log-ratio per response, (B, T) -> (B, 1): the token mean (GSPO, Zheng et al. 2025, eq. 7) or the
    sum, i.e. the log-ratio of the whole sequence's probability (TRL's RLOO)."""
    summed = _zero_pad(logprobs - old_logprobs, response_mask).sum(dim=1, keepdim=True)
    if reduce == "sum":
        return summed
    if reduce == "mean":
        return summed / response_mask.sum(dim=1, keepdim=True).clamp(min=1)
    raise ValueError(f"reduce must be mean or sum, got {reduce!r}")


def aggregate_token_loss(per_token: Tensor, response_mask: Tensor, loss_type: str, *, rows: float, tokens: float,
                         max_length: int) -> Tensor:
    """Sum a (B, T) per-token loss into a scalar the way GRPO's `loss_type` says, over a step of `rows`
    responses and `tokens` real tokens (a micro-batch passes its step's totals, so micro-batches add up):

    - grpo: each response's token mean, then the mean over responses (Shao et al. 2024, eq. 3);
    - bnpo / dapo: the sum over tokens / `tokens` (DAPO's token-level loss, Yu et al. 2025, §3.3: the caller
      passes the step's tokens for bnpo, the rollout's tokens per step for dapo);
    - dr_grpo: the sum over tokens / (rows × max_length), a constant (Liu et al. 2025, §3.1).
    """
    masked = _zero_pad(per_token, response_mask)
    if loss_type == "grpo":
        lengths = response_mask.sum(dim=1).clamp(min=1)
        return (masked.sum(dim=1) / lengths).sum() / rows
    if loss_type in ("bnpo", "dapo"):
        return masked.sum() / tokens
    if loss_type == "dr_grpo":
        return masked.sum() / (rows * max_length)
    raise ValueError(f"unknown loss_type {loss_type!r}")


# --- reward model --------------------------------------------------------------


def bradley_terry_loss(
    chosen_scores: Tensor, rejected_scores: Tensor, margin: Tensor | None = None
) -> tuple[Tensor, Stats]:
    """mean −log σ(r_c − r_r − m) (Ouyang et al. 2022, eq. 1; margin m as Llama 2, §3.2.2).

    chosen_scores, rejected_scores, margin: (B,). stats: accuracy (share with r_c > r_r),
    margin (mean r_c − r_r).
    """
    diff = chosen_scores - rejected_scores  # (B,)
    logits = diff if margin is None else diff - margin
    loss = -F.logsigmoid(logits).mean()
    stats = {"accuracy": (diff > 0).to(diff.dtype).mean(), "margin": diff.mean()}
    return loss, {k: v.detach() for k, v in stats.items()}


def reward_centering_penalty(chosen_scores: Tensor, rejected_scores: Tensor, coef: float) -> Tensor:
    """coef · mean((r_c + r_r)²): pulls rewards towards zero mean, which the BT loss
    leaves free (Eisenstein et al. 2023, "Helping or Herding?", §3; TRL's
    `center_rewards_coefficient`). (B,), (B,) -> scalar."""
    return coef * ((chosen_scores + rejected_scores) ** 2).mean()


def pass_fail_loss(chosen_scores: Tensor, rejected_scores: Tensor) -> Tensor:
    """Each score read as the logit of "this answer is acceptable": mean binary cross-entropy with
    label 1 for the chosen and 0 for the rejected, (softplus(−r_c) + softplus(r_r)) / 2.

    Bradley–Terry only orders the two answers of one prompt, so each prompt (and family) may sit
    on its own scale; this term puts every family's acceptable answers above 0 and its failing
    ones below, the one threshold a reward read across prompts needs (an outcome verifier trained
    as a classifier, Cobbe et al. 2021). Only meaningful where every chosen
    answer is acceptable and every rejected one is not (the built-in suite's pairs). (B,), (B,) -> scalar."""
    return 0.5 * (F.softplus(-chosen_scores).mean() + F.softplus(rejected_scores).mean())


# --- direct preference optimisation ------------------------------------------------


def _preference_stats(chosen_rewards: Tensor, rejected_rewards: Tensor) -> Stats:
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "chosen_rewards": chosen_rewards.mean(),
        "rejected_rewards": rejected_rewards.mean(),
        "reward_accuracy": (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype).mean(),
        "reward_margin": (chosen_rewards - rejected_rewards).mean(),
    }


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Stats]:
    """DPO (Rafailov et al. 2023, eq. 7), with conservative label smoothing (cDPO,
    Mitchell 2023). All inputs (B,) summed sequence log-probs.

    Implicit reward r = β (log π − log π_ref); loss = mean −log σ(r_c − r_r),
    or with smoothing ε: −(1−ε) log σ(h) − ε log σ(−h).
    """
    chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps)
    rejected_rewards = beta * (policy_rejected_logps - ref_rejected_logps)
    h = chosen_rewards - rejected_rewards
    losses = -(1.0 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)
    return losses.mean(), _preference_stats(chosen_rewards, rejected_rewards)


def ipo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float,
) -> tuple[Tensor, Stats]:
    """IPO (Azar et al. 2023, eq. 17): mean (h − 1/(2β))², h the difference of
    chosen and rejected log-ratios against the reference (β is the paper's τ).
    The paper and TRL use length-averaged log-probs here; pass those. All inputs (B,).
    """
    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    h = chosen_logratios - rejected_logratios
    losses = (h - 1.0 / (2.0 * beta)) ** 2
    return losses.mean(), _preference_stats(beta * chosen_logratios, beta * rejected_logratios)


def simpo_loss(
    policy_chosen_logps: Tensor, policy_rejected_logps: Tensor, beta: float, gamma: float
) -> tuple[Tensor, Stats]:
    """SimPO (Meng et al. 2024, eq. 6): mean −log σ(β·lp_c − β·lp_r − γ), reference-free.

    Inputs (B,) are *length-averaged* log-probs (the paper's (1/|y|) log π(y|x));
    γ is the target reward margin in reward units (TRL's `simpo_gamma`).
    """
    chosen_rewards = beta * policy_chosen_logps
    rejected_rewards = beta * policy_rejected_logps
    losses = -F.logsigmoid(chosen_rewards - rejected_rewards - gamma)
    return losses.mean(), _preference_stats(chosen_rewards, rejected_rewards)


# Entries differ in their extra arguments (SimPO takes no reference log-probs);
# call them with keywords. REFERENCE_FREE names those that need no reference model.
PreferenceLoss = Callable[..., tuple[Tensor, Stats]]
PREFERENCE_LOSSES: dict[str, PreferenceLoss] = {"dpo": dpo_loss, "ipo": ipo_loss, "simpo": simpo_loss}
REFERENCE_FREE: frozenset[str] = frozenset({"simpo"})
