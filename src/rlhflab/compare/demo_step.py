"""`rlhflab demo --compare`: after the demo's SFT, the comparison from its model; its table joins the demo's summary."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rlhflab.compare.plan import COMPARE_ONLY, available_methods, plan_compare
from rlhflab.compare.run import run_compare
from rlhflab.config import CompareConfig, field_names
from rlhflab.tracking import RunDir, RunResult, default_run_path


def demo_compare_config(demo, sft_model: str, out: str) -> CompareConfig:
    """The comparison the demo runs: compare's defaults, the demo's run, suite and decoding settings, every
    method this version has."""
    own_data = {"train_file", "validation_file", "dataset_split", "dataset_config", "max_prompt_tokens", "strict"}
    names = set(field_names(CompareConfig)) - set(COMPARE_ONLY) - own_data - {"model", "tokenizer", "temperature"}
    shared = {n: getattr(demo, n) for n in names if n in field_names(type(demo))}
    return CompareConfig(**{**shared, "model": sft_model, "methods": ",".join(available_methods()),
                            "output_dir": out, "overwrite": True})


def run_demo_with_comparison(demo_cfg) -> RunResult:
    """`rlhflab demo [--compare]`: the demo, then (with --compare) the comparison from its SFT model into
    RUN/compare, whose table joins the demo's summary (`compare`, and `test_tables` as compare/<method>)."""
    from rlhflab.demo import run_demo

    if not demo_cfg.compare or demo_cfg.resume:  # (the demo refuses --resume with its own message)
        return run_demo(demo_cfg)
    out = Path(demo_cfg.output_dir or default_run_path("demo"))
    demo_cfg = dataclasses.replace(demo_cfg, output_dir=str(out))
    plan_compare(demo_compare_config(demo_cfg, str(out / "sft" / "model"), str(out / "compare")), {})  # before SFT
    result = run_demo(demo_cfg)
    plan = plan_compare(demo_compare_config(demo_cfg, str(result.model_dir), str(result.run_dir / "compare")), {})
    compared = run_compare(plan).summary
    run = RunDir(result.run_dir, resume=True)
    tables = {f"compare/{name}": t for name, t in compared["test_tables"].items() if name != "start"}
    summary = run.update_summary(
        test_tables=tables, test_pass_rate={name: t["overall"] for name, t in tables.items()},
        compare={"budget": compared["budget"], "start": compared["test_pass_rate"]["start"],
                 "methods": {name: {k: m.get(k) for k in ("test_pass_rate", "gain", "kl_to_reference", "wall_s",
                                                           "episodes_per_s", "error") if k in m}
                             for name, m in compared["methods"].items()},
                 "verdict": compared["verdict"], "run_dir": str(plan.out)},
        runs={"compare": str(plan.out)},
        wall_time_s={"compare": compared["wall_time_s"]["total"],
                     "total": round(result.summary["wall_time_s"]["total"] + compared["wall_time_s"]["total"], 1)},
    )
    run.close()
    return RunResult(result.run_dir, summary, result.model_dir)
