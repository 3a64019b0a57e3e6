"""The online loop's prompt draws, and its side of `--async_generation` (rollout/async_generator.py).

Prompts come from shuffled passes over the train split drawn from a generator of their own, apart from the
minibatch shuffles', so the prompts of update u are the same whether they are drawn when update u starts
(the synchronous loop) or k updates earlier (an asynchronous run asks for its rollouts ahead).

Several processes (DDP): rank 0 alone starts the generator, which samples the whole global batch as one process
would (the same tokens: the sampling noise is drawn for the global batch, trainers/online/ranks.py); rank 0
pushes its weights (the same on every rank) and broadcasts each delivered rollout, of which every rank keeps
its share, so an async run in W processes trains what it trains in one.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from contextlib import contextmanager
from collections.abc import Iterator

import torch

from rlhflab import parallel
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


def check_async(cfg, strategy: str, policy_gradient: bool = True) -> None:
    """What --async_generation does not do yet, refused before anything is loaded. `strategy`: the resolved
    parallel strategy ("none" in one process)."""
    if not cfg.async_generation:
        return
    problems = [
        (cfg.max_staleness < 0, f"max_staleness must be >= 0, got {cfg.max_staleness}", "--max_staleness"),
        (cfg.generator_threads < 1, f"generator_threads must be >= 1, got {cfg.generator_threads}",
         "--generator_threads"),
        (cfg.generation_backend == "vllm", "async_generation samples with the lean or hf backend, not vllm",
         "--generation_backend"),
        (strategy not in ("none", "ddp"), f"async_generation pushes whole weights from rank 0: it runs under ddp, "
                                           f"not {strategy}, whose ranks hold parts of them", "--parallel_strategy"),
    ]
    for bad, message, where in problems:
        if bad:
            raise UserInputError(message, where, "drop --async_generation, or change the setting named")
    if not policy_gradient and cfg.max_staleness > 0:
        log.warning("--async_generation --max_staleness %d: this method's loss has no policy-gradient term to weight "
                    "(online DPO's pairs), so its rollouts up to %d updates old are trained on uncorrected",
                    cfg.max_staleness, cfg.max_staleness)


class AsyncRollouts:
    """Which rollouts the generator was asked for (update -> the prompt indices drawn for it), and the calls.

    Every rank keeps the same books (the same draws); only rank 0 holds the generator (`generator` None on the
    others) and talks to it."""

    def __init__(self, generator: AsyncGenerator | None, draws: PromptDraws, prompt_ids: list[list[int]], seed: int,
                 num_updates: int, max_staleness: int, world: parallel.World = parallel.SINGLE,
                 device: torch.device | None = None):
        self.generator, self.draws, self.prompt_ids = generator, draws, prompt_ids
        self.seed, self.num_updates, self.max_staleness = seed, num_updates, max_staleness
        self.world, self.device = world, device
        self.asked: dict[int, list[int]] = {}

    @property
    def startup_s(self) -> float:
        """Seconds the generator process took to start (its imports, the policy's copy): rank 0's."""
        return self.generator.startup_s if self.generator is not None else 0.0

    def ask(self, update: int, batch_ids: list[int] | None = None) -> None:
        """Ask for rollout `update` (prompts drawn now unless given: a checkpoint's in-flight rollouts)."""
        if update > self.num_updates or update in self.asked:
            return
        batch_ids = self.draws.next() if batch_ids is None else batch_ids
        self.asked[update] = batch_ids
        if self.generator is not None:
            self.generator.ask(update, [self.prompt_ids[i] for i in batch_ids], rollout_seed(self.seed, update))

    def take(self, update: int) -> tuple[list[int], Delivered, float]:
        """Rollout `update`: its prompt indices, what the generator delivered (the whole global batch, on every
        rank: rank 0 broadcasts it, or the generator's failure) and the seconds waited for it."""
        started = time.time()
        if not self.world.distributed:
            delivered = self.generator.receive(update)
        else:
            delivered = self.world.from_main(lambda: on_cpu(self.generator.receive(update)))
            delivered = dataclasses.replace(delivered, generated=delivered.generated.apply(lambda t: t.to(self.device)))
        return self.asked.pop(update), delivered, time.time() - started

    def after_update(self, roles: PolicyRoles, update: int) -> None:
        """Push the weights of `update` (rank 0: every rank holds the same) and ask for the rollout they are the
        oldest allowed for."""
        if self.generator is not None:
            self.generator.push(roles.policy, update)
        self.ask(update + 1 + self.max_staleness)

    def in_flight(self) -> tuple[list[list], dict[str, torch.Tensor]]:
        """The rollouts asked for and not trained on, waited for: [[update, prompt indices, weights' version], ...]
        and their tensors as `in_flight.<update>.<field>`, for a checkpoint (a resume then trains on exactly
        what the uninterrupted run would have)."""
        listed, tensors = [], {}
        if self.generator is None:  # not rank 0, which alone writes checkpoints
            return listed, tensors
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
        if self.generator is not None:
            self.generator.restore(Delivered(update, version, Generated(**fields), 0.0))


def on_cpu(delivered: Delivered) -> Delivered:
    """`delivered` with its tensors in CPU memory, to broadcast (a GPU tensor would arrive on rank 0's device)."""
    return dataclasses.replace(delivered, generated=delivered.generated.apply(lambda t: t.cpu()))


IN_FLIGHT = "in_flight."  # checkpoint tensor names of the rollouts in flight: in_flight.<update>.<field>
GENERATED_FIELDS = tuple(f.name for f in dataclasses.fields(Generated))


def in_flight_tensors(state: dict) -> dict[str, torch.Tensor]:
    """The tensors of the rollouts a checkpoint's state kept in flight (none in a synchronous run's)."""
    return dict(state.get("in_flight_rollouts") or {})


@contextmanager
def async_rollouts(cfg, roles: PolicyRoles, tokenizer, settings: GenerationSettings, draws: PromptDraws,
                   prompt_ids: list[list[int]], done: int, num_updates: int, in_flight: list[list],
                   kept: dict[str, torch.Tensor], world: parallel.World = parallel.SINGLE
                   ) -> Iterator[AsyncRollouts | None]:
    """The generator process for the updates after `done` (None without --async_generation), started by rank 0
    and stopped on the way out. A resumed run takes back the rollouts its checkpoint had in flight (`in_flight`,
    their tensors `kept`), so it trains on what the uninterrupted run trained on."""
    if not cfg.async_generation:
        yield None
        return
    job = GeneratorJob(settings, tokenizer.pad_token_id, tokenizer.eos_token_id, cfg.generation_backend,
                       cfg.generator_threads, roles.precision.mode, roles.merge_lora_for_generation)
    generator = None
    if world.is_main:  # the copy is of the unmerged policy (its adapters are merged in the process, as here)
        generator = AsyncGenerator(roles.policy, job, cfg.max_staleness, done)
    device = next(roles.policy.parameters()).device
    rollouts = AsyncRollouts(generator, draws, prompt_ids, cfg.seed, num_updates, cfg.max_staleness, world, device)
    try:
        for update, batch_ids, version in in_flight:
            rollouts.restore(update, batch_ids, version, kept)
        for update in range(done + 1, done + 2 + cfg.max_staleness):
            rollouts.ask(update)
        yield rollouts
    finally:
        if generator is not None:
            generator.close()
