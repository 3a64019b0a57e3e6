"""The online loop's prompt draws, and its side of `--async_generation` (rollout/async_generator.py).

Prompts come from shuffled passes over the train split drawn from a generator of their own, apart from the
minibatch shuffles', so the prompts of update u are the same whether they are drawn when update u starts
(the synchronous loop) or k updates earlier (an asynchronous run asks for its rollouts ahead).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from contextlib import contextmanager
from collections.abc import Iterator

import torch

from rlhflab.errors import UserInputError
from rlhflab.rollout.async_generator import AsyncGenerator, Delivered, GeneratorJob
from rlhflab.rollout.generate import Generated, GenerationSettings
from rlhflab.rollout.roles import PolicyRoles
from rlhflab.trainers.online.ranks import rollout_seed

log = logging.getLogger("rlhflab")


class PromptDraws:
    """The next batch's prompt indices: `count` prompts of shuffled passes, each repeated `group` times."""

    def __init__(self, order: list[int], generator: torch.Generator, count: int, group: int, num_rows: int):
        self.order, self.generator = list(order), generator
        self.count, self.group, self.num_rows = count, group, num_rows

    def next(self) -> list[int]:
        while len(self.order) < self.count:
            self.order.extend(torch.randperm(self.num_rows, generator=self.generator).tolist())
        picked, self.order = self.order[: self.count], self.order[self.count:]
        return [i for i in picked for _ in range(self.group)]


def check_async(cfg, value_mode: str, distributed: bool, policy_gradient: bool = True) -> None:
    """What --async_generation does not do yet, refused before anything is loaded."""
    if not cfg.async_generation:
        return
    problems = [
        (cfg.max_staleness < 0, f"max_staleness must be >= 0, got {cfg.max_staleness}", "--max_staleness"),
        (cfg.generator_threads < 1, f"generator_threads must be >= 1, got {cfg.generator_threads}",
         "--generator_threads"),
        (cfg.generation_backend == "vllm", "async_generation samples with the lean or hf backend, not vllm",
         "--generation_backend"),
        (distributed, "async_generation runs in one training process for now", "torchrun / accelerate launch"),
        (value_mode == "lora_adapter", "async_generation with value_mode lora_adapter (two adapters on one base) is "
                                       "not supported", "--value_mode"),
        (cfg.lora_merge_generation, "async_generation with lora_merge_generation is not supported",
         "--lora_merge_generation"),
    ]
    for bad, message, where in problems:
        if bad:
            raise UserInputError(message, where, "drop --async_generation, or change the setting named")
    if not policy_gradient and cfg.max_staleness > 0:
        log.warning("--async_generation --max_staleness %d: this method's loss has no policy-gradient term to weight "
                    "(online DPO's pairs), so its rollouts up to %d updates old are trained on uncorrected",
                    cfg.max_staleness, cfg.max_staleness)


class AsyncRollouts:
    """Which rollouts the generator was asked for (update -> the prompt indices drawn for it), and the calls."""

    def __init__(self, generator: AsyncGenerator, draws: PromptDraws, prompt_ids: list[list[int]], seed: int,
                 num_updates: int):
        self.generator, self.draws, self.prompt_ids = generator, draws, prompt_ids
        self.seed, self.num_updates = seed, num_updates
        self.asked: dict[int, list[int]] = {}

    def ask(self, update: int, batch_ids: list[int] | None = None) -> None:
        """Ask for rollout `update` (prompts drawn now unless given: a checkpoint's in-flight rollouts)."""
        if update > self.num_updates or update in self.asked:
            return
        batch_ids = self.draws.next() if batch_ids is None else batch_ids
        self.asked[update] = batch_ids
        self.generator.ask(update, [self.prompt_ids[i] for i in batch_ids], rollout_seed(self.seed, update))

    def take(self, update: int) -> tuple[list[int], Delivered, float]:
        """Rollout `update`: its prompt indices, what the generator delivered, and the seconds waited for it."""
        started = time.time()
        delivered = self.generator.receive(update)
        return self.asked.pop(update), delivered, time.time() - started

    def after_update(self, roles: PolicyRoles, update: int) -> None:
        """Push the weights of `update` and ask for the rollout they are the oldest allowed for."""
        self.generator.push(roles.policy, update)
        self.ask(update + 1 + self.generator.max_staleness)

    def in_flight(self) -> tuple[list[list], dict[str, torch.Tensor]]:
        """The rollouts asked for and not trained on, waited for: [[update, prompt indices, weights' version], ...]
        and their tensors as `in_flight.<update>.<field>`, for a checkpoint (a resume then trains on exactly
        what the uninterrupted run would have)."""
        listed, tensors = [], {}
        for update, ids in sorted(self.asked.items()):
            delivered = self.generator.peek(update)
            listed.append([update, ids, delivered.version])
            for name in GENERATED_FIELDS:
                value = getattr(delivered.generated, name)
                if value is not None:
                    tensors[f"{IN_FLIGHT}{update}.{name}"] = value.contiguous()
        return listed, tensors

    def restore(self, update: int, batch_ids: list[int], version: int, tensors: dict[str, torch.Tensor]) -> None:
        """A checkpoint's in-flight rollout, as the generator delivered it before the run stopped."""
        fields = {name: tensors.get(f"{IN_FLIGHT}{update}.{name}") for name in GENERATED_FIELDS}
        self.asked[update] = batch_ids
        self.generator.restore(Delivered(update, version, Generated(**fields), 0.0))


IN_FLIGHT = "in_flight."  # checkpoint tensor names of the rollouts in flight: in_flight.<update>.<field>
GENERATED_FIELDS = tuple(f.name for f in dataclasses.fields(Generated))


def in_flight_tensors(state: dict) -> dict[str, torch.Tensor]:
    """The tensors of the rollouts a checkpoint's state kept in flight (none in a synchronous run's)."""
    return dict(state.get("in_flight_rollouts") or {})


@contextmanager
def async_rollouts(cfg, roles: PolicyRoles, tokenizer, settings: GenerationSettings, draws: PromptDraws,
                   prompt_ids: list[list[int]], done: int, num_updates: int, in_flight: list[list],
                   kept: dict[str, torch.Tensor]) -> Iterator[AsyncRollouts | None]:
    """The generator process for the updates after `done` (None without --async_generation), stopped on the way
    out. A resumed run takes back the rollouts its checkpoint had in flight (`in_flight`, their tensors `kept`),
    so it trains on what the uninterrupted run trained on."""
    if not cfg.async_generation:
        yield None
        return
    job = GeneratorJob(settings, tokenizer.pad_token_id, tokenizer.eos_token_id, cfg.generation_backend,
                       cfg.generator_threads, roles.precision.mode)
    with roles.sampler() as policy:
        generator = AsyncGenerator(policy, job, cfg.max_staleness, done)
    rollouts = AsyncRollouts(generator, draws, prompt_ids, cfg.seed, num_updates)
    try:
        for update, batch_ids, version in in_flight:
            rollouts.restore(update, batch_ids, version, kept)
        for update in range(done + 1, done + 2 + cfg.max_staleness):
            rollouts.ask(update)
        yield rollouts
    finally:
        generator.close()
