"""Entropy controls of the policy loss: the top-entropy token mask, the entropy bonus, the adaptive coefficient.

- `top_entropy_mask`: the policy-gradient term only on the highest-entropy share of the tokens (Wang et al. 2025,
  "Beyond the 80/20 Rule", the "forking" tokens; TRL's `top_entropy_quantile`, `GRPOTrainer.get_high_entropy_mask`).
- `entropy_bonus`: − coef × the mean token entropy, added to a loss (Williams & Peng 1991; PPO's c2 S term).
- `AdaptiveEntropyController`: Skywork-OR1's adaptive entropy control (He et al. 2025, arXiv 2505.22312; TRL's
  `use_adaptive_entropy`): the coefficient steps up while the entropy is at or below a target, down above it.
Shapes: B responses, T response tokens.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


def entropy_threshold(entropy: Tensor, mask: Tensor, quantile: float) -> Tensor | None:
    """The (1 − quantile) quantile of the entropies of `mask`'s tokens (torch.quantile's linear interpolation, as
    TRL); None when `mask` holds no token. entropy: (B, T) float; mask: (B, T) bool."""
    values = entropy[mask].float()
    if values.numel() == 0:
        return None
    return torch.quantile(values, 1.0 - quantile)


def top_entropy_mask(entropy: Tensor, mask: Tensor, quantile: float) -> Tensor:
    """(B, T) bool: the tokens of `mask` whose entropy is at least the (1 − quantile) quantile of `mask`'s
    entropies, i.e. the top `quantile` share of them (ties at the threshold all kept). quantile 1 keeps every token
    of `mask`, 0 only the highest-entropy one(s); TRL's `top_entropy_quantile`, whose paper recommends 0.2."""
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {quantile}")
    if quantile >= 1.0:
        return mask.clone()
    threshold = entropy_threshold(entropy, mask, quantile)
    if threshold is None:
        return torch.zeros_like(mask)
    return mask & (entropy >= threshold)


def entropy_bonus(entropy: Tensor, mask: Tensor, coef: float, tokens: float) -> Tensor:
    """−coef × Σ_mask entropy / tokens: a loss term whose sum over a step's micro-batches is −coef × the mean
    token entropy of the step when `tokens` counts the step's tokens (TRL: the bonus is the mean per-token entropy
    whatever the loss type). entropy: (B, T), differentiable; mask: (B, T) bool -> scalar."""
    picked = torch.where(mask, entropy, torch.zeros((), dtype=entropy.dtype, device=entropy.device))
    return -coef * picked.sum() / max(float(tokens), 1.0)


class AdaptiveEntropyController:
    """Skywork-OR1's adaptive entropy control (TRL's `use_adaptive_entropy`), one measurement at a time.

    After each measurement H of the mean token entropy:
        c <- min(c + delta, c_max)   if H <= target
        c <- max(c - delta, c_min)   otherwise,
    and the bonus applied is c while H <= target, 0 above it (`applied`): below the target the push towards
    more entropy grows by delta per measurement until the entropy is back over the target; above it nothing
    pushes and c decays. A non-finite H (an update whose tokens were all masked) leaves everything as it is."""

    def __init__(self, coef: float, target: float, delta: float, low: float, high: float) -> None:
        if delta < 0 or low < 0 or high < low:
            raise ValueError(f"adaptive entropy needs delta >= 0 and 0 <= low <= high, got {delta=}, {low=}, {high=}")
        self.value = min(max(float(coef), low), high)
        self.target, self.delta, self.low, self.high = float(target), float(delta), float(low), float(high)
        self.entropy = math.inf  # the last measurement; inf before the first: no bonus applied

    def update(self, entropy: float) -> None:
        if not math.isfinite(entropy):
            return
        step = self.delta if entropy <= self.target else -self.delta
        self.value = min(max(self.value + step, self.low), self.high)
        self.entropy = float(entropy)

    @property
    def applied(self) -> float:
        """The coefficient the loss uses: the current one while the last entropy is at or below the target."""
        return self.value if self.entropy <= self.target else 0.0

    def state_dict(self) -> dict[str, Any]:
        # JSON-safe (checkpoint state.json): no measurement yet is None
        entropy = self.entropy if math.isfinite(self.entropy) else None
        return {"kind": "adaptive_entropy", "value": self.value, "entropy": entropy, "target": self.target,
                "delta": self.delta, "low": self.low, "high": self.high}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "adaptive_entropy":
            raise ValueError(f"entropy controller state is for {state.get('kind')!r}, expected 'adaptive_entropy'")
        self.value = float(state["value"])
        self.entropy = math.inf if state["entropy"] is None else float(state["entropy"])
        self.target, self.delta = float(state["target"]), float(state["delta"])
        self.low, self.high = float(state["low"]), float(state["high"])
