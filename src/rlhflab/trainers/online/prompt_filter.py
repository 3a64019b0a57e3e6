"""Prompt filtering from the headroom probe (`--filter_prompts pass_rate`): before the first update, every train
prompt is answered `filter_samples` times by the starting policy at the rollout temperature and length, and
checked by the verifier. A prompt the policy always solves (pass rate >= filter_high) or never solves (<=
filter_low) gives a group-relative method all-equal groups: nothing to reinforce, only generation spent. Those
prompts are left out of the run's prompt order; the rest train as usual.

The probe's answers are generation the run pays for: counted (`generated`) and timed in summary.json's
`prompt_filter`, beside how many prompts each family lost. RUN/prompt_filter.json keeps the kept prompts, so a
resumed run trains on the same ones without probing again.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Sequence

from rlhflab.data.prompt_rows import PromptRow
from rlhflab.errors import UserInputError
from rlhflab.rollout import GenerationSettings
from rlhflab.trainers.headroom import sample_verdicts
from rlhflab.trainers.setup import stream_seed

log = logging.getLogger("rlhflab")
FILE = "prompt_filter.json"


def check_prompt_filter(cfg, has_verifier: bool) -> None:
    """The filter's fields, refused before any model is loaded."""
    if cfg.filter_prompts == "none":
        return
    if not has_verifier:
        raise UserInputError("filter_prompts needs a verifier to say which answers pass", "--filter_prompts",
                             "pass --verifier FILE.py:NAME (the built-in suite has its checker), or drop the filter")
    if cfg.filter_samples < 2:
        raise UserInputError(f"filter_samples must be >= 2 (a pass rate needs answers to compare), got "
                             f"{cfg.filter_samples}", "--filter_samples")
    if not 0.0 <= cfg.filter_low < cfg.filter_high <= 1.0:
        raise UserInputError(f"need 0 <= filter_low < filter_high <= 1, got {cfg.filter_low} and {cfg.filter_high}",
                             "--filter_low / --filter_high", "e.g. 0 and 1: drop prompts never or always solved")


def prompts_to_keep(pass_rates: Sequence[float], low: float, high: float) -> list[int]:
    """Indices of the prompts whose pass rate lies strictly between `low` and `high`."""
    return [i for i, rate in enumerate(pass_rates) if low < rate < high]


def filter_record(rows: Sequence[PromptRow], pass_rates: Sequence[float], cfg, seconds: float) -> dict:
    """What the filter did, per family: prompts probed, kept, dropped as always solved / never solved."""
    kept = prompts_to_keep(pass_rates, cfg.filter_low, cfg.filter_high)
    families = Counter(r.family for r in rows)
    solved = Counter(r.family for r, rate in zip(rows, pass_rates) if rate >= cfg.filter_high)
    unsolved = Counter(r.family for r, rate in zip(rows, pass_rates) if rate <= cfg.filter_low)
    return {"mode": cfg.filter_prompts, "samples_per_prompt": cfg.filter_samples, "low": cfg.filter_low,
            "high": cfg.filter_high, "temperature": cfg.temperature, "prompts": len(rows), "kept": len(kept),
            "generated": len(rows) * cfg.filter_samples, "seconds": round(seconds, 2),
            "per_family": {f: {"prompts": n, "kept": n - solved[f] - unsolved[f], "always_solved": solved[f],
                               "never_solved": unsolved[f]} for f, n in sorted(families.items())},
            "kept_indices": kept}


def probe_train_prompts(policy, tokenizer, rows: Sequence[PromptRow], verifier, cfg) -> dict:
    """Sample `filter_samples` answers per train prompt (full softmax at the rollout temperature, the rollouts'
    length cap), verify them, and decide which prompts stay."""
    started = time.time()
    settings = GenerationSettings(cfg.response_length, True, cfg.temperature, top_k=0, top_p=1.0)
    verdicts = sample_verdicts(policy, tokenizer, rows, verifier, settings, cfg.filter_samples, cfg.eval_batch_size,
                               stream_seed("rlhflab-prompt-filter", cfg.seed))
    rates = [sum(v) / len(v) for v in verdicts]
    record = filter_record(rows, rates, cfg, time.time() - started)
    if not record["kept"]:
        raise UserInputError(f"filter_prompts left no train prompt: of {len(rows)}, every one was solved by all or "
                             f"none of {cfg.filter_samples} answers", "--filter_prompts",
                             "widen --filter_low / --filter_high, or drop the filter")
    return record


def filtered_rows(cfg, run, resumed: bool, probe) -> dict:
    """The filter's record: RUN/prompt_filter.json when resuming (the prompts the run started with), else
    `probe()`'s, written there."""
    path = run.path / FILE
    if resumed and path.is_file():
        return json.loads(path.read_text())
    record = probe()
    run.write_json(FILE, record)
    lost = ", ".join(f"{f} {v['prompts'] - v['kept']} of {v['prompts']}" for f, v in record["per_family"].items()
                     if v["kept"] < v["prompts"])
    log.info("filter_prompts: %d of %d train prompts kept (%d answers sampled, %.1f s); dropped per family: %s",
             record["kept"], record["prompts"], record["generated"], record["seconds"], lost or "none")
    return record
