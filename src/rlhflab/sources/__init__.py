"""Where an online stage's prompts come from: a user's file or dataset, or the built-in suite.

    prompts = prompt_splits(cfg, tokenizer)   # PromptSplits(train, validation, source)

The built-in suite is one prompt source among others: its rows carry `family`, `reference`
and `content` columns, which is all the suite's checker (`rewards.CheckerVerifier`) reads. The offline
stages take the suite's demonstrations and pairs from `sources.suite_data`.
"""

from rlhflab.sources.prompts import PromptSplits, file_prompts, prompt_splits, suite_prompts
from rlhflab.sources.suite_data import (NEAR_MISS, SuiteItem, near_miss_pairs, pair_prompt_sets, sft_demonstrations,
                                        suite_pairs, validation_references)

__all__ = ["NEAR_MISS", "PromptSplits", "SuiteItem", "file_prompts", "near_miss_pairs", "pair_prompt_sets",
           "prompt_splits", "sft_demonstrations", "suite_pairs", "suite_prompts", "validation_references"]
