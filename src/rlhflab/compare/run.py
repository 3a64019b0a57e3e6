"""Running a comparison: the starting model judged once, then each method trained, tested and measured in turn."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rlhflab.compare.judge import Judge
from rlhflab.compare.plan import METHODS, ComparePlan, Method
from rlhflab.config import write_config
from rlhflab.errors import Interrupted, UserInputError, writing
from rlhflab.eval import RunMonitor, table_from_rows
from rlhflab.report import write_report
from rlhflab.intervals import paired_counts
from rlhflab.report.method_compare import verdict_lines, write_method_comparison
from rlhflab.tracking import RunDir, RunResult
from rlhflab.trainers.setup import configure_threads, seed_everything

log = logging.getLogger("rlhflab")


@dataclass
class MethodOutcome:
    name: str
    run_dir: Path
    entry: dict[str, Any]  # summary.json's methods.<name>
    table: dict | None = None  # its test pass-rate table; None when it failed
    answers: list[dict] = dataclasses.field(default_factory=list)  # its checked test answers, in prompt order


def train_method(method: Method, mcfg) -> RunResult:
    """The method's trainer as its own command runs it (online methods with their alarms and stopping rule)."""
    train = importlib.import_module(method.module).train
    if "monitor" in inspect.signature(train).parameters and hasattr(mcfg, "stop_on_alarms"):
        return train(mcfg, monitor=RunMonitor.from_config(mcfg))
    return train(mcfg)


def method_entry(result: RunResult, wall_s: float, kl: float, table: dict, start: float) -> dict[str, Any]:
    """summary.json's methods.<name>: the test numbers measured here, the rest from the method's own summary."""
    summary = result.summary
    episodes = summary.get("episodes", summary.get("pairs"))
    loop_s = (summary.get("wall_time_s") or {}).get("loop")
    throughput_s = loop_s if isinstance(loop_s, (int, float)) and loop_s > 0 else wall_s
    return {
        "test_pass_rate": table["overall"], "gain": table["overall"] - start, "kl_to_reference": kl,
        "wall_s": round(wall_s, 3), "train_s": loop_s, "episodes": episodes,
        # answers sampled, beyond the trained ones: --dynamic_sampling's dropped groups, --filter_prompts' probe
        "episodes_generated": (summary.get("episodes_generated") or episodes or 0)
        + ((summary.get("prompt_filter") or {}).get("generated") or 0) if isinstance(episodes, (int, float)) else None,
        "episodes_per_s": episodes / throughput_s if isinstance(episodes, (int, float)) else None,
        "stopped": summary.get("stopped"), "alarms": summary.get("alarms", []),
        "validation": summary.get("validation_pass_rate") or summary.get("validation_reward"),
        "run_dir": str(result.run_dir), "model_dir": str(result.model_dir),
    }


def run_method(name: str, mcfg, judge: Judge, start: float) -> MethodOutcome:
    """Train one method, then test it and measure its KL; any failure is recorded, not raised."""
    run_dir = Path(mcfg.output_dir)
    t0 = time.time()
    try:
        result = train_method(METHODS[name], mcfg)
        wall_s = time.time() - t0
        model = judge.load(result.model_dir)
        answers = judge.answers(model)
        table = table_from_rows(answers)
        entry = method_entry(result, wall_s, judge.kl(model), table, start)
    except (KeyboardInterrupt, Interrupted):
        raise
    except Exception as err:  # noqa: BLE001 - one method failing must not lose the others' results
        log.warning("compare: %s failed after %.0f s: %s: %s", name, time.time() - t0, type(err).__name__, err,
                    exc_info=not isinstance(err, (UserInputError, FloatingPointError)))
        return MethodOutcome(name, run_dir, {"error": f"{type(err).__name__}: {err}", "run_dir": str(run_dir),
                                             "wall_s": round(time.time() - t0, 3)})
    _write_method_report(run_dir)
    return MethodOutcome(name, run_dir, entry, table, answers)


def _write_method_report(run_dir: Path) -> None:
    try:
        write_report(run_dir)
    except Exception as err:  # noqa: BLE001 - the run is written; `rlhflab report` can rebuild its page
        log.warning("report of %s not written (%s: %s)", run_dir, type(err).__name__, err)


def run_compare(plan: ComparePlan) -> RunResult:
    """Evaluate the starting model, then train, test and measure each method in turn; write summary and report.

    summary.json is rewritten after every method, so a comparison cut short keeps what it finished.
    """
    started = time.time()
    cfg = plan.cfg
    configure_threads(cfg.threads)
    seed_everything(cfg.seed, cfg.deterministic)
    run = RunDir(plan.out, overwrite=cfg.overwrite, report_to=cfg.report_to)
    write_config(cfg, run.path / "config.yaml")
    if plan.sections:  # config.yaml stays a valid --config: shared fields plus each method's section
        text = yaml.safe_dump(plan.sections, sort_keys=False)
        with writing("config.yaml", run.path / "config.yaml", run.path, len(text.encode())):
            with open(run.path / "config.yaml", "a") as f:
                f.write(text)
    run.write_versions(cfg.seed)
    judge = Judge(cfg)
    start_answers = judge.answers(judge.reference)
    run.add_samples({"model": "start", **a} for a in start_answers)
    start = table_from_rows(start_answers)
    run.log({"test/pass_rate/start": start["overall"]}, step=0)
    log.info("compare: starting model, test pass rate %.1f%% on %d prompts", 100 * start["overall"], len(judge.rows))
    outcomes: list[MethodOutcome] = []
    for i, (name, mcfg) in enumerate(plan.configs.items(), start=1):
        log.info("compare %d/%d: %s (%s) -> %s", i, len(plan.configs), name, plan.budget, mcfg.output_dir)
        outcome = run_method(name, mcfg, judge, start["overall"])
        run.add_samples({"model": name, **a} for a in outcome.answers)
        if outcome.table is not None:
            run.log({f"test/pass_rate/{name}": outcome.table["overall"]}, step=i)
        outcomes.append(outcome)
        summary = write_summary(run, plan, judge, start_answers, outcomes, time.time() - started)
    write_method_comparison(run.path)
    run.close()
    return RunResult(run.path, summary)


def write_summary(run: RunDir, plan: ComparePlan, judge: Judge, start_answers: list[dict],
                  outcomes: list[MethodOutcome], elapsed: float) -> dict:
    start = table_from_rows(start_answers)
    start_passed = [bool(a["passed"]) for a in start_answers]
    methods, tables = {}, {"start": start}
    for outcome in outcomes:
        entry = dict(outcome.entry)
        if outcome.table is not None:
            tables[outcome.name] = outcome.table
            entry["vs_start"] = paired_counts(start_passed, [bool(a["passed"]) for a in outcome.answers])
        methods[outcome.name] = entry
    passed = {"start": start_passed} | {o.name: [bool(a["passed"]) for a in o.answers] for o in outcomes if o.answers}
    for name, entry in methods.items():  # a variant against the method it varies, prompt by prompt
        base = METHODS[name].variant_of
        if base in passed and name in passed:
            entry["vs_method"] = {"method": base, **paired_counts(passed[base], passed[name])}
    summary = {
        "stage": "compare", "model": plan.cfg.model, "budget": {"kind": plan.budget.kind, "amount": plan.budget.amount},
        "methods_run": list(plan.configs),
        "test": {"prompts": len(judge.rows), "source": plan.cfg.prompts_file or "built-in suite, test split",
                 "verifier": getattr(judge.verifier, "name", type(judge.verifier).__name__),
                 "decoding": "sampled" if plan.cfg.do_sample else "greedy",
                 "kl": f"k1 over {plan.cfg.kl_samples} response(s) per test prompt sampled at temperature "
                       f"{plan.cfg.temperature:g}, to the starting model"},
        "test_pass_rate": {name: table["overall"] for name, table in tables.items()},
        "test_tables": tables, "methods": methods,
        "failed": [o.name for o in outcomes if "error" in o.entry],
        "wall_time_s": {"total": round(elapsed, 1), **{o.name: o.entry.get("wall_s") for o in outcomes}},
    }
    summary["verdict"] = verdict_lines(summary, passed)
    run.write_json("summary.json", summary)
    return summary
