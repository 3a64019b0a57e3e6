"""One PPO rollout: generate, then the numbers every later step needs, computed once."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from rlhflab.rollout.backends import generate_with, generation_autocast
from rlhflab.rollout.generate import BatchPlace, Generated, GenerationSettings
from rlhflab.rollout.roles import PolicyRoles


@dataclass(frozen=True)
class Rollout:
    query_ids: Tensor  # (B, P) left-padded prompt tokens
    query_mask: Tensor  # (B, P) bool
    response_ids: Tensor  # (B, T) pad after the first EOS
    response_mask: Tensor  # (B, T) bool, True up to and including the first EOS
    logprobs: Tensor  # (B, T) log pi_old(a_t|s_t), same temperature as sampling; 0 where masked
    ref_logprobs: Tensor  # (B, T) log pi_ref(a_t|s_t); 0 where masked
    values: Tensor  # (B, T) V_old(s_t); 0 where masked, and everywhere without a critic
    entropy: Tensor  # (B, T) policy entropy at each response position; 0 where masked
    ended_with_eos: Tensor  # (B,) bool, False when the response hit the length cap
    seconds: dict  # wall time of "generation" and "forward" (old log-probs, reference, values)
    # with keep_graph: the policy forward's (B, T) log-probs and (B, T) values (None: no critic), autograd graph
    # attached, which ARE the first training forward when one minibatch holds the whole rollout (ppo_epochs)
    policy_forward: tuple[Tensor, Tensor | None] | None = None
    # (B, T) the sampler's own log-probs of the response tokens (Generated.sampler_logprobs); 0 where masked;
    # None where the backend does not report them. Against `logprobs`: how far sampler and trainer disagree
    sampler_logprobs: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.query_ids.shape[0]


@torch.no_grad()
def collect_rollout(
    roles: PolicyRoles,
    prompts: list[list[int]],
    *,
    pad_id: int,
    eos_id: int,
    settings: GenerationSettings,
    generator: torch.Generator | None = None,
    keep_graph: bool = False,
    place: BatchPlace | None = None,
    response_width: Callable[[int], int] | None = None,
    sampled: tuple[Generated, float] | None = None,
) -> Rollout:
    """Generate responses, then recompute old log-probs and values with one forward pass.

    Old log-probs come from a forward pass over the finished sequences rather than
    from the sampling loop, so they match the training forward exactly and the
    first minibatch of the first epoch has ratio == 1 (DESIGN.md). Sampling and every
    forward run under the roles' autocast (`roles.precision`), as training does.

    `keep_graph`: run that forward in training mode with autograd on and keep it in
    `policy_forward`, so the first PPO step reuses it instead of repeating it (the same
    weights and inputs give the same numbers). Costs its activations' memory during scoring.

    Several processes (each with its part of a global batch): `place` says where `prompts` sit in it
    (sampling noise, prompt padding), and `response_width(T)` the width every process pads its responses
    to (the global batch's longest), so each row's tensors are the ones a single process would hold.

    `sampled`: the responses another process already sampled (rollout/async_generator.py) and the seconds
    this one waited for them; `prompts` and the sampling settings are then not used.
    """
    roles.train(False)
    started = time.time()
    if sampled is not None:
        out, started = sampled[0], started - sampled[1]
    else:
        with roles.sampler() as policy, generation_autocast(policy, roles.precision.autocast):
            out = generate_with(policy, prompts, pad_id=pad_id, eos_id=eos_id, settings=settings,
                                generator=generator, place=place)
    if place is not None or response_width is not None:
        out = widened(out, place.prompt_width if place is not None else 0,
                      response_width(out.response_ids.shape[1]) if response_width is not None else 0, pad_id)
    generated = time.time()
    q_ids, q_mask, r_ids, r_mask = out.query_ids, out.query_mask, out.response_ids, out.response_mask
    kept = None
    rows = (q_ids, q_mask, r_ids, r_mask, settings.temperature)
    if keep_graph:  # the log-probs with their graph: the first training step reads them, the rollout their values
        roles.train(True)
        with torch.enable_grad():
            logprobs, entropy, values = roles.logprobs_and_values(*rows, entropy=True)
        roles.train(False)
        kept = (logprobs, values)
        logprobs, values = logprobs.detach(), values.detach() if values is not None else None
    else:
        logprobs, entropy, values = roles.logprobs_and_values(*rows, entropy=True)
    ref_logprobs = roles.reference_logprobs(q_ids, q_mask, r_ids, r_mask, settings.temperature)
    zero = torch.zeros((), dtype=logprobs.dtype)
    if values is None:  # no critic
        values = torch.zeros_like(logprobs)
    return Rollout(
        query_ids=q_ids,
        query_mask=q_mask,
        response_ids=r_ids,
        response_mask=r_mask,
        logprobs=torch.where(r_mask, logprobs, zero),
        ref_logprobs=torch.where(r_mask, ref_logprobs, zero),
        values=torch.where(r_mask, values.float(), zero),
        entropy=torch.where(r_mask, entropy, zero),
        ended_with_eos=out.ended_with_eos,
        seconds={"generation": generated - started, "forward": time.time() - generated},
        policy_forward=kept,
        sampler_logprobs=sampler_logprobs_of(out, logprobs),
    )


def sampler_logprobs_of(out: Generated, logprobs: Tensor) -> Tensor | None:
    """The sampler's log-probs of the response tokens, 0 where masked; where the sampler gave none for a token (NaN:
    an EOS an engine left out), the trainer's own, so that token shows no mismatch and gets a weight of exactly 1."""
    if out.sampler_logprobs is None:
        return None
    sampled = torch.where(torch.isnan(out.sampler_logprobs), logprobs.float(), out.sampler_logprobs)
    return torch.where(out.response_mask, sampled, torch.zeros((), dtype=sampled.dtype))


def widened(out: Generated, prompt_width: int, response_width: int, pad_id: int) -> Generated:
    """`out` with its prompts left-padded to `prompt_width` and its responses right-padded to `response_width`
    columns (padding masked out), so that rows of several processes' rollouts line up in one global batch."""
    sampled = out.sampler_logprobs
    return Generated(padded(out.query_ids, prompt_width, pad_id, left=True),
                     padded(out.query_mask, prompt_width, False, left=True),
                     padded(out.response_ids, response_width, pad_id, left=False),
                     padded(out.response_mask, response_width, False, left=False), out.ended_with_eos,
                     None if sampled is None else padded(sampled, response_width, 0.0, left=False))


LEFT_PADDED = ("query_ids", "query_mask")  # (B, P): padding on the left
RIGHT_PADDED = ("response_ids", "response_mask", "logprobs", "ref_logprobs", "values", "entropy", "sampler_logprobs")


def rows_of_rollouts(rollouts: list[Rollout], picks: list[tuple[int, int]], pad_id: int) -> Rollout:
    """One rollout of rows `picks` = [(which rollout, row)] of several (each generated apart, so of other widths):
    prompts left-padded and responses right-padded to the widest, padding masked out as in any rollout. The kept
    training forward is dropped (it belongs to one rollout's rows); `seconds` adds up."""
    width_p = max(r.query_ids.shape[1] for r in rollouts)
    width_t = max(r.response_ids.shape[1] for r in rollouts)

    def field(name: str) -> Tensor | None:
        parts = [getattr(r, name) for r in rollouts]
        if any(p is None for p in parts):
            return None
        if name in LEFT_PADDED or name in RIGHT_PADDED:
            width, left = (width_p, True) if name in LEFT_PADDED else (width_t, False)
            fill = pad_id if name.endswith("_ids") else 0
            parts = [padded(p, width, fill, left) for p in parts]
        return torch.stack([parts[i][row] for i, row in picks])

    names = ("ended_with_eos", *LEFT_PADDED, *RIGHT_PADDED)
    seconds = {k: sum(r.seconds.get(k, 0.0) for r in rollouts) for k in rollouts[0].seconds}
    return Rollout(**{name: field(name) for name in names}, seconds=seconds)


def padded(t: Tensor, width: int, fill, left: bool) -> Tensor:
    """(B, W) -> (B, width) with `fill` added on the left or the right."""
    extra = width - t.shape[1]
    if extra <= 0:
        return t
    pad = t.new_full((t.shape[0], extra), fill)
    return torch.cat([pad, t] if left else [t, pad], dim=1)
