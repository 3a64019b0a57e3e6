"""Step 5 of the online loop: `algorithm.epochs` passes over shuffled minibatches of one scored rollout.

Each minibatch is one AdamW step; its micro-batches' losses add up to the minibatch's loss (StepShare),
whatever the gradient accumulation. Several processes (trainers/online/ranks.py): every rank holds the
global rollout and shuffles it the same way, trains on its block of each minibatch's micro-batches
through the engine (which sums the gradients over ranks), and the logged stats are every rank's.
Every rank runs as many micro-batches (padding ones with zero weight) and stops a step at the same one:
under FSDP2 and DeepSpeed each backward is a collective. DeepSpeed's engine clips and steps itself.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Literal

import torch

from rlhflab import parallel
from rlhflab.trainers.nonfinite import clip_and_step
from rlhflab.trainers.online.algorithm import Algorithm, ScoredRollout, StepPart, StepShare
from rlhflab.trainers.online.controls import truncation_masked
from rlhflab.trainers.online.ranks import merged_history, micro_batches, micro_cut


def micro_losses(algorithm: Algorithm, roles, batch: ScoredRollout, adv, idx, share: StepShare, temperature: float,
                 forward: tuple | None = None, part: StepPart = "all"):
    """Loss of one micro-batch `idx`, scaled by its share of the step.

    `forward`: the rollout's own policy forward over all rows (`Rollout.policy_forward`: log-probs and values),
    used instead of running it again when the weights have not changed since. `part` (Algorithm.step_parts):
    "all", or the one trained model whose forward runs and whose loss is returned ("policy" / "value")."""
    rollout = batch.rollout
    q, qm, r, rm = (t[idx] for t in (rollout.query_ids, rollout.query_mask, rollout.response_ids, batch.mask))
    # --entropy_coef: the entropy from the same log-softmax pass, with its gradient (never from a reused forward)
    with_entropy = algorithm.entropy_in_loss and part != "value"
    if forward is not None and not with_entropy:
        logprobs, values = forward[0][idx], (forward[1][idx] if forward[1] is not None else None)
        logprobs, values = (None if part == "value" else logprobs), (None if part == "policy" else values)
    elif with_entropy:
        logprobs, entropy, values = roles.logprobs_and_values(q, qm, r, rm, temperature, part=part, entropy_grad=True)
    else:
        logprobs, _, values = roles.logprobs_and_values(q, qm, r, rm, temperature, part=part)
    values = values.float() if values is not None else None
    extra = {"part": part} if part != "all" else {}
    if with_entropy:
        extra["entropy"] = entropy
    return algorithm.loss(logprobs, values, batch, adv, idx, share, **extra)


def update_passes(algorithm: Algorithm, roles, optimizer, scheduler, batch: ScoredRollout, adv, cfg, generator,
                  update: int = 0, prompt_keys: list[int] | None = None,
                  trained: parallel.Wrapped | None = None) -> dict:
    """Step 5: algorithm.epochs x num_mini_batches optimiser steps; returns averaged stats, and under
    "skipped" how many of those steps a non-finite loss or gradient dropped (cfg.nonfinite == "skip";
    "stop" raises naming the rollout rows and `prompt_keys[row]`, their train-prompt indices).
    `trained`: the engine around the trained modules when several processes train (None: one process).
    The forwards run under the roles' autocast (`roles.precision`), the backwards outside it; fp16 scales each
    loss before its backward, and a step the scaler skips is counted there (amp/skipped_steps), not here.
    A minibatch whose algorithm steps its trained models one after another (`algorithm.step_parts()`: PPO's
    value_step=after_policy) takes one clipped optimiser step per part, each freeing its gradients before the
    next part's backward (the parameters without a gradient are left as they are by that step); each part is
    a step of its own for "skipped" and for fp16's scaler, and the LR schedule steps once for the minibatch
    when any of its parts was applied."""
    world = trained.world if trained is not None else parallel.SINGLE
    # --mask_truncated_completions: the truncated responses leave the loss here, after the advantages were formed
    # with them (trainers/online/controls.py); their attention changes, so the rollout's forward is not reused
    masked = truncation_masked(batch, cfg.mask_truncated_completions)
    narrowed, batch = masked is not batch, masked
    roles.train(True)
    # FSDP2 may hold a layer unsharded between forwards: the optimiser's parameters are the sharded ones
    params = [p for g in optimizer.param_groups for p in g["params"]] if world.distributed and trained.layout.sharded \
        else roles.trainable_parameters()
    rollout = batch.rollout
    size = rollout.batch_size
    mb_size = size // cfg.num_mini_batches
    history: list[tuple[tuple, dict]] = []  # ((pass, minibatch, micro-batch), stats): every rank's, merged below
    skipped = 0
    rollout_tokens = batch.mask.sum().clamp(min=1).item()
    step = MinibatchStep(algorithm, roles, optimizer, scheduler, batch, adv, cfg, params, trained, update, prompt_keys)
    # the rollout's forward is the first step's forward only if that step sees every row at the rollout's weights
    reuse = rollout.policy_forward if step.micro >= size and not narrowed and not algorithm.entropy_in_loss else None
    for epoch in range(algorithm.epochs):
        order = shuffled_rows(size, batch.group_size if algorithm.whole_groups else 1, generator)
        for start in range(0, size, mb_size):
            mb_idx = order[start : start + mb_size]
            share = StepShare(tokens=batch.mask[mb_idx].sum().clamp(min=1).item(), rows=len(mb_idx),
                              rollout_tokens=rollout_tokens, response_length=cfg.response_length,
                              steps=cfg.num_mini_batches, index=mb_idx)
            parts = algorithm.step_parts()
            applied = False
            for part in parts:  # a part steps weights the other parts' forwards do not read
                done = step.run(part, (epoch, start), mb_idx, share, reuse, steps_schedule=len(parts) == 1)
                skipped += done.outcome == "dropped"
                applied |= done.outcome == "applied"
                history.extend(done.history)
            if len(parts) > 1 and applied:  # the schedule counts minibatches with an applied step
                scheduler.step()
            reuse = None  # its weights are stale after this minibatch
    return {**average_stats(merged_history(history, world)), "skipped": skipped}


@dataclass(frozen=True)
class StepDone:
    history: list  # ((pass, minibatch start, micro-batch), stats) of this rank's real micro-batches; [] unless applied
    outcome: Literal["applied", "dropped", "overflow"]  # dropped: non-finite; overflow: fp16's scaler skipped it


class MinibatchStep:
    """One optimiser step of one minibatch (or of one part of it: `micro_losses`): its micro-batches' forwards
    and backwards, then the clipped step."""

    def __init__(self, algorithm: Algorithm, roles, optimizer, scheduler, batch: ScoredRollout, adv, cfg, params,
                 trained: parallel.Wrapped | None, update: int, prompt_keys: list[int] | None):
        self.algorithm, self.roles, self.optimizer, self.scheduler = algorithm, roles, optimizer, scheduler
        self.batch, self.adv, self.cfg, self.params = batch, adv, cfg, params
        self.trained, self.update, self.prompt_keys = trained, update, prompt_keys
        self.world = trained.world if trained is not None else parallel.SINGLE
        self.micro, self.count = micro_cut(batch.rollout.batch_size // cfg.num_mini_batches,
                                           cfg.gradient_accumulation_steps, self.world.world_size)

    def run(self, part: StepPart, place: tuple, mb_idx, share: StepShare, reuse: tuple | None,
            steps_schedule: bool = True) -> StepDone:
        """The step's outcome and, when applied, its micro-batches' stats, with the step's gradient norm on the
        last one (under "value_grad_norm" for the value part). `steps_schedule`: the LR schedule steps with it
        (else the caller steps it once for the minibatch)."""
        cfg, trained, precision = self.cfg, self.trained, self.roles.precision
        step_history, loss_value, rows = [], 0.0, mb_idx
        mine = micro_batches(mb_idx, cfg.gradient_accumulation_steps, self.world)
        for n, (position, idx, real) in enumerate(mine):
            with trained.sync(n == len(mine) - 1) if trained is not None else nullcontext():
                loss, stats = micro_losses(self.algorithm, self.roles, self.batch, self.adv, idx, share,
                                           cfg.temperature, reuse, part)
                reuse = None  # its weights are stale after this step
                if self.world.any(not torch.isfinite(loss)):  # no backward through it: the step is dropped below
                    loss_value, rows = loss.item() if not torch.isfinite(loss) else float("nan"), idx
                    if trained is not None:  # DeepSpeed: its step drops what it accumulated (every rank)
                        trained.drop_step(loss)
                    break
                backward(loss, real, trained, precision)
            if real:
                step_history.append(((*place, position), stats))
        name = self.algorithm.name.upper() + ("" if part == "all" else f" {part}")
        try:
            grad_norm = clip_and_step(self.optimizer, self.scheduler if steps_schedule else None,
                                      self.params, cfg.max_grad_norm, loss_value, cfg.nonfinite, name,
                                      engine=trained, precision=precision)  # DeepSpeed steps itself
        except FloatingPointError as err:
            raise FloatingPointError(f"{name} update {self.update}: {err} "
                                     f"({rows_named(rows.tolist(), self.prompt_keys)}); "
                                     "no checkpoint written after it") from err
        if grad_norm is None:  # its stats stay out of the averages (a step fp16's scaler skipped is counted there)
            return StepDone([], "overflow" if precision.overflowed else "dropped")
        if step_history and step_history[-1][0][2] == self.count - 1:  # once per step, on its last micro-batch
            step_history[-1][1]["value_grad_norm" if part == "value" else "grad_norm"] = grad_norm.detach()
        return StepDone(step_history, "applied")


def backward(loss: torch.Tensor, real: bool, trained: parallel.Wrapped | None, precision) -> None:
    """The micro-batch's backward (of the fp16-scaled loss); through the engine when several processes train,
    where a padding micro-batch runs with zero weight: the same collectives, no gradient."""
    if trained is None:
        precision.scale(loss).backward()
    else:
        trained.backward(precision.scale(loss if real else loss * 0.0))


def shuffled_rows(size: int, group: int, generator) -> torch.Tensor:
    """A random order of the rollout's rows; with group > 1 a random order of whole groups, each contiguous."""
    if group == 1:
        return torch.randperm(size, generator=generator)
    groups = torch.randperm(size // group, generator=generator)
    return (groups.unsqueeze(1) * group + torch.arange(group)).reshape(-1)


def rows_named(rows: list[int], prompt_keys: list[int] | None) -> str:
    """Rollout rows, and the train prompts they answered, for an error message."""
    named = f"rollout rows {rows}"
    return f"{named}, train prompts {[prompt_keys[r] for r in rows]}" if prompt_keys is not None else named


def average_stats(history: list[dict]) -> dict:
    """Mean of each stat over the steps; extremes (`*_max`, `*_min`) keep their extreme."""
    keys = {k for h in history for k in h}
    out = {}
    for key in keys:
        values = torch.stack([h[key].float() for h in history if key in h])
        if key.endswith("_max"):
            out[key] = values.max().item()
        elif key.endswith("_min"):
            out[key] = values.min().item()
        else:
            out[key] = values.mean().item()
    return out
