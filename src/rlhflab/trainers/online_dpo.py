"""Online (iterative, on-policy) DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI
Feedback"; Xiong et al. 2024): the online loop's sampling and scoring build the pairs.

    rlhflab online-dpo --model runs/demo-.../sft/model --num_generations 4

Each update answers every prompt `num_generations` times with the current policy and scores the answers
with the configured reward (a reward model, `--reward_fn` functions — a pass / fail verifier function
ranks too — or the suite's checker); the best and the worst answer of a prompt make one preference pair,
when their scores differ. Loss: DPO (or IPO) on those pairs against the reference's log-probs the
rollout already took, a mean over the step's pairs; `num_iterations` passes.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlhflab.config import OnlineDPOConfig
from rlhflab.core import dpo_loss, ipo_loss
from rlhflab.errors import UserInputError
from rlhflab.tracking import RunDir, RunResult
from rlhflab.trainers.given import NOTHING, Given
from rlhflab.trainers.online.algorithm import Advantages, AlgorithmDefaults, ScoredRollout, StepShare
from rlhflab.trainers.online.loop import train_online
from rlhflab.trainers.online.monitor import Monitor
from rlhflab.trainers.online.setup import check_online_config

CHOSEN, REJECTED = 1.0, -1.0  # how a pair's rows are marked in Advantages.advantages


def best_and_worst(scores: Tensor, valid: Tensor, group_size: int) -> Tensor:
    """(B,) -> (B,): CHOSEN on each group's highest valid score, REJECTED on its lowest, 0 elsewhere and in
    groups whose valid scores are all equal (no preference to learn). Ties go to the earliest sample."""
    grouped = scores.view(-1, group_size)
    ok = valid.view(-1, group_size)
    best = torch.where(ok, grouped, torch.full_like(grouped, -math.inf)).argmax(dim=1)
    worst = torch.where(ok, grouped, torch.full_like(grouped, math.inf)).argmin(dim=1)
    rows = torch.arange(grouped.shape[0])
    has_pair = grouped[rows, best] > grouped[rows, worst]
    marks = torch.zeros_like(grouped)
    marks[rows[has_pair], best[has_pair]] = CHOSEN
    marks[rows[has_pair], worst[has_pair]] = REJECTED
    return marks.reshape(-1)


def sequence_logps(logprobs: Tensor, mask: Tensor, average: bool) -> Tensor:
    """(B, T) -> (B,): summed (DPO) or length-averaged (IPO) log-probs of each answer's real tokens."""
    summed = torch.where(mask, logprobs, torch.zeros_like(logprobs)).sum(dim=1)
    return summed / mask.sum(dim=1).clamp(min=1) if average else summed


class OnlineDPO(AlgorithmDefaults):
    name = "online-dpo"
    critic = False
    whole_groups = True  # a pair's two answers must be in the same micro-batch
    group_relative = True  # advantages against the prompt's other answers
    policy_gradient = False  # a pairwise loss: nothing for --sampler_correction to weight
    step_names = {"loss": "loss", "chosen_rewards": "rewards/chosen", "rejected_rewards": "rewards/rejected",
                  "reward_accuracy": "rewards/accuracies", "reward_margin": "rewards/margins",
                  "logps_chosen": "logps/chosen", "logps_rejected": "logps/rejected", "grad_norm": "grad_norm"}

    def __init__(self, cfg: OnlineDPOConfig):
        if cfg.sampler_correction not in ("auto", "none"):  # auto: no weights here (policy_gradient False)
            raise UserInputError("online DPO's pairwise loss has no per-token policy-gradient term for "
                                 f"--sampler_correction {cfg.sampler_correction} to weight", "--sampler_correction",
                                 "leave it at none (the sampler/* metrics still show the mismatch)")
        if cfg.mask_truncated_completions:  # a masked answer would leave its pair with one side of no tokens
            raise UserInputError("online DPO trains on pairs of whole answers: --mask_truncated_completions would "
                                 "leave a pair with an empty side", "--mask_truncated_completions",
                                 "use --missing_eos_penalty or --overlong_buffer_len, which rank a cut answer lower")
        if cfg.num_generations < 2:
            raise UserInputError(f"num_generations must be >= 2 to make a pair, got {cfg.num_generations}",
                                 "--num_generations", "e.g. --num_generations 4")
        step_rows = cfg.batch_size // max(cfg.num_mini_batches, 1)
        micro_rows = math.ceil(step_rows / max(cfg.gradient_accumulation_steps, 1))
        if step_rows % cfg.num_generations or micro_rows % cfg.num_generations:
            raise UserInputError(
                f"a minibatch ({step_rows} answers) and a micro-batch ({micro_rows}) must hold whole groups of "
                f"num_generations {cfg.num_generations} answers", "--num_mini_batches / --gradient_accumulation_steps",
                "choose them so batch_size / num_mini_batches / gradient_accumulation_steps is a multiple of "
                "num_generations")
        if cfg.loss_type == "ipo" and cfg.label_smoothing:
            raise UserInputError("label_smoothing applies to loss_type sigmoid only", "--label_smoothing")
        self.cfg = cfg
        self.samples_per_prompt = cfg.num_generations
        self.epochs = cfg.num_iterations

    def advantages(self, batch: ScoredRollout) -> Advantages:
        marks = best_and_worst(batch.scores, batch.valid, batch.group_size)
        chosen, rejected = marks == CHOSEN, marks == REJECTED
        pairs = int(chosen.sum().item())
        metrics = {"pairs": pairs, "frac_reward_zero_std": 1.0 - pairs / (batch.rollout.batch_size // batch.group_size),
                   "reward": batch.scores[batch.valid].mean().item(),
                   "score/chosen": batch.scores[chosen].mean().item() if pairs else float("nan"),
                   "score/rejected": batch.scores[rejected].mean().item() if pairs else float("nan")}
        per_token = torch.where(batch.mask, marks.unsqueeze(1).expand_as(batch.mask), torch.zeros((), dtype=marks.dtype))
        return Advantages(per_token, None, metrics)

    def loss(self, logprobs: Tensor, values, batch: ScoredRollout, adv: Advantages, idx: Tensor,
             share: StepShare) -> tuple[Tensor, dict]:
        marks = adv.advantages[idx][:, 0]  # a response's first token is always real
        chosen, rejected = marks == CHOSEN, marks == REJECTED  # in row order: one of each per paired group
        step_pairs = int((adv.advantages[share.index][:, 0] == CHOSEN).sum().item())
        if not chosen.any():
            return logprobs.sum() * 0.0, {}  # no pair here: no gradient, nothing to log
        mask = batch.mask[idx]
        average = self.cfg.loss_type == "ipo"
        policy = sequence_logps(logprobs, mask, average)
        reference = sequence_logps(batch.rollout.ref_logprobs[idx], mask, average)
        if self.cfg.loss_type == "ipo":
            loss, stats = ipo_loss(policy[chosen], policy[rejected], reference[chosen], reference[rejected],
                                   self.cfg.beta)
        else:
            loss, stats = dpo_loss(policy[chosen], policy[rejected], reference[chosen], reference[rejected],
                                   self.cfg.beta, self.cfg.label_smoothing)
        pairs = int(chosen.sum().item())
        stats = {**stats, "loss": loss.detach(), "logps_chosen": policy[chosen].detach().mean(),
                 "logps_rejected": policy[rejected].detach().mean()}
        return loss * pairs / step_pairs, stats


def check_config(cfg: OnlineDPOConfig) -> None:
    """Every check `train` makes before loading anything."""
    algorithm = OnlineDPO(cfg)
    check_online_config(cfg, algorithm.epochs, algorithm.samples_per_prompt)


def train(cfg: OnlineDPOConfig, run: RunDir | None = None, reward_fn=None, monitor: Monitor | None = None,
          given: Given = NOTHING) -> RunResult:
    """Run online DPO as configured (trainers/online/loop.py's `train_online` says what each argument does)."""
    return train_online(cfg, OnlineDPO(cfg), run, reward_fn, monitor, given)
