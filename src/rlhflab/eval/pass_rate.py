"""Held-out pass rate: answer a split's prompts, check every answer, tabulate — every rate with its 95 % interval."""

from __future__ import annotations

import math
import time

from rlhflab import models, rewards, sources, tasks
from rlhflab.config import EvalConfig, write_config
from rlhflab.data.prompt_rows import PromptRow
from rlhflab.errors import UserInputError
from rlhflab.rollout.backends import backend_from_config, check_backend, use_backend
from rlhflab.intervals import (Interval, difference_from_dict, paired_counts, percent, points, rate_from_dict,
                               verdict, wilson)
from rlhflab.tracking import RunDir, RunResult, default_run_path
from rlhflab.trainers.setup import configure_threads, resolve_device, seed_everything
from rlhflab.trainers.validation import checked_answers as answer_and_check
from rlhflab.trainers.validation import pass_rate_table

OVERALL = "overall"
CELL = 18  # width of one model's column: "100.0% [98.7–100.0]"


def eval_prompts(cfg, tokenizer=None) -> list[PromptRow]:
    """The built-in split, or the rows of `cfg.prompts_file` (TRL prompt-only format, other columns kept)."""
    if not cfg.prompts_file:
        splits = tasks.build_splits(cfg.split_seed, cfg.num_train_prompts, cfg.num_validation_prompts, cfg.num_test_prompts)
        return sources.suite_prompts(splits[cfg.split], cfg.split)
    return sources.file_prompts(cfg.prompts_file, tokenizer, strict=True)


def eval_verifier(cfg, rows: list[PromptRow]) -> rewards.Verifier:
    """`--verifier`, else the suite's checker: on a prompts file only when its rows carry family and reference."""
    if cfg.verifier.strip() and cfg.verifier.strip() != "checker":
        return rewards.FunctionVerifier(rewards.load_function(cfg.verifier, "--verifier"),
                                        limits=rewards.CallLimits(cfg.reward_timeout, cfg.reward_errors))
    unchecked = [r.where for r in rows if rewards.task_item(r) is None]
    if unchecked:
        raise UserInputError(f"{len(unchecked)} of {len(rows)} prompts have no suite 'family' / 'reference' for the "
                             f"checker (first: {unchecked[0]})", "--verifier",
                             "pass --verifier FILE.py:NAME, a function that says which answers are right")
    return rewards.CheckerVerifier()


def table_from_rows(rows: list[dict]) -> dict:
    """Overall and per-family pass rate of verified rows (trainers.validation.pass_rate_table) plus
    `intervals`: {"overall" | family: {"rate", "low", "high", "n"}}, each rate's 95 % Wilson interval."""
    table = pass_rate_table(rows)
    passes = {f: sum(1 for r in rows if r["family"] == f and r["passed"]) for f in table["counts"]}
    intervals = {OVERALL: wilson(sum(passes.values()), len(rows)).as_rate()}
    intervals |= {f: wilson(passes[f], n).as_rate() for f, n in table["counts"].items()}
    return {**table, "intervals": intervals}


def interval_of(table: dict, key: str = OVERALL) -> Interval | None:
    """The stored interval of a table's overall (or one family's) rate; None for a table written without one."""
    return rate_from_dict((table.get("intervals") or {}).get(key))


def _cell(table: dict, key: str, digits: int) -> str:
    rate = table["overall"] if key == OVERALL else table["per_family"].get(key, float("nan"))
    interval = interval_of(table, key)
    if interval is not None:
        return percent(interval, digits)
    return "—" if rate is None or math.isnan(rate) else f"{rate:.{digits}%}"


def format_table(tables: dict[str, dict], title: str = "held-out pass rate") -> str:
    """Side-by-side per-family pass rates with their 95 % intervals, one column per named table (e.g. sft, ppo)."""
    names = list(tables)
    families = sorted({f for t in tables.values() for f in t["per_family"]})
    width = max([len(f) for f in families] + [len(OVERALL), 8])
    head = f"{title:<{width}}  " + "  ".join(f"{n:>{CELL}}" for n in names)
    lines = [head, "-" * len(head)]
    for family in families:
        cells = "  ".join(f"{_cell(tables[n], family, 0):>{CELL}}" for n in names)
        count = next(t["counts"][family] for t in tables.values() if family in t["counts"])
        lines.append(f"{family:<{width}}  {cells}   (n={count})")
    lines.append("-" * len(head))
    total = next((sum(t["counts"].values()) for t in tables.values() if t.get("counts")), 0)
    lines.append(f"{OVERALL:<{width}}  " + "  ".join(f"{_cell(tables[n], OVERALL, 1):>{CELL}}" for n in names)
                 + f"   (n={total})")
    lines.append("[low–high]: 95 % interval of each rate (Wilson)")
    return "\n".join(lines)


def paired_versus(answers: dict[str, list[dict]], base: str) -> dict[str, dict]:
    """Each model's test answers against `base`'s on the same prompts, in the same order: fixed / broken prompts,
    McNemar's p and the 95 % interval of the difference in pass rate (rlhflab.intervals.paired_counts)."""
    before = [bool(r["passed"]) for r in answers[base]]
    return {name: paired_counts(before, [bool(r["passed"]) for r in rows]) for name, rows in answers.items()
            if name != base}


def paired_versus_by_family(answers: dict[str, list[dict]], base: str) -> dict[str, dict[str, dict]]:
    """`paired_versus` within each family: {model: {family: {before, after, fixed, broken, p_value, difference,
    low, high, n}}}, the rows of `answers` carrying their `family` (the demo's headroom verdict reads it)."""
    out: dict[str, dict[str, dict]] = {}
    for name, rows in answers.items():
        if name == base:
            continue
        families: dict[str, tuple[list[bool], list[bool]]] = {}
        for was, now in zip(answers[base], rows):
            before, after = families.setdefault(was["family"], ([], []))
            before.append(bool(was["passed"]))
            after.append(bool(now["passed"]))
        out[name] = {family: {"before": sum(b) / len(b), "after": sum(a) / len(a), **paired_counts(b, a)}
                     for family, (b, a) in families.items()}
    return out


def describe_versus(versus: dict[str, dict], base: str, n_prompts: int) -> list[str]:
    """'ppo vs sft: +37.0 pts [+30.6, +42.9], better (paired over 300 test prompts: 120 fixed, 9 broken)'."""
    lines = []
    for name, counts in versus.items():
        diff = difference_from_dict(counts)
        if diff is not None:
            lines.append(f"{name} vs {base}: {points(diff)}, {verdict(diff)} (paired over {n_prompts} test prompts: "
                         f"{counts['fixed']} fixed, {counts['broken']} broken)")
    return lines


def evaluate(cfg: EvalConfig, run: RunDir | None = None) -> RunResult:
    """`rlhflab eval`: pass rate of `cfg.model` on a split; writes samples and summary."""
    started = time.time()
    configure_threads(cfg.threads)
    seed_everything(cfg.seed, cfg.deterministic)
    if not cfg.model:
        raise UserInputError("no model given", "--model", "pass a model folder, e.g. runs/demo-.../sft/model")
    check_backend(cfg)
    rewards.CallLimits(cfg.reward_timeout, cfg.reward_errors)  # a negative --reward_timeout, before the model loads
    tokenizer = models.load_tokenizer(cfg.tokenizer or cfg.model, trust_remote_code=cfg.trust_remote_code)
    model = models.load_causal_lm(cfg.model, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code,
                                  device=resolve_device(cfg.device))
    use_backend(model, backend_from_config(cfg, cfg.model))
    items = eval_prompts(cfg, tokenizer)
    verifier = eval_verifier(cfg, items)
    run = run or RunDir(cfg.output_dir or default_run_path("eval"), overwrite=cfg.overwrite, report_to=cfg.report_to)
    write_config(cfg, run.path / "config.yaml")
    run.write_versions(cfg.seed)
    rows = answer_and_check(model, tokenizer, items, verifier, cfg, progress=cfg.progress)
    run.add_samples(rows)
    table = table_from_rows(rows)
    run.log({f"{cfg.split}/pass_rate": table["overall"]}, step=0)
    summary = run.update_summary(
        stage="eval", model=cfg.model, split=cfg.prompts_file or cfg.split, verifier=verifier.name, pass_rate=table,
        decoding="sampled" if cfg.do_sample else "greedy", wall_time_s={"eval": round(time.time() - started, 1)},
        reward_errors=rewards.error_summary(verifier),
    )
    run.close()
    return RunResult(run.path, summary)
