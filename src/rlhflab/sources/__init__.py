"""Where an online stage's prompts come from: a user's file or dataset, or the built-in suite.

    prompts = prompt_splits(cfg, tokenizer)   # PromptSplits(train, validation, source)

The built-in suite is one prompt source among others: its rows carry `family`, `reference`
and `content` columns, which is all the suite's checker (`rewards.CheckerVerifier`) reads.
"""

from rlhflab.sources.prompts import PromptSplits, file_prompts, prompt_splits, suite_prompts

__all__ = ["PromptSplits", "file_prompts", "prompt_splits", "suite_prompts"]
