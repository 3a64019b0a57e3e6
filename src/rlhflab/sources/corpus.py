"""The text the tiny default's BPE learns its pieces from: a user's training texts, or the suite's templates."""

from __future__ import annotations

import logging

from rlhflab import data, tasks

log = logging.getLogger("rlhflab")


def tokenizer_corpus(cfg) -> list[str]:
    """The user's own training texts when a `train_file` is given (their words become pieces),
    else the built-in suite's templates."""
    if not getattr(cfg, "train_file", ""):
        return tasks.template_corpus()
    examples = data.load_examples(cfg.train_file, "sft", strict=cfg.strict, split=cfg.dataset_split or None,
                                  config=cfg.dataset_config or None)
    log.info("tiny default tokenizer: pieces learnt from the %d rows of %s", len(examples), cfg.train_file)
    return [e.prompt + e.completion for e in examples]
