"""The online loop over several processes (docs/scaling-out.md "Several processes"): one global batch, each rank a part.

    torchrun --nproc_per_node 2 -m rlhflab ppo --model SFT_DIR --reward checker

`batch_size` stays the global batch. Every update:
  1. every rank draws the same prompts; rank r takes its block of them (each prompt's `num_generations`
     answers stay on one rank: prompts are shared out, answers are not) and generates its answers with
     sampling noise drawn for the whole global batch from a generator seeded by (seed, update)
     (`rollout_generator`), so the answers are the same at any world size;
  2. its rows are padded to the global batch's widths, their old / reference log-probs and values computed;
  3. every tensor of the rollout and the scores are gathered (`gather_rollout`, parallel.gather_rows: exact):
     every rank holds the global batch, so advantages, whitening, group baselines, the KL controller's input
     and the logged metrics are the single-process ones, computed the same on every rank;
  4. each minibatch (the same rows on every rank: the same seeded shuffle) is cut into micro-batches as one
     process cuts it with gradient_accumulation_steps ceil(g / W) x W (`micro_batches`); rank r trains on its
     block of them through the engine, which sums the gradients (DDP averages, `Wrapped.backward` scales);
  5. rank 0 evaluates on whole weights and writes the run folder; every rank takes the same stop and
     keep-best decisions because it reads the same numbers (evaluations are broadcast).

FSDP2 holds shards: forwards then take the model's own path (no lean forward reads whole weights), and
every rank samples from a whole-weight copy gathered before each rollout (`Wrapped.gathered(all_ranks)`).
DeepSpeed ZeRO-3 partitions the weights: the same as FSDP2. ZeRO-2 keeps whole weights on every rank (it
partitions gradients and AdamW state): rollouts, lean forwards and evaluation run as under DDP. Under both
the engine clips and steps (one engine over policy and value, with the algorithm's parameter groups), and
checkpoints hold its own files (`Wrapped.save_sharded`).
The reward model, when there is one, is replicated on every rank (each scores its own answers).
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, replace
from typing import Iterator

import torch
from torch import Tensor, nn

from rlhflab import parallel
from rlhflab.errors import UserInputError
from rlhflab.rollout.backends import backend_of, use_backend
from rlhflab.rollout.generate import BatchPlace
from rlhflab.rollout.roles import Engines, PolicyRoles
from rlhflab.rollout.rollout import Rollout
from rlhflab.trainers.setup import stream_seed


def rollout_seed(seed: int, update: int, sampling_round: int = 0) -> int:
    """The token-sampling seed of update `update`: a stream of its own, apart from the prompt order's (`seed`);
    `sampling_round` > 0: a --dynamic_sampling refill round's."""
    if sampling_round:
        return stream_seed("rlhflab-refill", seed, update, sampling_round)
    return stream_seed("rlhflab-rollout", seed, update)


def rollout_generator(seed: int, update: int, device, sampling_round: int = 0) -> torch.Generator:
    """The sampling generator of update `update` (its refill round `sampling_round`), fresh each time: no rank's
    draws depend on how long another rank (or an earlier update) decoded, and a resumed run samples what the
    uninterrupted one sampled."""
    return torch.Generator(device=device).manual_seed(rollout_seed(seed, update, sampling_round))


def check_world(cfg, group: int, whole_groups: bool, world: parallel.World) -> None:
    """Refuse global batches that do not share out: each rank takes whole prompts (with all their answers)."""
    if not world.distributed:
        return
    if group == 1:
        parallel.local_batch_size(cfg.batch_size, world, "batch_size")
    prompts = cfg.batch_size // group
    if prompts % world.world_size:
        step = world.world_size * group
        lower = prompts // world.world_size * step
        raise UserInputError(
            f"batch_size {cfg.batch_size} is {prompts} prompts x {group} answers, and {prompts} prompts do not "
            f"share out over {world.world_size} processes (each process answers whole prompts: a prompt's answers "
            "stay together for their group statistics)", "--batch_size",
            f"use a batch_size of a multiple of {step} answers, e.g. "
            + (f"{lower} or {lower + step}" if lower else f"{step}"))
    if whole_groups:
        step_rows = cfg.batch_size // cfg.num_mini_batches
        micro = math.ceil(step_rows / accumulation_over(cfg.gradient_accumulation_steps, world.world_size))
        if micro % group:
            raise UserInputError(
                f"over {world.world_size} processes a minibatch of {step_rows} answers is cut into micro-batches of "
                f"{micro}, which do not hold whole groups of {group} answers", "--num_mini_batches",
                f"make batch_size / num_mini_batches a multiple of {world.world_size * group}")


def accumulation_over(steps: int, world_size: int) -> int:
    """Micro-batches per minibatch over all ranks: `gradient_accumulation_steps` rounded up to a multiple of
    the world size, so that every rank runs the same number (each forward and backward is a collective)."""
    return math.ceil(steps / world_size) * world_size


def micro_cut(rows: int, accumulation: int, world_size: int) -> tuple[int, int]:
    """(rows per micro-batch, micro-batches over all ranks) of a minibatch of `rows`: as one process with
    `accumulation_over(accumulation, W)` accumulation steps cuts it (the last may be shorter)."""
    size = max(1, math.ceil(rows / accumulation_over(accumulation, world_size)))
    return size, math.ceil(rows / size)


def micro_batches(mb_idx: Tensor, accumulation: int, world: parallel.World) -> list[tuple[int, Tensor, bool]]:
    """This rank's micro-batches of a minibatch: (position among all ranks' micro-batches, rows, real).

    The minibatch is cut as `micro_cut` says (so W processes log what that one process logs); rank r takes
    the r-th block of the micro-batches. A rank short of real ones repeats the first with `real` False: run
    it with zero weight (the same collectives, no change to the gradient)."""
    size, _ = micro_cut(len(mb_idx), accumulation, world.world_size)
    cut = [mb_idx[s : s + size] for s in range(0, len(mb_idx), size)]
    per_rank = math.ceil(len(cut) / world.world_size)
    mine = range(world.rank * per_rank, (world.rank + 1) * per_rank)
    return [(i, cut[i] if i < len(cut) else cut[0], i < len(cut)) for i in mine]


def merged_history(entries: list[tuple[tuple, dict]], world: parallel.World) -> list[dict]:
    """Every rank's micro-batch stats in the order one process would have them (entries keyed by position)."""
    if not world.distributed:
        return [stats for _, stats in entries]
    plain = [(key, {k: float(v) for k, v in stats.items()}) for key, stats in entries]
    everyone = sorted((e for part in parallel.gather_objects(plain, world) for e in part), key=lambda e: e[0])
    return [{k: torch.tensor(v) for k, v in stats.items()} for _, stats in everyone]


# --- the global batch ---------------------------------------------------------------------


def rollout_place(prompts: list[list[int]], share: parallel.Share, group: int) -> BatchPlace:
    """Where this rank's answers sit in the global batch of `prompts` (one per answer, groups contiguous)."""
    return BatchPlace(first=share.positions[0] * group, total=len(prompts), prompt_width=max(len(p) for p in prompts))


def gather_rollout(rollout: Rollout, world: parallel.World) -> Rollout:
    """Every rank's rollout rows, in global order, on every rank (the policy forward kept for reuse is not)."""
    if not world.distributed:
        return rollout
    fields = ("query_ids", "query_mask", "response_ids", "response_mask", "logprobs", "ref_logprobs", "values",
              "entropy", "ended_with_eos")
    if not world.any(rollout.sampler_logprobs is None):  # every rank gathers the same fields
        fields += ("sampler_logprobs",)
    gathered = {name: parallel.gather_rows(getattr(rollout, name), world) for name in fields}
    return replace(rollout, policy_forward=None, **{"sampler_logprobs": None, **gathered})


# --- engines ---------------------------------------------------------------------------------


class Trained(nn.Module):
    """The modules an online run trains (policy, value head or value model), as one module for the engines.

    `_no_split_modules` lists the decoder-layer classes FSDP2 shards one by one (parallel.wrap.decoder_layers)."""

    def __init__(self, roles: PolicyRoles):
        super().__init__()
        self.policy = roles.policy
        self.value_head = roles.value_head
        self.value_model = roles.value_model
        trunks = [roles.policy, getattr(roles.value_model, "backbone", None)]
        bases = [m.get_base_model() if hasattr(m, "get_base_model") else m for m in trunks if m is not None]
        self._no_split_modules = sorted({name for b in bases for name in getattr(b, "_no_split_modules", None) or []})


@dataclass
class OnlineRanks:
    """The processes of one online run, and the engines its roles' forwards run through."""

    world: parallel.World
    trained: parallel.Wrapped  # the Trained module (policy + value)
    reference: parallel.Wrapped | None  # the resident whole-weight reference; None with LoRA or reload
    roles: PolicyRoles
    device: torch.device  # where the policy's weights live: the rollouts' sampling generators go there too
    backend: object  # the generation backend bound to the policy (bound to its whole-weight copies too)

    @property
    def layout(self) -> parallel.Layout:
        return self.trained.layout

    @property
    def sharded(self) -> bool:
        """Each rank holds part of the trained state (FSDP2, DeepSpeed): each writes its part of a checkpoint."""
        return self.layout.sharded

    @property
    def partitioned(self) -> bool:
        """Each rank holds part of the weights (FSDP2, ZeRO-3): whole weights only in gathered copies."""
        return parallel.holds_shards(self.trained.model)

    @contextlib.contextmanager
    def whole_policy(self, on_every_rank: bool = True) -> Iterator[nn.Module | None]:
        """The policy with its whole current weights (FSDP2, ZeRO-3: gathered into a plain copy; a collective
        every rank enters); with `on_every_rank` False only rank 0 gets it (the others get None)."""
        if not self.partitioned:
            yield self.roles.policy if on_every_rank or self.world.is_main else None
            return
        with self.trained.gathered(all_ranks=on_every_rank) as whole:
            if whole is not None:
                use_backend(whole.policy, self.backend)
            yield whole.policy if whole is not None else None

    @contextlib.contextmanager
    def whole_roles(self) -> Iterator[PolicyRoles | None]:
        """Rank 0: roles whose trained modules hold the whole weights (to save); other ranks: None."""
        if not self.partitioned:
            yield self.roles if self.world.is_main else None
            return
        with self.trained.gathered() as whole:
            if whole is None:
                yield None
                return
            plain = copy.copy(self.roles)
            plain.policy, plain.value_head, plain.value_model = whole.policy, whole.value_head, whole.value_model
            yield plain


def through(wrapped: parallel.Wrapped):
    """`fn()` run as a forward of `wrapped`'s engine (what Engines asks for)."""
    return lambda fn: wrapped(lambda _module: fn())


def wrap_roles(roles: PolicyRoles, cfg, world: parallel.World) -> OnlineRanks:
    """Wrap the trained modules (and a resident reference) for `cfg.parallel_strategy`; bind the roles'
    forwards to the engines. One process: nothing is wrapped, the roles run as they always did.
    Call before building the optimiser (FSDP2 replaces the parameters; DeepSpeed's engine is built around it:
    `ranks.trained.prepare(optimizer, max_grad_norm)`)."""
    device, backend = next(roles.policy.parameters()).device, backend_of(roles.policy)
    trained = parallel.wrap_model(Trained(roles), world, cfg.parallel_strategy, plain_on_every_rank=True)
    reference = None
    if roles.reference is not None:
        reference = parallel.wrap_frozen(roles.reference, world, cfg.parallel_strategy, shard=cfg.shard_frozen_models)
    ranks = OnlineRanks(world, trained, reference, roles, device, backend)
    if not world.distributed:
        return ranks
    sharded_reference = reference is not None and reference.layout.sharded
    roles.engines = Engines(trained=through(trained),
                            reference=through(reference) if sharded_reference else Engines().reference)
    if ranks.partitioned:
        roles.lean = False  # the lean forwards read whole weights; FSDP2 / ZeRO-3 hold shards (KL == 0: one path)
        roles.generation_policy = ranks.whole_policy
    return ranks
