"""`rlhflab eval --samples_per_prompt k`: the headroom probe (trainers/headroom.py) of a saved model.

The probe reads `--headroom_split` (validation by default: the test split is read once, for
reported numbers) or the rows of `--prompts_file`, and lands beside the evaluation in the
same run folder: RUN/headroom.json (the report's "Headroom before RL") and summary.json's
`headroom`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rlhflab import models
from rlhflab.config import EvalConfig
from rlhflab.errors import UserInputError
from rlhflab.eval.pass_rate import eval_prompts, eval_verifier
from rlhflab.tracking import RunDir
from rlhflab.trainers.headroom import FILE, probe_headroom
from rlhflab.trainers.setup import resolve_device


def check_headroom_fields(cfg: EvalConfig) -> None:
    """Refuse a probe that cannot run, before the evaluation spends its time."""
    if cfg.samples_per_prompt < 1:
        raise UserInputError(f"samples_per_prompt must be >= 1, got {cfg.samples_per_prompt}", "--samples_per_prompt",
                             "1 = no headroom probe; 4 or 8 samples per prompt for one")
    if cfg.headroom_prompts < 0:
        raise UserInputError(f"headroom_prompts must be >= 0, got {cfg.headroom_prompts}", "--headroom_prompts",
                             "0 = every prompt of the split")


def probe_saved_model(cfg: EvalConfig, run_dir: str | Path) -> dict:
    """Probe `cfg.model`; write RUN/headroom.json and summary.json's `headroom`; return the probe."""
    check_headroom_fields(cfg)
    tokenizer = models.load_tokenizer(cfg.tokenizer or cfg.model, trust_remote_code=cfg.trust_remote_code)
    model = models.load_causal_lm(cfg.model, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code,
                                  device=resolve_device(cfg.device))
    rows = eval_prompts(dataclasses.replace(cfg, split=cfg.headroom_split), tokenizer)
    rows = rows[: cfg.headroom_prompts] if cfg.headroom_prompts else rows
    probe = probe_headroom(model, tokenizer, rows, eval_verifier(cfg, rows), samples_per_prompt=cfg.samples_per_prompt,
                           temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                           batch_size=cfg.eval_batch_size, seed=cfg.seed,
                           split=cfg.prompts_file or cfg.headroom_split)
    run = RunDir(run_dir, resume=True)  # the evaluation's folder, as it is
    run.write_json(FILE, probe)
    run.update_summary(headroom=probe)
    run.close()
    return probe
