"""Prompt rows for the online stages (PPO now; the critic-free trainers reuse it).

`--train_file` / `--validation_file` take what `data.load_examples` reads (JSONL, Parquet,
a `save_to_disk` folder, or a name `datasets.load_dataset` resolves) in TRL's prompt-only
format, standard or conversational; every other column travels with the row. Without a
train file the built-in suite is the source. A train file without a validation file gives
up a seeded slice of its rows as the validation prompts (they are not trained on).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

from rlhflab import data, tasks
from rlhflab.data.prompt_rows import PromptRow
from rlhflab.errors import UserInputError

log = logging.getLogger("rlhflab")

SUITE = "built-in suite"
MIN_HELD_OUT = 8  # a carved-out validation slice smaller than this tells nothing


@dataclass(frozen=True)
class PromptSplits:
    train: list[PromptRow]
    validation: list[PromptRow]
    source: str  # "built-in suite" or the train file / dataset name

    @property
    def is_suite(self) -> bool:
        return self.source == SUITE


def suite_splits(cfg) -> dict[str, list[tasks.TaskItem]]:
    """The suite's fixed train / validation / test prompts for `cfg`'s split seed and sizes."""
    return tasks.build_splits(cfg.split_seed, cfg.num_train_prompts, cfg.num_validation_prompts, cfg.num_test_prompts)


def suite_prompts(items: list[tasks.TaskItem], split: str) -> list[PromptRow]:
    """Suite items as prompt rows: the columns the checker needs."""
    return [PromptRow(i.prompt, {"family": i.family, "reference": i.reference, "content": list(i.content)},
                      f"{SUITE}, {split} #{n}") for n, i in enumerate(items)]


def file_prompts(path: str, tokenizer, *, max_prompt_tokens: int | None = None, strict: bool = False,
                 split: str | None = None, config: str | None = None) -> list[PromptRow]:
    """Prompt rows of a user file or dataset (prompt-only rows; other formats give their prompt)."""
    examples = data.load_examples(path, "prompts", tokenizer=tokenizer, max_prompt_tokens=max_prompt_tokens,
                                  strict=strict, split=split, config=config)
    return [PromptRow(e.prompt, _with_reference(e), e.where, None if e.messages is None else tuple(e.messages))
            for e in examples]


def _with_reference(example: data.PromptExample) -> dict:
    """The row's columns, plus the reference answer a `messages` row's last assistant turn gave."""
    if example.reference is None or "reference" in example.columns:
        return dict(example.columns)
    return {**example.columns, "reference": example.reference}


def prompt_splits(cfg, tokenizer) -> PromptSplits:
    """Train and validation prompts named by `cfg` (train_file, validation_file, suite fields)."""
    load = lambda path, split: file_prompts(  # noqa: E731
        path, tokenizer, max_prompt_tokens=cfg.max_prompt_tokens, strict=cfg.strict, split=split,
        config=cfg.dataset_config or None)
    if not cfg.train_file:
        if cfg.validation_file:
            raise UserInputError("--validation_file without --train_file", "--validation_file",
                                 "pass --train_file too (the built-in suite has its own validation split)")
        splits = suite_splits(cfg)
        return PromptSplits(suite_prompts(splits["train"], "train"), suite_prompts(splits["validation"], "validation"),
                            SUITE)
    train = load(cfg.train_file, cfg.dataset_split or None)
    if cfg.validation_file:
        validation = load(cfg.validation_file, None)  # NAME:SPLIT, or the dataset's only split
        return PromptSplits(train, validation, cfg.train_file)
    train, validation = hold_out(train, cfg.eval_prompts, cfg.seed)
    return PromptSplits(train, validation, cfg.train_file)


def hold_out(rows: list[PromptRow], wanted: int, seed: int) -> tuple[list[PromptRow], list[PromptRow]]:
    """A seeded slice of min(wanted, 10 %) rows set apart for validation; the rest is trained on."""
    size = min(wanted, len(rows) // 10)
    if size < MIN_HELD_OUT:
        log.warning("no --validation_file and only %d prompts: validating on the training prompts themselves "
                    "(not held out; pass --validation_file for an honest signal)", len(rows))
        return rows, rows
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    held = set(order[:size])
    log.info("no --validation_file: %d of %d prompts set apart for validation (seed %d)", size, len(rows), seed)
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in sorted(held)]
