"""`rlhflab compare`: which method helps on *this* task, judged fairly.

    rlhflab compare --model runs/demo-.../sft/model --methods ppo,grpo,rloo,reinforce,dpo,online-dpo \\
        --budget episodes=3840 --output_dir runs/compare

Every method starts from the same model, with the same prompts, seed, reward, generation
settings and budget, and is judged by the same evaluation:

  budget      episodes=N: N sampled responses (`total_episodes`) for an online method, N
              preference pairs trained on (`max_pairs`) for DPO; or seconds=S of training
              wall time (`max_seconds`) for every method
  test        the test split (the suite's, or --prompts_file with --verifier, as `rlhflab
              eval`), the same decoding (greedy by default), read once at the end; the
              starting model is evaluated once too, so gain = end - start
  KL          of every trained model to the starting model, measured the same way for all
              (DPO too): responses sampled at the rollout temperature for each test prompt,
              mean of sum_t log pi(a_t) - log pi_ref(a_t) (the k1 Monte-Carlo estimate)

Each method's own settings are its config's defaults (its recipe for the suite), changed only
by its section of the --config YAML (`grpo: {learning_rate: 2.0e-5}`); a section may not set
a shared field or the budget. Every config is built and checked before the first run.

    DIR/config.yaml, versions.json   the comparison's own config and software
    DIR/<method>/                    each method's run folder (config, metrics, summary, report.html, model/)
    DIR/samples.jsonl                every model's test answers with their verdicts (paired by prompt_index)
    DIR/summary.json                 test_pass_rate / test_tables per model, methods.<name>.{test_pass_rate,
                                     gain, kl_to_reference, wall_s, episodes, episodes_per_s, stopped, alarms}
    DIR/report.html                  the methods side by side, curves on shared axes, the verdict in words

A method that fails is recorded with its error and the others still run. This module runs
trainers and writes reports, so it sits beside sweep.py (layer 6, below cli).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import importlib.util
import inspect
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import yaml

from rlhflab import config as configs
from rlhflab import data, models
from rlhflab.config import COMPARE_METHODS, CompareConfig, EvalConfig, check_values, field_names, parse_config
from rlhflab.config import write_config
from rlhflab.errors import Interrupted, UserInputError
from rlhflab.eval import RunMonitor, answer_and_check, eval_prompts, eval_verifier, table_from_rows
from rlhflab.report import write_report
from rlhflab.report.method_compare import paired_counts, verdict_lines, write_method_comparison
from rlhflab.rollout import GenerationSettings, generate, response_logprobs
from rlhflab.tracking import RunDir, RunResult, default_run_path
from rlhflab.trainers.setup import configure_threads, resolve_device, seed_everything

log = logging.getLogger("rlhflab")

WHERE = "rlhflab compare"


@dataclass(frozen=True)
class Method:
    name: str
    config: str  # its config class in rlhflab.config
    module: str  # its trainer: module.train(cfg, ...) -> RunResult
    online: bool  # samples its own responses (budget in episodes); False: trains on fixed pairs (budget in pairs)


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("ppo", "PPOConfig", "rlhflab.trainers.ppo", online=True),
    Method("grpo", "GRPOConfig", "rlhflab.trainers.grpo", online=True),
    Method("rloo", "RLOOConfig", "rlhflab.trainers.rloo", online=True),
    Method("reinforce", "REINFORCEConfig", "rlhflab.trainers.reinforce", online=True),
    Method("dpo", "DPOConfig", "rlhflab.trainers.dpo", online=False),
    Method("online-dpo", "OnlineDPOConfig", "rlhflab.trainers.online_dpo", online=True),
)}
assert tuple(METHODS) == COMPARE_METHODS
# fields of CompareConfig that are the comparison's own, not handed to the methods
COMPARE_ONLY = ("methods", "budget", "prompts_file", "kl_samples", "output_dir", "overwrite")
BUDGET_FIELDS = ("total_episodes", "max_seconds", "max_pairs", "max_steps", "num_epochs")
# not training settings: the sample-answer table each method logs at its evaluations is off unless a section turns
# it on (six methods' tables would bury the comparison's progress lines)
QUIET = {"console_samples": 0}
# a wall-time budget: the run's length in updates is not known in advance, so its episode / step cap is this
# (out of reach) and its learning rate is constant unless the method's section sets a schedule
OPEN_ENDED = 10**9


@dataclass(frozen=True)
class Budget:
    kind: Literal["episodes", "seconds"]
    amount: float

    def __str__(self) -> str:
        return f"{self.kind}={self.amount:g}"


@dataclass(frozen=True)
class ComparePlan:
    """What a comparison will run: every method's config built and checked before the first run."""

    cfg: CompareConfig
    budget: Budget
    configs: dict[str, Any]  # method name -> its config (output_dir = DIR/<name>)
    sections: dict[str, dict]  # the --config YAML's per-method sections, as written
    out: Path


@dataclass
class MethodOutcome:
    name: str
    run_dir: Path
    entry: dict[str, Any]  # summary.json's methods.<name>
    table: dict | None = None  # its test pass-rate table; None when it failed
    answers: list[dict] = dataclasses.field(default_factory=list)  # its checked test answers, in prompt order


# --- planning: parse and check everything before any work -----------------------------------------


def parse_budget(text: str) -> Budget:
    """'episodes=3840' or 'seconds=120' -> Budget; anything else a UserInputError saying what to write."""
    example = "write episodes=N (sampled responses; DPO: pairs) or seconds=S (training wall time), e.g. episodes=3840"
    kind, sep, value = text.strip().partition("=")
    kind = kind.strip()
    if not sep or kind not in ("episodes", "seconds"):
        close = difflib.get_close_matches(kind, ["episodes", "seconds"], n=1)
        raise UserInputError(f"cannot read --budget {text!r}", "--budget",
                             f"did you mean {close[0]}={value.strip() or 'N'}?" if close and sep else example)
    try:
        amount = int(value) if kind == "episodes" else float(value)
    except ValueError:
        raise UserInputError(f"{kind} must be {'a whole number' if kind == 'episodes' else 'a number'}, got "
                             f"{value.strip()!r}", "--budget", example) from None
    if not amount > 0 or not math.isfinite(amount):
        raise UserInputError(f"the budget must be positive, got {text!r}", "--budget", example)
    return Budget(kind, amount)


def parse_methods(text: str) -> list[str]:
    """'ppo, grpo' -> ['ppo', 'grpo'] in the order given; unknown or repeated names are errors."""
    names = [n.strip().lower().replace("_", "-") for n in text.split(",") if n.strip()]
    if not names:
        raise UserInputError("no method given", "--methods", f"choose from {', '.join(METHODS)}")
    for name in names:
        if name not in METHODS:
            close = difflib.get_close_matches(name, list(METHODS), n=1)
            raise UserInputError(f"unknown method '{name}'", "--methods",
                                 f"did you mean '{close[0]}'?" if close else f"choose from {', '.join(METHODS)}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise UserInputError(f"method listed twice: {', '.join(repeated)}", "--methods", "list each method once")
    return names


def config_class(method: Method) -> type:
    """The method's config class, or a UserInputError when this version of rlhflab has no such trainer."""
    cls = getattr(configs, method.config, None)
    if cls is None or importlib.util.find_spec(method.module) is None:
        missing = method.module if cls is not None else f"rlhflab.config.{method.config}"
        raise UserInputError(f"method '{method.name}' is not available in this version of rlhflab ({missing} "
                             "does not exist)", "--methods", f"leave it out; available: {', '.join(available_methods())}")
    return cls


def available_methods() -> list[str]:
    found = []
    for method in METHODS.values():
        if getattr(configs, method.config, None) is not None and importlib.util.find_spec(method.module) is not None:
            found.append(method.name)
    return found


def read_sections(config_path: str | None) -> dict[str, dict]:
    """The per-method sections of the --config YAML (`grpo: {...}`); the shared keys were read by parse_config."""
    if not config_path:
        return {}
    values = yaml.safe_load(Path(config_path).read_text()) or {}  # parse_config already checked file and syntax
    sections = {}
    for key in CompareConfig.yaml_sections:
        if key in values:
            if not isinstance(values[key], dict):
                raise UserInputError(f"section '{key}' must be a mapping of {key}'s config fields", config_path,
                                     f"write e.g. {key}: {{learning_rate: 1.0e-4}}")
            name = key.replace("_", "-")
            if name in sections:
                raise UserInputError(f"two sections for {name} ('{name}' and 'online_dpo')", config_path,
                                     "keep one of them")
            sections[name] = values[key]
    return sections


def shared_values(cfg: CompareConfig, method: Method, cls: type) -> dict[str, Any]:
    """The comparison's shared fields that this method's config has; DPO's data files are pairs, not prompts."""
    names = set(field_names(CompareConfig)) - set(COMPARE_ONLY)
    if not method.online:
        names -= {"train_file", "validation_file"}
    return {n: getattr(cfg, n) for n in names & set(field_names(cls))}


def check_section(name: str, section: dict, cls: type, shared: dict, where: str) -> dict[str, Any]:
    """A method's own settings: its config's fields, but neither a shared field nor the budget."""
    fixed = [k for k in section if k in shared or k in ("output_dir", "overwrite", "model", "tokenizer")]
    if fixed:
        raise UserInputError(f"{', '.join(fixed)} is shared by every method of a comparison", f"{where}: {name}",
                             "set it once at the top level of the config (or as a flag), so all methods get it")
    budget = [k for k in section if k in BUDGET_FIELDS]
    if budget:
        raise UserInputError(f"{', '.join(budget)} is part of the budget, the same for every method",
                             f"{where}: {name}", "use --budget episodes=N or --budget seconds=S")
    return check_values(section, cls, f"{where}: {name}")


def budget_values(method: Method, budget: Budget, cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """The fields that give this method the budget (`values`: its other fields, for batch_size)."""
    names = set(field_names(cls))
    field = "max_seconds" if budget.kind == "seconds" else ("total_episodes" if method.online else "max_pairs")
    if field not in names:
        raise UserInputError(f"{method.name} cannot take a {budget.kind} budget in this version ({cls.__name__} "
                             f"has no {field})", "--budget", "use the other kind of budget, or leave the method out")
    batch = values.get("batch_size", _default(cls, "batch_size"))
    if budget.kind == "episodes" and method.online:
        if budget.amount % batch:
            lower, upper = budget.amount // batch * batch, (budget.amount // batch + 1) * batch
            raise UserInputError(f"episodes={budget.amount:g} is not a whole number of {method.name}'s updates "
                                 f"(batch_size {batch})", "--budget",
                                 f"use episodes={lower or upper} or episodes={upper}, so every method samples exactly "
                                 "as many responses")
        return {"total_episodes": int(budget.amount), **({"max_seconds": 0.0} if "max_seconds" in names else {})}
    if budget.kind == "episodes":  # pairs: enough steps to reach them whatever the data size; max_pairs stops it
        return {"max_pairs": int(budget.amount), "max_steps": math.ceil(budget.amount / batch)}
    open_ended = {"total_episodes": OPEN_ENDED // batch * batch} if method.online else {"max_steps": OPEN_ENDED}
    schedule = {} if "lr_schedule" in values else {"lr_schedule": "constant"}
    return {"max_seconds": float(budget.amount), **open_ended, **schedule}


def _default(cls: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def method_config(method: Method, cfg: CompareConfig, budget: Budget, section: dict, out: Path, where: str):
    cls = config_class(method)
    shared = shared_values(cfg, method, cls)
    own = check_section(method.name, section, cls, shared, where)
    quiet = {k: v for k, v in QUIET.items() if k in field_names(cls)}
    values = {**shared, **quiet, **own}
    values |= budget_values(method, budget, cls, values)
    values |= {"model": cfg.model, "tokenizer": cfg.tokenizer, "output_dir": str(out / method.name),
               "overwrite": cfg.overwrite}
    return cls(**values)


def check_method_config(method: Method, mcfg) -> None:
    """The checks a method's own command does before loading anything (its trainer's `check_config`)."""
    if hasattr(mcfg, "stop_on_alarms"):
        RunMonitor.from_config(mcfg)  # a bad stop_on_alarms in a section
    module = importlib.import_module(method.module)
    check = getattr(module, "check_config", None) or getattr(module, f"check_{method.name.replace('-', '_')}_config", None)
    if check is not None:
        check(mcfg)


def check_compare_config(cfg: CompareConfig) -> None:
    if not cfg.model:
        raise UserInputError("no starting model given", "--model",
                             "pass the SFT model every method starts from, e.g. runs/demo-.../sft/model")
    if cfg.train_file and not cfg.prompts_file:
        raise UserInputError("training on your own prompts but testing on the built-in suite", "--prompts_file",
                             "pass your held-out test prompts (and --verifier), as for rlhflab eval")
    if cfg.kl_samples < 1:
        raise UserInputError(f"kl_samples must be >= 1, got {cfg.kl_samples}", "--kl_samples")


def plan_compare(cfg: CompareConfig, sections: dict[str, dict], where: str = "--config") -> ComparePlan:
    """Parse the methods and the budget and build every method's config; run nothing."""
    check_compare_config(cfg)
    names = parse_methods(cfg.methods)
    budget = parse_budget(cfg.budget)
    stray = sorted(set(sections) - set(names))
    if stray:
        raise UserInputError(f"a section for {', '.join(stray)}, which --methods does not list", where,
                             f"add it to --methods ({cfg.methods}) or remove the section")
    out = Path(cfg.output_dir or default_run_path("compare"))
    plans = {}
    for name in names:
        method = METHODS[name]
        plans[name] = method_config(method, cfg, budget, sections.get(name, {}), out, where)
        check_method_config(method, plans[name])
    return ComparePlan(cfg, budget, plans, sections, out)


def parse_compare(argv: list[str]) -> ComparePlan:
    """`rlhflab compare` arguments -> a checked plan: the shared fields via parse_config, the sections from --config."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    cfg = parse_config(CompareConfig, argv, prog=WHERE)
    return plan_compare(cfg, read_sections(known.config), known.config or "--config")


# --- measuring: the same test evaluation and KL for every model ------------------------------------


class Judge:
    """The same judge for every model: the test prompts, verifier, decoding and the starting model (KL's
    reference), loaded once."""

    def __init__(self, cfg: CompareConfig):
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.tokenizer = models.load_tokenizer(cfg.tokenizer or cfg.model, trust_remote_code=cfg.trust_remote_code)
        self.eval_cfg = EvalConfig(**{n: getattr(cfg, n) for n in field_names(EvalConfig) if hasattr(cfg, n)},
                                   split="test")
        self.rows = eval_prompts(self.eval_cfg, self.tokenizer)
        self.verifier = eval_verifier(self.eval_cfg, self.rows)
        self.reference = self.load(cfg.model)  # the starting model: evaluated once, and KL's reference

    def load(self, folder: str | Path):
        return models.load_causal_lm(str(folder), dtype=self.cfg.dtype, trust_remote_code=self.cfg.trust_remote_code,
                                     device=self.device).eval()

    def answers(self, model) -> list[dict]:
        """Checked answers to every test prompt, with the comparison's evaluation decoding and seed."""
        rows = answer_and_check(model, self.tokenizer, self.rows, self.verifier, self.cfg, progress=False)
        return [{"prompt_index": i, **row} for i, row in enumerate(rows)]

    def kl(self, model) -> float:
        return kl_to_reference(model, self.reference, self.tokenizer, [r.prompt for r in self.rows],
                               samples=self.cfg.kl_samples, response_length=self.cfg.response_length,
                               temperature=self.cfg.temperature, batch_size=self.cfg.eval_batch_size, seed=self.cfg.seed)


@torch.no_grad()
def kl_to_reference(policy, reference, tokenizer, prompts: list[str], *, samples: int, response_length: int,
                    temperature: float, batch_size: int, seed: int) -> float:
    """Mean over responses sampled from `policy` of sum_t [log pi(a_t|s_t) - log pi_ref(a_t|s_t)], in nats.

    The k1 Monte-Carlo estimate of KL(pi || pi_ref) per response: unbiased, exactly 0 when policy is the
    reference. Sampling uses the full softmax at `temperature` and the log-probs are taken at the same
    temperature, as in the online methods' rollouts; `samples` responses per prompt, a fixed seed.
    """
    settings = GenerationSettings(response_length, True, temperature)
    generator = torch.Generator().manual_seed(seed)
    encoded = [ids for ids in data.encode_prompts(tokenizer, prompts) for _ in range(samples)]
    totals = []
    for start in range(0, len(encoded), batch_size):
        out = generate(policy, encoded[start:start + batch_size], pad_id=tokenizer.pad_token_id,
                       eos_id=tokenizer.eos_token_id, settings=settings, generator=generator)
        args = (out.query_ids, out.query_mask, out.response_ids, out.response_mask, temperature)
        logprobs, ref_logprobs = response_logprobs(policy, *args), response_logprobs(reference, *args)  # (B, T)
        totals.append((logprobs - ref_logprobs).sum(dim=1))  # 0 past each response's end
    return torch.cat(totals).mean().item()


# --- running -----------------------------------------------------------------------------------------


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
        with open(run.path / "config.yaml", "a") as f:
            f.write(yaml.safe_dump(plan.sections, sort_keys=False))
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


def _cell(value: Any, kind: str) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return "—"
    return {"pct": f"{value:.1%}", "pts": f"{100 * value:+.1f} pts", "kl": f"{value:.3g}", "s": f"{value:.0f}",
            "eps": f"{value:.1f}"}[kind]


def format_compare_table(summary: dict) -> str:
    """method | test pass | gain | KL | wall s | episodes/s, one line per model (the start first), aligned."""
    lines = [["method", "test pass", "gain", "KL", "wall s", "episodes/s"],
             ["start", _cell(summary["test_pass_rate"]["start"], "pct"), "", "0", "", ""]]
    for name, m in summary["methods"].items():
        if "error" in m:
            lines.append([name, f"failed: {m['error'][:70]}", "", "", _cell(m.get("wall_s"), "s"), ""])
            continue
        lines.append([name, _cell(m["test_pass_rate"], "pct"), _cell(m["gain"], "pts"), _cell(m["kl_to_reference"], "kl"),
                      _cell(m["wall_s"], "s"), _cell(m["episodes_per_s"], "eps")])
    widths = [max(len(line[i]) for line in lines if not line[1].startswith("failed") or i != 1) for i in range(6)]
    text = ["  ".join(c.ljust(w) if i == 0 or c.startswith("failed") else c.rjust(w)
                      for i, (c, w) in enumerate(zip(line, widths))).rstrip() for line in lines]
    return "\n".join([text[0], "  ".join("-" * w for w in widths), *text[1:]])


# --- the demo's --compare step ------------------------------------------------------------------------


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
