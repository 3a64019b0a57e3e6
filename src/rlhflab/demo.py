"""`rlhflab demo`: the embedded default pipeline, end to end on a CPU.

    tiny tokenizer + Llama-style model  ->  SFT on the built-in suite
    ->  held-out test pass rate, per family

Later stages (reward model, PPO) slot in after SFT and add their columns.
"""

from __future__ import annotations

import time

from rlhflab.config import DemoConfig, EvalConfig, SFTConfig, field_names, write_config
from rlhflab import models
from rlhflab.eval import answer_and_check, eval_items, table_from_rows
from rlhflab.tracking import RunDir, RunResult, default_run_path
from rlhflab.trainers import sft


def stage_config(config_cls: type, demo: DemoConfig, **overrides):
    """The stage's config: every field it shares with the demo config, then overrides."""
    shared = {name: getattr(demo, name) for name in field_names(config_cls) if hasattr(demo, name)}
    return config_cls(**{**shared, **overrides})


def run_demo(cfg: DemoConfig) -> RunResult:
    started = time.time()
    run = RunDir(cfg.output_dir or default_run_path("demo"), overwrite=cfg.overwrite, report_to=cfg.report_to)
    write_config(cfg, run.path / "config.yaml")
    run.write_versions()

    # 1. SFT from scratch: builds the tokenizer and tiny model, trains, saves run/sft/model
    sft_cfg = stage_config(SFTConfig, cfg, output_dir=str(run.path / "sft"), overwrite=True)
    sft_result = sft.train(sft_cfg)
    sft_done = time.time()

    # 2. held-out test split, same decoding for every model evaluated here
    eval_cfg = stage_config(EvalConfig, cfg, model=str(sft_result.model_dir), split="test", tokenizer="")
    model = models.load_causal_lm(eval_cfg.model)
    tokenizer = models.load_tokenizer(eval_cfg.model)
    rows = answer_and_check(model, tokenizer, eval_items(eval_cfg), eval_cfg, progress=cfg.progress)
    run.add_samples({"stage": "sft", **row} for row in rows)
    table = table_from_rows(rows)
    run.log({"test/pass_rate/sft": table["overall"]}, step=0)

    summary = run.update_summary(
        stage="demo",
        test_pass_rate={"sft": table["overall"]},
        test_tables={"sft": table},
        decoding="sampled" if cfg.do_sample else "greedy",
        sft_validation=sft_result.summary.get("validation"),
        parameters=sft_result.summary.get("parameters"),
        wall_time_s={"sft": round(sft_done - started, 1), "eval": round(time.time() - sft_done, 1),
                     "total": round(time.time() - started, 1)},
        runs={"sft": str(sft_result.run_dir)},
    )
    run.close()
    return RunResult(run.path, summary, sft_result.model_dir)
