"""`rlhflab demo`: the embedded default pipeline, end to end on a CPU.

    tiny tokenizer + Llama-style model  ->  SFT on the built-in suite
    ->  PPO with the task checker as reward (verifiable reward)
    ->  held-out test pass rate of both, per family, same decoding

The reward-model stage slots in beside the checker-reward PPO run later.
"""

from __future__ import annotations

import time

from rlhflab import models
from rlhflab.config import (
    DemoConfig,
    EvalConfig,
    GenerationFields,
    LoadFields,
    PPOConfig,
    RunFields,
    SFTConfig,
    SuiteFields,
    field_names,
    read_yaml_config,
    write_config,
)
from rlhflab.eval import answer_and_check, eval_items, table_from_rows
from rlhflab.tracking import RunDir, RunResult, default_run_path
from rlhflab.trainers import ppo, sft
from rlhflab.trainers.setup import resolve_device

# Parts whose values the demo hands to every stage; other fields keep each stage's own defaults
# (SFT's learning rate is no PPO learning rate).
SHARED_PARTS = (RunFields, LoadFields, SuiteFields, GenerationFields)


def shared_fields(demo: DemoConfig) -> dict:
    names = {n for part in SHARED_PARTS for n in field_names(part)} - {"output_dir", "overwrite"}
    return {n: getattr(demo, n) for n in names}


def ppo_stage_config(demo: DemoConfig, model_dir: str, out: str) -> PPOConfig:
    values = {**shared_fields(demo), "temperature": PPOConfig().temperature}
    values |= {"total_episodes": demo.ppo_total_episodes, "learning_rate": demo.ppo_learning_rate,
               "kl_coef": demo.ppo_kl_coef, "lr_schedule": "constant"}
    if demo.ppo_config:
        values |= read_yaml_config(demo.ppo_config, PPOConfig)
    return PPOConfig(**{**values, "model": model_dir, "tokenizer": "", "output_dir": out, "overwrite": True})


def test_table(run: RunDir, name: str, model_dir, demo: DemoConfig) -> dict:
    """Held-out test pass rate of one model, answers appended to the demo's samples."""
    cfg = EvalConfig(**{**shared_fields(demo), "model": str(model_dir), "split": "test"})
    model = models.load_causal_lm(cfg.model, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code,
                                  device=resolve_device(cfg.device))
    tokenizer = models.load_tokenizer(cfg.model, trust_remote_code=cfg.trust_remote_code)
    rows = answer_and_check(model, tokenizer, eval_items(cfg), cfg, progress=False)
    run.add_samples({"stage": name, **row} for row in rows)
    table = table_from_rows(rows)
    run.log({f"test/pass_rate/{name}": table["overall"]}, step=0)
    return table


def run_demo(cfg: DemoConfig) -> RunResult:
    started = time.time()
    run = RunDir(cfg.output_dir or default_run_path("demo"), overwrite=cfg.overwrite, report_to=cfg.report_to)
    write_config(cfg, run.path / "config.yaml")
    run.write_versions()
    walls, tables, runs = {}, {}, {}

    # 1. SFT from scratch: builds the tokenizer and tiny model, trains, saves run/sft/model
    sft_values = {n: getattr(cfg, n) for n in field_names(SFTConfig)}
    sft_result = sft.train(SFTConfig(**{**sft_values, "output_dir": str(run.path / "sft"), "overwrite": True}))
    walls["sft"], runs["sft"] = time.time() - started, str(sft_result.run_dir)
    tables["sft"] = test_table(run, "sft", sft_result.model_dir, cfg)

    # 2. PPO from the SFT model, with the task checker as reward (the RM stage adds a learned one)
    final_kl = None
    if cfg.run_ppo:
        t0 = time.time()
        ppo_cfg = ppo_stage_config(cfg, str(sft_result.model_dir), str(run.path / "ppo"))
        ppo_result = ppo.train(ppo_cfg)
        walls["ppo"], runs["ppo"] = time.time() - t0, str(ppo_result.run_dir)
        final_kl = ppo_result.summary["final"]["objective/kl"]
        tables["ppo"] = test_table(run, "ppo", ppo_result.model_dir, cfg)

    walls["total"] = time.time() - started
    summary = run.update_summary(
        stage="demo",
        test_pass_rate={name: t["overall"] for name, t in tables.items()},
        test_tables=tables,
        kl_to_reference={"ppo": final_kl} if final_kl is not None else {},
        decoding="sampled" if cfg.do_sample else "greedy",
        sft_validation=sft_result.summary.get("validation"),
        parameters=sft_result.summary.get("parameters"),
        wall_time_s={k: round(v, 1) for k, v in walls.items()},
        runs=runs,
    )
    run.close()
    return RunResult(run.path, summary, sft_result.model_dir)

