"""The built-in instruction-following suite: families, exact checkers, splits, pairs.

Pure Python (no torch): the tokenizer, trainers and evaluators all build on it.
"""

from rlhflab.tasks.base import VIOLATION_KINDS, Family, TaskItem, Verdict
from rlhflab.tasks.checker import FAMILIES, check, pass_rate_table, violations
from rlhflab.tasks.export import export_suite, template_corpus
from rlhflab.tasks.near_miss import near_misses
from rlhflab.tasks.pools import SPLITS, ContentPool, partition_pools
from rlhflab.tasks.rows import pair_rows, prompt_rows, sft_rows
from rlhflab.tasks.splits import build_splits, sample_items

__all__ = [
    "FAMILIES",
    "SPLITS",
    "VIOLATION_KINDS",
    "ContentPool",
    "Family",
    "TaskItem",
    "Verdict",
    "build_splits",
    "check",
    "export_suite",
    "near_misses",
    "pair_rows",
    "partition_pools",
    "pass_rate_table",
    "prompt_rows",
    "sample_items",
    "sft_rows",
    "template_corpus",
    "violations",
]
