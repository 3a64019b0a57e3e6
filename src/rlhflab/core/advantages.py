"""Advantages and returns: GAE for PPO, reward-to-go and baselines for REINFORCE,
group baselines (RLOO, GRPO) for critic-free methods.

Per-token functions take (B, T) tensors and a right-padded `response_mask`
(each row a True prefix, then False): a response is contiguous, so the first
False marks the end of the episode. Padded positions contribute nothing
(whatever they hold, NaN included) and come back as 0.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor


def _check_right_padded(response_mask: Tensor) -> None:
    if response_mask.dtype != torch.bool:
        raise TypeError(f"response_mask must be bool, got {response_mask.dtype}")
    if (response_mask[:, 1:] & ~response_mask[:, :-1]).any():
        raise ValueError("response_mask must be right-padded: a True prefix per row, then only False")


def _zero_pad(x: Tensor, response_mask: Tensor) -> Tensor:
    return torch.where(response_mask, x, torch.zeros_like(x))


def gae(
    rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, eq. 16).

    rewards, values, response_mask: (B, T) -> advantages, returns: (B, T).
    δ_t = r_t + γ V_{t+1} − V_t and A_t = Σ_l (γλ)^l δ_{t+l}, where V after the
    last real token is 0 (the episode ends at EOS, it is not truncated).
    returns = advantages + values on real tokens (the λ-return, the value target).
    """
    _check_right_padded(response_mask)
    rewards = _zero_pad(rewards, response_mask)
    values = _zero_pad(values, response_mask)
    alive = response_mask.to(rewards.dtype)  # (B, T) 1 where a real token
    T = rewards.shape[1]
    next_value = torch.zeros_like(rewards[:, 0])  # (B,)
    last_gae = torch.zeros_like(rewards[:, 0])  # (B,)
    advantages_reversed = []
    for t in reversed(range(T)):
        # alive[t+1] == 0 means t is the last real token: no bootstrap, no carry-over.
        not_done = alive[:, t + 1] if t + 1 < T else torch.zeros_like(last_gae)
        delta = rewards[:, t] + gamma * next_value * not_done - values[:, t]
        last_gae = delta + gamma * lam * not_done * last_gae
        advantages_reversed.append(last_gae)
        next_value = values[:, t]
    advantages = _zero_pad(torch.stack(advantages_reversed[::-1], dim=1), response_mask)
    returns = _zero_pad(advantages + values, response_mask)
    return advantages, returns


def token_rewards(scores: Tensor, kl: Tensor, response_mask: Tensor, kl_coef: float) -> tuple[Tensor, Tensor]:
    """Per-token rewards of an outcome-scored response (Ziegler et al. 2019; PPO, REINFORCE):
    r_t = −β·KL_t on every real token, plus the (B,) score on the last real one. (B, T) -> rewards and
    the KL part alone (−β·KL_t), both (B, T)."""
    non_score = -kl_coef * kl
    last = (response_mask.sum(dim=1) - 1).clamp(min=0)  # (B,)
    rewards = non_score.clone()
    rewards[torch.arange(rewards.shape[0]), last] += scores
    return torch.where(response_mask, rewards, torch.zeros_like(rewards)), non_score


def discounted_returns(rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    """Reward-to-go G_t = Σ_l γ^l r_{t+l} over real tokens (REINFORCE). (B, T) -> (B, T)."""
    _check_right_padded(response_mask)
    rewards = _zero_pad(rewards, response_mask)
    running = torch.zeros_like(rewards[:, 0])  # (B,)
    out = []
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running  # padding holds 0, so nothing leaks back
        out.append(running)
    return _zero_pad(torch.stack(out[::-1], dim=1), response_mask)


def _grouped(scores: Tensor, group_size: int) -> Tensor:
    """(B,) with B = N·G, each group contiguous -> (N, G)."""
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D (B,), got shape {tuple(scores.shape)}")
    if group_size < 2 or scores.shape[0] % group_size != 0:
        raise ValueError(f"need group_size >= 2 dividing the batch, got B={scores.shape[0]}, G={group_size}")
    return scores.view(-1, group_size)


def _group_counts(grouped: Tensor) -> Tensor:
    """(N, G) -> (N, 1) number of scored (non-NaN) samples per group."""
    return (~torch.isnan(grouped)).sum(dim=1, keepdim=True).to(grouped.dtype)


def rloo_advantages(scores: Tensor, group_size: int) -> Tensor:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, §3.2; Kool et al. 2019).

    scores: (B,) with B = N·G, the G samples of each prompt contiguous -> (B,).
    A_i = s_i − mean_{j≠i} s_j = G/(G−1) · (s_i − mean_j s_j).
    A NaN score (a response the reward failed on) is left out of its siblings' baselines and gets
    advantage 0, as does a sample with no scored sibling.
    """
    grouped = _grouped(scores, group_size)  # (N, G)
    others = _group_counts(grouped) - 1  # scored siblings of each sample
    baseline = (grouped.nansum(dim=1, keepdim=True) - grouped) / others.clamp(min=1)
    advantages = torch.where(others > 0, grouped - baseline, torch.zeros_like(grouped))
    return torch.nan_to_num(advantages, nan=0.0).reshape(-1)


def _nan_std(x: Tensor, dim: int | None = None) -> Tensor:
    """Unbiased std over non-NaN entries (NaN with fewer than 2), like torch.std where nothing is NaN."""
    if dim is None:
        x, dim = x[~torch.isnan(x)], 0
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True).to(x.dtype)
    centred = x - x.nanmean(dim=dim, keepdim=True)
    variance = torch.nan_to_num(centred**2, nan=0.0).sum(dim=dim, keepdim=True) / (count - 1)
    return torch.where(count > 1, variance.sqrt(), torch.full_like(variance, float("nan")))


def grpo_advantages(scores: Tensor, group_size: int, eps: float = 1e-4, scale: str = "group") -> Tensor:
    """Group-normalised outcome advantages (Shao et al. 2024, DeepSeekMath §4.1.2).

    scores: (B,) grouped as in `rloo_advantages` -> (B,). A_i = (s_i − mean_group) / (std + eps), std
    unbiased like TRL's GRPOTrainer: the group's (`scale="group"`), the whole batch's (`"batch"`), or none
    at all, keeping only the mean-centring as Dr. GRPO recommends (`"none"`; Liu et al. 2025,
    "Understanding R1-Zero-Like Training", §3.1). NaN scores are left out of the statistics and get 0.
    """
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be group, batch or none, got {scale!r}")
    grouped = _grouped(scores, group_size)  # (N, G)
    centred = grouped - grouped.nanmean(dim=1, keepdim=True)
    if scale == "group":
        centred = centred / (torch.nan_to_num(_nan_std(grouped, dim=1), nan=0.0) + eps)
    elif scale == "batch":
        centred = centred / (torch.nan_to_num(_nan_std(scores), nan=0.0) + eps)
    return torch.nan_to_num(centred, nan=0.0).reshape(-1)


def group_std(scores: Tensor, group_size: int) -> Tensor:
    """(B,) -> (N,) unbiased std of each group's scored samples (0 with fewer than 2): TRL's frac_reward_zero_std
    counts the groups where it is 0."""
    return torch.nan_to_num(_nan_std(_grouped(scores, group_size), dim=1), nan=0.0).squeeze(1)


GroupAdvantage = Callable[..., Tensor]
ADVANTAGES: dict[str, GroupAdvantage] = {"rloo": rloo_advantages, "grpo": grpo_advantages}


def batch_mean_baseline(scores: Tensor) -> Tensor:
    """REINFORCE advantages against the batch-mean baseline: s_i − mean(s). (B,) -> (B,)."""
    return scores - scores.mean()


class MovingAverageBaseline:
    """Exponential moving average of past mean scores, a REINFORCE baseline
    (Williams 1992, §4). The baseline used for a batch is computed before that
    batch is seen, so it does not depend on the batch's own samples.

    Use: `advantages = baseline.advantages(scores); baseline.update(scores)`.
    The first `update` sets the average to the batch mean (no bias towards 0);
    before any update the baseline is 0.
    """

    def __init__(self, decay: float) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = float(decay)
        self.value = 0.0
        self.initialised = False

    def advantages(self, scores: Tensor) -> Tensor:
        """(B,) -> (B,): scores minus the current baseline."""
        return scores - self.value

    def update(self, scores: Tensor) -> None:
        batch_mean = float(scores.detach().mean())
        if self.initialised:
            self.value = self.decay * self.value + (1.0 - self.decay) * batch_mean
        else:
            self.value, self.initialised = batch_mean, True

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "value": self.value, "initialised": self.initialised}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.decay = float(state["decay"])
        self.value = float(state["value"])
        self.initialised = bool(state["initialised"])
