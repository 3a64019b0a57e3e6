"""DPO's data: preference pairs (the suite's, as `rlhflab rm` builds them, or a user's file), tokenised
with the prompt's length kept, and the validation prompts the pass rate answers.

A user's train file without a validation file gives up a seeded set of its prompts: their pairs are the
validation pairs (never trained on) and, with `--verifier`, their prompt rows are answered for the pass rate.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

from rlhflab import data, parallel, rewards, sources
from rlhflab.config import DPOConfig
from rlhflab.data.prompt_rows import PromptRow
from rlhflab.errors import UserInputError
from rlhflab.sources import PromptSplits
from rlhflab.trainers.given import Given
from rlhflab.trainers.online.setup import build_verifier
from rlhflab.trainers.reward import hard_negative_pairs

log = logging.getLogger("rlhflab")
MIN_HELD_OUT = 8  # fewer held-out prompts than this tell nothing


@dataclass(frozen=True)
class PreferencePair:
    """One tokenised pair. The completion's log-prob counts tokens from `*_start` on (the prompt is context)."""

    chosen: list[int]  # prompt + chosen completion + EOS
    rejected: list[int]  # prompt + rejected completion + EOS
    chosen_start: int  # index of the chosen completion's first token (= its prompt's length)
    rejected_start: int
    family: str | None = None
    violation: str | None = None


@dataclass(frozen=True)
class DPOData:
    train: list[PreferencePair]
    validation: list[PreferencePair]  # may be empty (a tiny user file)
    validation_rows: list[PromptRow]  # prompts answered for val/pass_rate (empty without a verifier)
    verifier: rewards.Verifier | None
    source: str  # "built-in suite" or the train file


def tokenize_preferences(pairs: list[data.PairExample], tokenizer, max_length: int) -> list[PreferencePair]:
    """Prompt + completion + EOS for each side, fitted into `max_length` as SFT fits its sequences."""
    as_sft = [data.SFTExample(p.prompt, text) for p in pairs for text in (p.chosen, p.rejected)]
    seqs = data.tokenize_sft(as_sft, tokenizer, max_length)
    return [PreferencePair(c.prompt_ids + c.completion_ids, r.prompt_ids + r.completion_ids, len(c.prompt_ids),
                           len(r.prompt_ids), p.family, p.violation)
            for p, c, r in zip(pairs, seqs[0::2], seqs[1::2])]


def suite_pair_examples(cfg: DPOConfig, tokenizer, world: parallel.World | None = None
                        ) -> tuple[dict[str, list[data.PairExample]], PromptSplits]:
    """The suite's train and validation pairs, built as the reward model's are (sources.suite_data); the hard
    negatives' answers sampled once over the processes of `world` (each samples its share)."""
    splits = sources.pair_prompt_sets(cfg)
    pairs = sources.suite_pairs(cfg, {"train": splits["train"], "validation": splits["validation"]})
    if cfg.near_misses:  # training pairs only: held-out metrics stay comparable
        pairs["train"] += sources.near_miss_pairs(cfg, splits["train"])
    if cfg.hard_negatives:  # the starting policy's own failing answers against the reference
        pairs["train"] += hard_negative_pairs(cfg, tokenizer, splits["train"], world)
    prompts = PromptSplits(sources.suite_prompts(splits["train"], "train"),
                           sources.suite_prompts(splits["validation"], "validation"), sources.prompts.SUITE)
    return pairs, prompts


def held_out_prompts(examples: list[data.PairExample], seed: int) -> set[str]:
    """A seeded 10 % of the distinct prompts, whose pairs become validation pairs (the first `eval_prompts`
    of them are answered for the pass rate)."""
    distinct = sorted({p.prompt for p in examples})
    size = len(distinct) // 10
    if size < MIN_HELD_OUT:
        log.warning("no --validation_file and only %d distinct prompts: no validation pairs", len(distinct))
        return set()
    random.Random(seed).shuffle(distinct)
    log.info("no --validation_file: the pairs of %d of %d prompts set apart for validation", size, len(distinct))
    return set(distinct[:size])


def file_pair_examples(cfg: DPOConfig, tokenizer) -> tuple[dict[str, list[data.PairExample]], PromptSplits]:
    """A user's pairs (any of TRL's preference formats) and the prompt rows of the validation ones."""
    def load(path: str, kind: str, split: str | None) -> list:
        return data.load_examples(path, kind, tokenizer=tokenizer, max_prompt_tokens=cfg.max_prompt_tokens,
                                  strict=cfg.strict, split=split, config=cfg.dataset_config or None)

    train = load(cfg.train_file, "pairs", cfg.dataset_split or None)
    if cfg.validation_file:
        validation = load(cfg.validation_file, "pairs", None)  # NAME:SPLIT, or its only split
        rows = sources.file_prompts(cfg.validation_file, tokenizer, max_prompt_tokens=cfg.max_prompt_tokens,
                                    strict=cfg.strict, config=cfg.dataset_config or None)
    else:
        held = held_out_prompts(train, cfg.seed)
        train, validation = [p for p in train if p.prompt not in held], [p for p in train if p.prompt in held]
        every = sources.file_prompts(cfg.train_file, tokenizer, max_prompt_tokens=cfg.max_prompt_tokens,
                                     strict=cfg.strict, split=cfg.dataset_split or None,
                                     config=cfg.dataset_config or None)
        rows = [r for r in every if r.prompt in held]
    first = {}  # one row per distinct prompt: a prompt with three pairs is answered once
    for row in rows:
        first.setdefault(row.prompt, row)
    return {"train": train, "validation": validation}, PromptSplits([], list(first.values()), cfg.train_file)


def load_dpo_data(cfg: DPOConfig, tokenizer, world: parallel.World | None = None,
                  verifier_fn=None) -> DPOData:
    """Pairs and validation prompts named by `cfg`: a user's files when given, else the built-in suite (the same on
    every process of `world`); `verifier_fn`: a verifier handed in memory, in place of `cfg.verifier`."""
    if cfg.train_file and (cfg.hard_negatives or cfg.near_misses):
        raise UserInputError("hard negatives and near misses are built from the built-in suite's items",
                             "--hard_negatives / --near_misses", "drop them, or add such pairs to your file")
    if cfg.validation_file and not cfg.train_file:
        raise UserInputError("--validation_file without --train_file", "--validation_file",
                             "pass --train_file too (the built-in suite has its own validation split)")
    pairs, prompts = file_pair_examples(cfg, tokenizer) if cfg.train_file else \
        suite_pair_examples(cfg, tokenizer, world)
    if not pairs["train"]:
        raise UserInputError("no training pairs", "--train_file / --pair_kinds",
                             "give a file with preference rows, or allow violation kinds the suite's families produce")
    verifier = build_verifier(cfg, prompts, Given(verifier=verifier_fn)) if prompts.validation else None
    rows = prompts.validation[: cfg.eval_prompts] if verifier is not None else []
    return DPOData(train=tokenize_preferences(pairs["train"], tokenizer, cfg.max_length),
                   validation=tokenize_preferences(pairs["validation"], tokenizer, cfg.max_length),
                   validation_rows=rows, verifier=verifier, source=prompts.source)
