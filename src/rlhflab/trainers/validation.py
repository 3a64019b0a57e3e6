"""Held-out pass rate during training: answer validation prompts, check, log samples."""

from __future__ import annotations

import torch

from rlhflab import tasks
from rlhflab.rollout import GenerationSettings, generate_answers
from rlhflab.tracking import RunDir


def checked_answers(model, tokenizer, items: list[tasks.TaskItem], cfg, progress: bool = False) -> list[dict]:
    """Answer `items` with the config's evaluation decoding and check every answer."""
    settings = GenerationSettings(cfg.max_new_tokens, cfg.do_sample, cfg.temperature, cfg.top_k, cfg.top_p)
    generator = torch.Generator().manual_seed(cfg.seed)
    answers = generate_answers(model, tokenizer, [i.prompt for i in items], settings,
                               batch_size=cfg.eval_batch_size, generator=generator, progress=progress)
    rows = []
    for item, answer in zip(items, answers):
        verdict = tasks.check(item, answer.text, answer.ended_with_eos)
        rows.append({"family": item.family, "prompt": item.prompt, "answer": answer.text,
                     "reference": item.reference, "passed": verdict.passed, "kind": verdict.kind,
                     "reason": verdict.reason, "ended_with_eos": answer.ended_with_eos,
                     "response_tokens": answer.num_tokens})
    return rows


def pass_rate_table(rows: list[dict]) -> dict:
    verdicts = [(r["family"], tasks.Verdict(r["passed"], r["kind"], r["reason"])) for r in rows]
    return tasks.pass_rate_table(verdicts)


def validate_pass_rate(model, tokenizer, items, cfg, step: int, run: RunDir | None, sample_count: int | None = None,
                       **extra) -> dict:
    """Pass-rate table on `items`; the first `sample_count` answers (all if None) go to samples.jsonl."""
    rows = checked_answers(model, tokenizer, items, cfg)
    if run is not None:
        kept = rows if sample_count is None else rows[:sample_count]
        run.add_samples({"step": step, **extra, **row} for row in kept)
    return pass_rate_table(rows)
