"""Train / validation / test prompt sets whose content never overlaps.

Each split draws only from its own content pool (`pools.partition_pools`), so a
test prompt never shows a word or number that appears in any train or
validation prompt. Families are spread evenly over every split, so a per-family
pass rate always rests on about the same number of prompts.
"""

from __future__ import annotations

import random

from rlhflab.errors import UserInputError
from rlhflab.tasks.base import TaskItem
from rlhflab.tasks.checker import FAMILIES
from rlhflab.tasks.pools import SPLITS, ContentPool, partition_pools

_RETRIES = 20  # draws tried per slot before accepting a repeated prompt (tiny pools, big splits)


def _draw(pool: ContentPool, n: int, rng: random.Random, unique: bool) -> list[TaskItem]:
    """n items cycling over the families in a seeded order (item i is of family i % 11); optionally with
    distinct prompts."""
    families = list(FAMILIES.values())
    rng.shuffle(families)  # which families get the remainder (n % 11) is seeded, not fixed
    seen: set[str] = set()
    items = []
    for i in range(n):
        family = families[i % len(families)]
        item = family.make(rng, pool)
        for _ in range(_RETRIES if unique else 0):
            if item.prompt not in seen:
                break
            item = family.make(rng, pool)
        seen.add(item.prompt)
        items.append(item)
    return items


def _in_rounds(items: list[TaskItem], rng: random.Random) -> list[TaskItem]:
    """Draw order kept round by round (one item per family), shuffled within each round: any prefix is balanced."""
    size = len(FAMILIES)
    rounds = [items[i : i + size] for i in range(0, len(items), size)]
    for part in rounds:
        rng.shuffle(part)
    return [item for part in rounds for item in part]


def build_splits(seed: int = 0, train: int = 400, validation: int = 300, test: int = 300) -> dict[str, list[TaskItem]]:
    """The fixed prompt sets: RL prompts (train), model selection (validation), final numbers (test)."""
    sizes = {"train": train, "validation": validation, "test": test}
    for split, size in sizes.items():
        if size < 0:
            raise UserInputError(f"{split} size must be >= 0, got {size}")
    pools = partition_pools(seed)
    rngs = {split: random.Random(f"rlhflab.tasks.splits:{seed}:{split}") for split in SPLITS}
    return {split: _in_rounds(_draw(pools[split], sizes[split], rngs[split], unique=True), rngs[split])
            for split in SPLITS}


def sample_items(split: str, n: int, seed: int, split_seed: int = 0) -> list[TaskItem]:
    """n fresh prompts from one split's content pool (e.g. thousands of SFT demonstrations).

    Prompts may repeat; the fixed prompt sets of `build_splits` are unaffected.
    """
    if split not in SPLITS:
        raise UserInputError(f"unknown split {split!r}", fix=f"use one of {list(SPLITS)}")
    pool = partition_pools(split_seed)[split]
    rng = random.Random(f"rlhflab.tasks.sample:{split_seed}:{split}:{seed}")
    items = _draw(pool, n, rng, unique=False)
    rng.shuffle(items)
    return items
