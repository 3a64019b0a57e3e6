"""The built-in suite as a source of demonstrations and preference pairs for the offline stages.

SFT, the reward model and DPO read the suite only through here (DESIGN.md "Prompt sources": a generic
trainer never imports `tasks`): the demonstrations, the reference answers and checked prompt rows of the
validation split, and the prompts and hand-made pairs the reward model and DPO train on.
"""

from __future__ import annotations

import random

from rlhflab import data, tasks
from rlhflab.data.prompt_rows import PromptRow
from rlhflab.sources.prompts import suite_prompts, suite_splits

SuiteItem = tasks.TaskItem  # a suite prompt with its family, content and reference answer
NEAR_MISS = "near_miss"  # the violation label of a near miss: the reference with one copied letter changed


def sft_demonstrations(cfg) -> list[data.SFTExample]:
    """`cfg.sft_examples` demonstrations on fresh train-pool prompts, a share of them deliberately violating
    their family's format (`violation_fraction`, most of those one dominant violation: `dominant_share`)."""
    items = tasks.sample_items("train", cfg.sft_examples, seed=cfg.seed, split_seed=cfg.split_seed)
    rows = tasks.sft_rows(items, cfg.violation_fraction, cfg.dominant_share, seed=cfg.seed)
    return [data.SFTExample(r["prompt"], r["completion"], r["family"], r["violation"]) for r in rows]


def validation_references(cfg) -> tuple[list[data.SFTExample], list[PromptRow]]:
    """The validation split as reference answers (for a validation loss) and as prompt rows the suite's
    checker can verify (for a pass rate)."""
    items = suite_splits(cfg)["validation"]
    references = [data.SFTExample(i.prompt, i.reference, i.family, "none") for i in items]
    return references, suite_prompts(items, "validation")


def pair_prompt_sets(cfg) -> dict[str, list[SuiteItem]]:
    """The prompts pairs are built on: the fixed splits, or fresh train-pool prompts for training.

    Fresh prompts (`pair_prompts`) show the reward model far more content than the fixed
    train prompts do, as the SFT demonstrations do for the policy; held-out splits stay fixed.
    """
    splits = suite_splits(cfg)
    if cfg.pair_prompts:
        splits["train"] = tasks.sample_items("train", cfg.pair_prompts, seed=cfg.seed, split_seed=cfg.split_seed)
    return splits


def suite_pairs(cfg, splits: dict[str, list[SuiteItem]]) -> dict[str, list[data.PairExample]]:
    """Built-in pairs for each split; `pair_kinds` restricts the rejected answers' violations.

    `pair_kinds_always` shapes the training pairs only, so held-out accuracies stay comparable
    between reward models trained on different mixes.
    """
    kinds = [k.strip() for k in cfg.pair_kinds.split(",") if k.strip()] or None
    always = [k.strip() for k in cfg.pair_kinds_always.split(",") if k.strip()]
    out = {}
    for split, items in splits.items():
        rows = tasks.pair_rows(items, kinds, cfg.pairs_per_prompt, seed=cfg.seed,
                               always=always if split == "train" else ())  # held-out pairs keep the usual mix
        out[split] = [data.PairExample(r["prompt"], r["chosen"], r["rejected"], r["family"], r["violation"]) for r in rows]
    return out


def near_miss_pairs(cfg, items: list[SuiteItem]) -> list[data.PairExample]:
    """`cfg.near_misses` near-miss rejected answers per item against the reference (training pairs only)."""
    rng = random.Random(f"rlhflab.rm.near_miss:{cfg.seed}")
    return [data.PairExample(item.prompt, item.reference, answer, item.family, NEAR_MISS)
            for item in items for answer in tasks.near_misses(item, cfg.near_misses, rng)]
