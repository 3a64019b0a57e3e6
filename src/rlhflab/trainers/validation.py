"""Held-out pass rate during training: answer prompt rows, run the verifier, log samples.

The verifier is a value the trainer receives (`rewards.Verifier`): the suite's checker is
one, a user's `--verifier FILE.py:NAME` another. This module knows neither in particular.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from rlhflab.data.prompt_rows import PromptRow
from rlhflab.rewards import Verifier
from rlhflab.rollout import GenerationSettings, generate_answers
from rlhflab.tracking import RunDir


def answer_rows(model, tokenizer, rows: Sequence[PromptRow], cfg, progress: bool = False) -> list[dict]:
    """Answer `rows` with the config's evaluation decoding: one dict per row (prompt, answer, EOS, length)."""
    return answer_rows_and_ids(model, tokenizer, rows, cfg, progress)[0]


def answer_rows_and_ids(model, tokenizer, rows: Sequence[PromptRow], cfg,
                        progress: bool = False) -> tuple[list[dict], list[list[int]]]:
    """`answer_rows`, and each answer's token ids (EOS included) for the reward functions that read them."""
    settings = GenerationSettings(cfg.max_new_tokens, cfg.do_sample, cfg.temperature, cfg.top_k, cfg.top_p)
    generator = torch.Generator().manual_seed(cfg.seed)
    answers = generate_answers(model, tokenizer, [r.prompt for r in rows], settings,
                               batch_size=cfg.eval_batch_size, generator=generator, progress=progress)
    answered = [{"family": row.family, "prompt": row.prompt, "answer": answer.text,
                 "reference": row.columns.get("reference"), "ended_with_eos": answer.ended_with_eos,
                 "response_tokens": answer.num_tokens} for row, answer in zip(rows, answers)]
    return answered, [list(answer.token_ids) for answer in answers]


def verify_rows(answered: list[dict], rows: Sequence[PromptRow], verifier: Verifier) -> list[dict]:
    """Add the verifier's `passed`, `kind` and `reason` to each answered row."""
    checks = verifier([a["prompt"] for a in answered], [a["answer"] for a in answered], rows,
                      ended_with_eos=[a["ended_with_eos"] for a in answered])
    return [{**a, "passed": c.passed, "kind": c.kind, "reason": c.reason} for a, c in zip(answered, checks)]


def checked_answers(model, tokenizer, rows: Sequence[PromptRow], verifier: Verifier, cfg,
                    progress: bool = False) -> list[dict]:
    """Answer `rows` with the config's evaluation decoding and verify every answer."""
    return verify_rows(answer_rows(model, tokenizer, rows, cfg, progress), rows, verifier)


def pass_rate_table(rows: list[dict]) -> dict:
    """Overall and per-family pass rate of verified rows, with the count of each failure kind."""
    counts = Counter(r["family"] for r in rows)
    passes = Counter(r["family"] for r in rows if r["passed"])
    failed = Counter(r["kind"] for r in rows if not r["passed"])
    return {
        "overall": sum(passes.values()) / len(rows) if rows else 0.0,
        "per_family": {f: passes[f] / n for f, n in sorted(counts.items())},
        "counts": dict(sorted(counts.items())),
        "violations": dict(sorted(failed.items())),
    }


def validate_pass_rate(model, tokenizer, rows: Sequence[PromptRow], verifier: Verifier, cfg, step: int,
                       run: RunDir | None, sample_count: int | None = None, **extra) -> dict:
    """Pass-rate table on `rows`; the first `sample_count` answers (all if None) go to samples.jsonl."""
    checked = checked_answers(model, tokenizer, rows, verifier, cfg)
    if run is not None:
        kept = checked if sample_count is None else checked[:sample_count]
        run.add_samples({"step": step, **extra, **row} for row in kept)
    return pass_rate_table(checked)
