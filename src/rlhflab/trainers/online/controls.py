"""The RLVR controls on the loss that PPO, GRPO, RLOO and REINFORCE share (issue 37; docs/grpo-rloo-reinforce.md
"Long responses" and "Entropy"):

- truncation masking (`mask_truncated_completions`): the responses that hit the length cap without EOS leave the
  loss's mask (update_passes narrows it), and stay in every statistic the advantages were formed from;
- the entropy bonus (`entropy_coef`, fixed or adaptive: `use_adaptive_entropy`) and the top-entropy token mask
  (`top_entropy_quantile`), whose math is core/entropy.py: `EntropyControl` is the algorithm's part of them.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from rlhflab.core import AdaptiveEntropyController, entropy_bonus, entropy_threshold, masked_mean, top_entropy_mask
from rlhflab.errors import UserInputError
from rlhflab.trainers.online.algorithm import Advantages, ScoredRollout, StepShare


def truncated_rows(batch: ScoredRollout) -> Tensor:
    """(B,) bool: the valid responses that hit the length cap without EOS."""
    return batch.valid & ~batch.rollout.ended_with_eos


def trained_mask(batch: ScoredRollout, mask_truncated: bool) -> Tensor:
    """(B, T) bool: the tokens the loss trains on, `batch.mask` less the truncated responses' when masking."""
    if not mask_truncated:
        return batch.mask
    return batch.mask & ~truncated_rows(batch).unsqueeze(1)


def truncation_masked(batch: ScoredRollout, mask_truncated: bool) -> ScoredRollout:
    """`batch` with the truncated responses out of its mask (--mask_truncated_completions), so that the loss, its
    token and response counts and its KL term leave them out; their scores, KL and validity are as they were (the
    advantages, formed before, kept them in the group's baseline). `batch` itself when off or none is truncated."""
    if not mask_truncated or not bool(truncated_rows(batch).any()):
        return batch
    return dataclasses.replace(batch, mask=trained_mask(batch, True))


def truncation_metrics(batch: ScoredRollout, mask_truncated: bool) -> dict:
    """`completions/clipped_ratio` (TRL's GRPO name: the share of responses that hit the cap without EOS, =
    response/capped_share) and, when masking, `completions/masked_truncated`: how many were left out of the loss."""
    out = {"completions/clipped_ratio": (~batch.rollout.ended_with_eos).float().mean().item()}
    if mask_truncated:
        out["completions/masked_truncated"] = int(truncated_rows(batch).sum().item())
    return out


def check_entropy_fields(cfg) -> None:
    """What the entropy fields (config.EntropyFields) must hold."""
    if not 0.0 <= cfg.top_entropy_quantile <= 1.0:
        raise UserInputError(f"top_entropy_quantile must be in [0, 1], got {cfg.top_entropy_quantile}",
                             "--top_entropy_quantile", "e.g. 0.2 (the paper's), or 1.0 for every token")
    if cfg.use_adaptive_entropy and (cfg.entropy_coef_delta < 0 or cfg.entropy_coef_min < 0
                                     or cfg.entropy_coef_max < cfg.entropy_coef_min):
        raise UserInputError(f"use_adaptive_entropy needs entropy_coef_delta >= 0 and 0 <= entropy_coef_min <= "
                             f"entropy_coef_max, got {cfg.entropy_coef_delta}, {cfg.entropy_coef_min}, "
                             f"{cfg.entropy_coef_max}",
                             "--entropy_coef_delta / --entropy_coef_min / --entropy_coef_max")


class EntropyControl:
    """An algorithm's entropy settings: the coefficient of the bonus (fixed, or adaptive), and the top-entropy mask.

    Once per update, before its steps (`prepare`): the rollout's token entropies (the policy the update starts
    from) give the top-entropy mask over the tokens the loss trains, and, when adaptive, their mean moves the
    coefficient (AdaptiveEntropyController) for this update's steps. In each micro-batch's loss (`bonus`): −coef
    × the policy's entropy from the training forward (with its gradient), over the step's kept tokens."""

    def __init__(self, cfg) -> None:
        check_entropy_fields(cfg)
        self.quantile = cfg.top_entropy_quantile
        self.mask_truncated = cfg.mask_truncated_completions
        self.adaptive = (AdaptiveEntropyController(cfg.entropy_coef, cfg.entropy_target, cfg.entropy_coef_delta,
                                                   cfg.entropy_coef_min, cfg.entropy_coef_max)
                         if cfg.use_adaptive_entropy else None)
        self.fixed = cfg.entropy_coef
        # the training forward returns the entropy with its gradient (and the rollout's forward is not reused)
        self.in_loss = cfg.entropy_coef != 0.0 or cfg.use_adaptive_entropy

    @property
    def coef(self) -> float:
        """The coefficient this update's loss applies."""
        return self.adaptive.applied if self.adaptive is not None else self.fixed

    def prepare(self, batch: ScoredRollout, adv: Advantages) -> Advantages:
        """`adv` with the update's top-entropy mask (None: every token), after the adaptive coefficient has seen
        the rollout's entropy; the `entropy_coef` metric (TRL's) when the bonus is on."""
        trained = trained_mask(batch, self.mask_truncated)
        entropy = batch.rollout.entropy
        metrics = {}
        kept = None
        if self.quantile < 1.0:
            kept = top_entropy_mask(entropy, trained, self.quantile)
            threshold = entropy_threshold(entropy, trained, self.quantile)
            metrics["entropy/top_threshold"] = threshold.item() if threshold is not None else float("nan")
        if self.adaptive is not None:  # TRL: measured over the tokens the policy loss trains
            counted = trained if kept is None else kept
            self.adaptive.update(masked_mean(entropy, counted).item() if counted.any() else float("nan"))
        if self.in_loss:
            metrics["entropy_coef"] = self.coef
        return dataclasses.replace(adv, policy_mask=kept, metrics={**adv.metrics, **metrics})

    def bonus(self, entropy: Tensor | None, batch: ScoredRollout, adv: Advantages, idx: Tensor,
              share: StepShare) -> Tensor:
        """−coef × Σ entropy over micro-batch `idx`'s kept tokens / the step's kept tokens: over a step's
        micro-batches, −coef × the step's mean token entropy. 0 when the bonus is off."""
        if not self.in_loss or entropy is None:
            return torch.zeros((), device=batch.mask.device)
        mask = batch.mask if adv.policy_mask is None else batch.mask & adv.policy_mask
        step_tokens = mask[share.index].sum().item()
        return entropy_bonus(entropy, mask[idx], self.coef, step_tokens)

    def state_dict(self) -> dict:
        return {"entropy_controller": self.adaptive.state_dict()} if self.adaptive is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.adaptive is not None and "entropy_controller" in state:
            self.adaptive.load_state_dict(state["entropy_controller"])
