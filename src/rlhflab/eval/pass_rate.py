"""Held-out pass rate: answer a split's prompts, check every answer, tabulate."""

from __future__ import annotations

import time

from rlhflab import data, models, tasks
from rlhflab.config import EvalConfig, write_config
from rlhflab.errors import UserInputError
from rlhflab.tracking import RunDir, RunResult, default_run_path
from rlhflab.trainers.setup import configure_threads, resolve_device, seed_everything
from rlhflab.trainers.validation import checked_answers as answer_and_check
from rlhflab.trainers.validation import pass_rate_table as table_from_rows


def eval_items(cfg: EvalConfig) -> list[tasks.TaskItem]:
    """The built-in split, or a prompts file with `prompt`, `family` and `reference` columns."""
    if not cfg.prompts_file:
        splits = tasks.build_splits(cfg.split_seed, cfg.num_train_prompts, cfg.num_validation_prompts, cfg.num_test_prompts)
        return splits[cfg.split]
    rows = data.load_examples(cfg.prompts_file, "prompts", strict=True)
    return [tasks.TaskItem(r.family or "user", r.prompt, r.reference or "", ()) for r in rows]


def format_table(tables: dict[str, dict], title: str = "held-out pass rate") -> str:
    """Side-by-side per-family pass rates, one column per named table (e.g. sft, ppo)."""
    names = list(tables)
    families = sorted({f for t in tables.values() for f in t["per_family"]})
    width = max([len(f) for f in families] + [len("overall"), 8])
    head = f"{title:<{width}}  " + "  ".join(f"{n:>8}" for n in names)
    lines = [head, "-" * len(head)]
    for family in families:
        cells = "  ".join(f"{tables[n]['per_family'].get(family, float('nan')):>8.0%}" for n in names)
        count = next(t["counts"][family] for t in tables.values() if family in t["counts"])
        lines.append(f"{family:<{width}}  {cells}   (n={count})")
    lines.append("-" * len(head))
    lines.append(f"{'overall':<{width}}  " + "  ".join(f"{tables[n]['overall']:>8.1%}" for n in names))
    return "\n".join(lines)


def evaluate(cfg: EvalConfig, run: RunDir | None = None) -> RunResult:
    """`rlhflab eval`: pass rate of `cfg.model` on a split; writes samples and summary."""
    started = time.time()
    configure_threads(cfg.threads)
    seed_everything(cfg.seed, cfg.deterministic)
    if not cfg.model:
        raise UserInputError("no model given", "--model", "pass a model folder, e.g. runs/demo-.../sft/model")
    tokenizer = models.load_tokenizer(cfg.tokenizer or cfg.model, trust_remote_code=cfg.trust_remote_code)
    model = models.load_causal_lm(cfg.model, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code,
                                  device=resolve_device(cfg.device))
    items = eval_items(cfg)
    run = run or RunDir(cfg.output_dir or default_run_path("eval"), overwrite=cfg.overwrite, report_to=cfg.report_to)
    write_config(cfg, run.path / "config.yaml")
    run.write_versions(cfg.seed)
    rows = answer_and_check(model, tokenizer, items, cfg, progress=cfg.progress)
    run.add_samples(rows)
    table = table_from_rows(rows)
    run.log({f"{cfg.split}/pass_rate": table["overall"]}, step=0)
    summary = run.update_summary(
        stage="eval", model=cfg.model, split=cfg.split, pass_rate=table,
        decoding="sampled" if cfg.do_sample else "greedy", wall_time_s={"eval": round(time.time() - started, 1)},
    )
    run.close()
    return RunResult(run.path, summary)
