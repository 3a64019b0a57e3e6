"""What an online algorithm hands the loop (trainers/online/loop.py), and what the loop hands back.

The loop samples prompts, generates `samples_per_prompt` responses to each (contiguous in the batch),
scores them, takes log-probs of the policy and the reference once, then asks the algorithm for
advantages and, for every micro-batch of every minibatch of every pass, for its loss. An algorithm
(trainers/ppo.py, grpo.py, rloo.py, reinforce.py) is that small unit: its config, how its advantages
are formed, its loss, whether it has a critic, and the names its metrics take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor

from rlhflab.rollout.rollout import Rollout


# what one optimiser step of a minibatch trains: every trained module ("all"), or, when an algorithm steps its
# models one after another (PPO's value_step=after_policy), the policy's loss or the value model's
StepPart = Literal["all", "policy", "value"]


@dataclass(frozen=True)
class ScoredRollout:
    """One rollout with its scores: everything an algorithm's advantages may read."""

    rollout: Rollout
    scores: Tensor  # (B,) reward of each response, missing-EOS penalty included; 0 where not valid
    valid: Tensor  # (B,) bool: the reward scored this row (a row it failed on is out of the update)
    # (B, T) bool: response tokens of valid rows; in the update's steps less the truncated responses' with
    # --mask_truncated_completions (trainers/online/controls.py)
    mask: Tensor
    kl: Tensor  # (B, T) log pi_old - log pi_ref (k1) on the valid rows' response tokens, 0 elsewhere
    group_size: int  # responses per prompt, each prompt's group contiguous in the batch
    # (B, T) importance weights on each token's policy-gradient term (core.sampler_correction_weights,
    # --sampler_correction); None = off
    sampler_weights: Tensor | None = None

    @property
    def sequence_kl(self) -> Tensor:
        """(B,) summed k1 KL of each response: the Monte-Carlo KL(pi || pi_ref) of its sequence."""
        return self.kl.sum(dim=1)


@dataclass(frozen=True)
class Advantages:
    advantages: Tensor  # (B, T), 0 outside the mask
    returns: Tensor | None  # (B, T) value targets; None without a critic
    metrics: dict  # this update's numbers under the algorithm's metric names (TRL's where TRL has them)
    # (B, T) bool: the tokens whose policy-gradient term is kept (--top_entropy_quantile: trainers/online/controls.py);
    # None = every token of the mask. The KL term and the value loss are not narrowed by it
    policy_mask: Tensor | None = None


@dataclass(frozen=True)
class StepShare:
    """What one optimiser step (a minibatch) is made of, so that its micro-batches' losses add up
    to the minibatch's loss whatever the gradient accumulation (the equivalence tests hold this)."""

    tokens: float  # response tokens in the minibatch
    rows: int  # responses in the minibatch
    rollout_tokens: float  # response tokens in the whole rollout
    response_length: int  # the length cap
    steps: int  # optimiser steps per pass over the rollout (num_mini_batches)
    index: Tensor  # the step's rows of the rollout (the minibatch); a micro-batch is a slice of it


def weighted_advantages(batch: ScoredRollout, adv: Advantages, idx: Tensor) -> Tensor:
    """Rows `idx` of the advantages, times the --sampler_correction weights when on and 0 outside the
    --top_entropy_quantile mask: a weight w >= 0 scales a token's clipped surrogate term as it scales its advantage
    (max(-wA r, -wA clip(r)) = w max(-A r, -A clip(r)))."""
    advantages = adv.advantages[idx]
    if batch.sampler_weights is not None:
        advantages = advantages * batch.sampler_weights[idx]
    if adv.policy_mask is not None:
        advantages = torch.where(adv.policy_mask[idx], advantages, torch.zeros((), dtype=advantages.dtype))
    return advantages


class Algorithm(Protocol):
    name: str  # the stage: "ppo", "grpo", "rloo", "reinforce"
    critic: bool  # whether a value model / head is trained (PPO)
    samples_per_prompt: int
    epochs: int  # passes over each rollout
    whole_groups: bool  # minibatches and micro-batches hold each prompt's samples together (online DPO's pairs)
    policy_gradient: bool  # its loss has a per-token policy-gradient term (--sampler_correction weights it)
    group_relative: bool  # its advantages compare a prompt's answers with each other (--dynamic_sampling)
    entropy_in_loss: bool  # its loss reads the policy's entropy with its gradient (--entropy_coef): `loss(entropy=)`

    def advantages(self, batch: ScoredRollout) -> Advantages:
        """Advantages (and value targets) of a scored rollout; called once per update, before any step."""
        ...

    def loss(self, logprobs: Tensor, values: Tensor | None, batch: ScoredRollout, adv: Advantages, idx: Tensor,
             share: StepShare) -> tuple[Tensor, dict]:
        """Loss of micro-batch `idx` (rows of the rollout), already scaled by its share of the step; the
        `logprobs` (and `values`) are the current policy's on those rows. Stats: detached scalars. With
        `entropy_in_loss` it is also given `entropy=` (B_idx, T), the policy's token entropy with its gradient."""
        ...

    def step_parts(self) -> tuple[StepPart, ...]:
        """What each minibatch steps, in order: ("all",) one optimiser step over every trained module; PPO with
        value_step=after_policy ("policy", "value"): two, `loss(..., part=...)` giving each part's loss."""
        ...

    def step_metrics(self, stats: dict) -> dict:
        """The loss stats averaged over an update's steps, under the algorithm's metric names."""
        ...

    def param_groups(self, roles) -> list[dict]:
        """The optimiser's parameter groups over `roles.trainable_parameters()` (PPO: the critic's own lr)."""
        ...

    def after_update(self, batch: ScoredRollout) -> None:
        """State to move once an update is done (PPO's adaptive KL coefficient)."""
        ...

    def state_dict(self) -> dict:
        ...

    def load_state_dict(self, state: dict) -> None:
        ...


class AlgorithmDefaults:
    """What most algorithms leave as is: metric names from the class's `step_names` table, and no state
    carried between updates (PPO's KL coefficient and REINFORCE's moving baseline override the last three),
    one optimiser group at the config's learning rate (PPO gives its critic a group of its own), and one
    optimiser step a minibatch."""

    step_names: dict[str, str] = {}  # averaged loss stat -> its metric name (TRL's where TRL has one)
    policy_gradient = True
    group_relative = False
    entropy_in_loss = False

    def step_metrics(self, stats: dict) -> dict:
        return {self.step_names[k]: v for k, v in stats.items() if k in self.step_names}

    def step_parts(self) -> tuple[StepPart, ...]:
        return ("all",)

    def param_groups(self, roles) -> list[dict]:
        return [{"params": roles.trainable_parameters()}]

    def after_update(self, batch: ScoredRollout) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
