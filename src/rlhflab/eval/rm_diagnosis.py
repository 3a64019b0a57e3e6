"""Does the reward model agree with the checker on the policy's *own* answers?

    rlhflab rm diagnose --reward_model RM_DIR --policy SFT_DIR --split test

Pairwise accuracy on hand-made pairs can be 100 % while the RM still scores the
policy's real mistakes high (the seeds' weak RM). This generates the policy's
answers, checks them, scores them, and reports mean reward of passing vs failing
answers, the point-biserial correlation of reward with pass/fail, ROC-AUC, and
the worst cases for a person to read. It also runs the length-bias probe on the
split's reference answers (`summary.json` -> `length_bias`, see eval/length_bias.py).
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import torch

from rlhflab import models, rewards
from rlhflab.config import RMDiagnoseConfig, write_config
from rlhflab.data.prompt_rows import PromptRow
from rlhflab.errors import UserInputError, writing
from rlhflab.eval.length_bias import length_bias_probe
from rlhflab.eval.pass_rate import eval_prompts, eval_verifier
from rlhflab.tracking import RunDir, RunResult, default_run_path
from rlhflab.trainers.setup import configure_threads, resolve_device, seed_everything
from rlhflab.trainers.validation import checked_answers


def point_biserial(scores: list[float], passed: list[bool]) -> float:
    """Pearson correlation of scores with a 0/1 pass indicator; NaN if either is constant."""
    n = len(scores)
    x = [float(s) for s in scores]
    y = [1.0 if p else 0.0 for p in passed]
    mx, my = sum(x) / n, sum(y) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(x, y))
    vx = sum((a - mx) ** 2 for a in x)
    vy = sum((b - my) ** 2 for b in y)
    return cov / math.sqrt(vx * vy) if vx > 0 and vy > 0 else float("nan")


def roc_auc(scores: list[float], passed: list[bool]) -> float:
    """P(score of a random passing answer > score of a random failing one), ties count 1/2."""
    pos = [s for s, p in zip(scores, passed) if p]
    neg = [s for s, p in zip(scores, passed) if not p]
    if not pos or not neg:
        return float("nan")
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a in pos for b in neg)
    return wins / (len(pos) * len(neg))


def diagnosis_summary(rows: list[dict], worst: int) -> dict:
    """Headline numbers and the worst cases from rows with "score" and "passed"."""
    scores = [r["score"] for r in rows]
    passed = [r["passed"] for r in rows]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    failing = sorted((r for r in rows if not r["passed"]), key=lambda r: -r["score"])
    passing = sorted((r for r in rows if r["passed"]), key=lambda r: r["score"])
    return {
        "answers": len(rows),
        "pass_rate": mean([1.0 if p else 0.0 for p in passed]),
        "mean_reward_passing": mean([r["score"] for r in passing]),
        "mean_reward_failing": mean([r["score"] for r in failing]),
        "point_biserial": point_biserial(scores, passed),
        "roc_auc": roc_auc(scores, passed),
        "worst_failing": failing[:worst],
        "worst_passing": passing[:worst],
    }


def worst_cases_text(summary: dict) -> str:
    """The worst cases written for a person: what was asked, answered, expected, scored."""
    lines = ["# Failing answers the reward model scored highest", ""]
    for r in summary["worst_failing"]:
        lines += [f"- score {r['score']:.2f} [{r['family']}, {r['kind']}] {r['prompt'].strip()!r}",
                  f"  answer {r['answer']!r}, expected {r['reference']!r}"]
    if not summary["worst_failing"]:
        lines.append("(none: every answer passed)")
    lines += ["", "# Passing answers the reward model scored lowest", ""]
    if not summary["worst_passing"]:
        lines.append("(none: no answer passed, so correlation and ROC-AUC are undefined)")
    for r in summary["worst_passing"]:
        lines += [f"- score {r['score']:.2f} [{r['family']}] {r['prompt'].strip()!r}", f"  answer {r['answer']!r}"]
    return "\n".join(lines) + "\n"


class ReferenceAnswer(NamedTuple):
    prompt: str
    reference: str


def reference_answers(rows: list[PromptRow]) -> list[ReferenceAnswer]:
    """The rows' `reference` answers, for the length-bias probe (rows without one are left out)."""
    return [ReferenceAnswer(r.prompt, r.columns["reference"]) for r in rows
            if isinstance(r.columns.get("reference"), str) and r.columns["reference"]]


def check_diagnose_config(cfg: RMDiagnoseConfig) -> None:
    """Values the diagnosis cannot run with, refused before anything is generated."""
    rewards.CallLimits(cfg.reward_timeout, cfg.reward_errors)  # a negative --reward_timeout (the verifier's)
    if cfg.samples_per_prompt < 1:
        raise UserInputError(f"samples_per_prompt must be >= 1, not {cfg.samples_per_prompt}", "--samples_per_prompt",
                             "use 2 for a quick look, 8 for a correlation steady to about +-0.01")


def diagnose(cfg: RMDiagnoseConfig, run: RunDir | None = None) -> RunResult:
    """Generate the policy's answers to a split, check and score them, report agreement."""
    started = time.time()
    if not cfg.reward_model or not cfg.policy:
        raise UserInputError("both --reward_model and --policy are needed", "rlhflab rm diagnose")
    check_diagnose_config(cfg)
    configure_threads(cfg.threads)
    seed_everything(cfg.seed, cfg.deterministic)
    device = resolve_device(cfg.device)
    tokenizer = models.load_tokenizer(cfg.policy, trust_remote_code=cfg.trust_remote_code)
    policy = models.load_causal_lm(cfg.policy, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code, device=device)
    rm_tokenizer = models.load_tokenizer(cfg.reward_model, trust_remote_code=cfg.trust_remote_code)
    rm = models.load_reward_model(cfg.reward_model, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code,
                                  tokenizer=rm_tokenizer).to(device).eval()
    prompts = eval_prompts(cfg, tokenizer)
    verifier = eval_verifier(cfg, prompts)
    items = [row for row in prompts for _ in range(cfg.samples_per_prompt)]
    run = run or RunDir(cfg.output_dir or default_run_path("rm-diagnose"), overwrite=cfg.overwrite,
                        report_to=cfg.report_to)
    write_config(cfg, run.path / "config.yaml")
    run.write_versions(cfg.seed)
    rows = checked_answers(policy, tokenizer, items, verifier, cfg, progress=cfg.progress)
    with torch.no_grad():
        scored = rewards.ModelReward(rm, rm_tokenizer)([r["prompt"] for r in rows], [r["answer"] for r in rows], items)
    for row, score in zip(rows, scored.scores.tolist()):
        row["score"] = score
    run.add_samples(rows)
    summary = diagnosis_summary(rows, cfg.worst_cases)
    worst = worst_cases_text(summary)
    with writing("worst_cases.md", run.path / "worst_cases.md", run.path, len(worst.encode())):
        (run.path / "worst_cases.md").write_text(worst)
    headline = {k: v for k, v in summary.items() if not k.startswith("worst")}
    length_bias = length_bias_probe(rm, rm_tokenizer, reference_answers(prompts))  # each prompt once
    run.log({**{f"rm_diagnosis/{k}": v for k, v in headline.items()},
             **{f"length_bias/{k}": length_bias[k] for k in ("mean_change", "share_raised", "change_per_token")}},
            step=0)
    out = run.update_summary(stage="rm diagnose", split=cfg.prompts_file or cfg.split, verifier=verifier.name, rm_diagnosis=headline, length_bias=length_bias,
                             decoding="sampled" if cfg.do_sample else "greedy",
                             wall_time_s={"diagnose": round(time.time() - started, 1)})
    run.close()
    return RunResult(run.path, out)
