"""Per-token KL estimators and the KL-penalty coefficient controllers.

Estimators follow Schulman (2020), "Approximating KL Divergence"
(http://joschu.net/blog/kl-approx.html), for KL(π || π_ref) with samples drawn
from π. Each takes `logprobs`, `ref_logprobs` (B, T) and returns (B, T); pass
`response_mask` to get 0 at padded positions whatever they hold (NaN included).
When logprobs == ref_logprobs every estimator is exactly 0 (DESIGN.md: with
policy == reference, KL == 0 exactly).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor


def _masked(x: Tensor, response_mask: Tensor | None) -> Tensor:
    return x if response_mask is None else torch.where(response_mask, x, torch.zeros_like(x))


def _log_ratio(logprobs: Tensor, ref_logprobs: Tensor, response_mask: Tensor | None) -> Tensor:
    """log π(a_t|s_t) − log π_ref(a_t|s_t), zeroed *before* any further maths at padding."""
    return _masked(logprobs - ref_logprobs, response_mask)


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor, response_mask: Tensor | None = None) -> Tensor:
    """k1 = log π − log π_ref. Unbiased, high variance, can be negative. (B, T) -> (B, T)."""
    return _log_ratio(logprobs, ref_logprobs, response_mask)


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor, response_mask: Tensor | None = None) -> Tensor:
    """k2 = ½ (log π − log π_ref)². Biased, low variance, >= 0. (B, T) -> (B, T)."""
    return 0.5 * _log_ratio(logprobs, ref_logprobs, response_mask) ** 2


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, response_mask: Tensor | None = None) -> Tensor:
    """k3 = (r − 1) − log r with r = π_ref / π. Unbiased, low variance, >= 0. (B, T) -> (B, T).

    Written as expm1(d) − d with d = log r, which is exact at d = 0 and keeps
    precision for small |d| (where r − 1 would cancel).
    """
    d = -_log_ratio(logprobs, ref_logprobs, response_mask)  # log r = log π_ref − log π
    return torch.expm1(d) - d


KLEstimator = Callable[..., Tensor]
KL_ESTIMATORS: dict[str, KLEstimator] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


class FixedKLController:
    """A constant KL coefficient β; `update` does nothing."""

    def __init__(self, value: float) -> None:
        self.value = float(value)

    def update(self, current_kl: float, n_steps: int) -> None:
        del current_kl, n_steps

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "fixed", "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(state, "fixed")
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller steering the observed KL towards `target`.

    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences",
    §2.2: e_t = clip(KL_t / KL_target − 1, −0.2, 0.2); β_{t+1} = β_t (1 + K_β e_t),
    with K_β = n_steps / horizon (n_steps: samples seen since the last update,
    as in the original lm-human-preferences code and TRL).
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKLController needs target > 0 and horizon > 0, got {target=}, {horizon=}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """A non-finite `current_kl` (a batch dropped by `--nonfinite skip`) leaves β as it is:
        fed through the clip it would make β NaN for the rest of the run."""
        if not math.isfinite(current_kl):
            return
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "adaptive", "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(state, "adaptive")
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = float(state["horizon"])


def _check_kind(state: dict[str, Any], kind: str) -> None:
    if state.get("kind") != kind:
        raise ValueError(f"KL controller state is for {state.get('kind')!r}, expected {kind!r}: {state}")
