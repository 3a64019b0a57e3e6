"""Planning a comparison: parse the methods, the budget and the per-method sections of the --config YAML, and
build and check every method's config before anything runs (rlhflab.compare's docstring says what is shared)."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from rlhflab import config as configs
from rlhflab.config import COMPARE_METHODS, COMPARE_VARIANTS, CompareConfig, check_values, field_names, parse_config
from rlhflab.errors import UserInputError
from rlhflab.eval import RunMonitor
from rlhflab.tracking import default_run_path

WHERE = "rlhflab compare"


@dataclass(frozen=True)
class Method:
    name: str
    config: str  # its config class in rlhflab.config
    module: str  # its trainer: module.train(cfg, ...) -> RunResult
    online: bool  # samples its own responses (budget in episodes); False: trains on fixed pairs (budget in pairs)
    variant_of: str = ""  # a variant: the method it is run beside (its gain is also paired against that method's)
    settings: tuple[tuple[str, Any], ...] = ()  # a variant's own settings, before its section's


def variant(method: Method, suffix: str, *settings: tuple[str, Any]) -> Method:
    return dataclasses.replace(method, name=f"{method.name}{suffix}", variant_of=method.name, settings=settings)


BASE_METHODS = (
    Method("ppo", "PPOConfig", "rlhflab.trainers.ppo", online=True),
    Method("grpo", "GRPOConfig", "rlhflab.trainers.grpo", online=True),
    Method("rloo", "RLOOConfig", "rlhflab.trainers.rloo", online=True),
    Method("reinforce", "REINFORCEConfig", "rlhflab.trainers.reinforce", online=True),
    Method("dpo", "DPOConfig", "rlhflab.trainers.dpo", online=False),
    Method("online-dpo", "OnlineDPOConfig", "rlhflab.trainers.online_dpo", online=True),
)
GROUP_RELATIVE = ("grpo", "rloo", "online-dpo")  # their advantages compare a prompt's answers: the controls apply
METHODS: dict[str, Method] = {m.name: m for m in (
    *BASE_METHODS,
    *(variant(m, "-async", ("async_generation", True)) for m in BASE_METHODS if m.online),
    *(variant(m, "+dynamic", ("dynamic_sampling", True)) for m in BASE_METHODS if m.name in GROUP_RELATIVE),
    *(variant(m, "+filter", ("filter_prompts", "pass_rate")) for m in BASE_METHODS if m.name in GROUP_RELATIVE),
    *(variant(m, "+entropy", ("use_adaptive_entropy", True)) for m in BASE_METHODS if m.name in ("grpo", "rloo")),
)}
assert tuple(METHODS) == COMPARE_METHODS + COMPARE_VARIANTS
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
    """The methods (not their variants) this version of rlhflab can run: `rlhflab demo --compare` runs them all."""
    found = []
    for method in (METHODS[name] for name in COMPARE_METHODS):
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
                raise UserInputError(f"two sections for {name} ('{name}' and '{key}')", config_path,
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
    values = {**shared, **quiet, **dict(method.settings), **own}
    values |= budget_values(method, budget, cls, values)
    values |= {"model": cfg.model, "tokenizer": cfg.tokenizer, "output_dir": str(out / method.name),
               "overwrite": cfg.overwrite}
    return cls(**values)


def check_method_config(method: Method, mcfg) -> None:
    """The checks a method's own command does before loading anything (its trainer's `check_config`)."""
    if hasattr(mcfg, "stop_on_alarms"):
        RunMonitor.from_config(mcfg)  # a bad stop_on_alarms in a section
    module = importlib.import_module(method.module)
    stage = (method.variant_of or method.name).replace("-", "_")
    check = getattr(module, "check_config", None) or getattr(module, f"check_{stage}_config", None)
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
    from rlhflab.rewards.functions import CallLimits

    CallLimits(cfg.reward_timeout, cfg.reward_errors)  # a negative --reward_timeout (the judge's verifier)


def plan_compare(cfg: CompareConfig, sections: dict[str, dict], where: str = "--config") -> ComparePlan:
    """Parse the methods and the budget and build every method's config; run nothing."""
    check_compare_config(cfg)
    names = parse_methods(cfg.methods)
    budget = parse_budget(cfg.budget)
    stray = sorted(set(sections) - set(names) - {METHODS[n].variant_of for n in names})
    if stray:
        raise UserInputError(f"a section for {', '.join(stray)}, which --methods does not list", where,
                             f"add it to --methods ({cfg.methods}) or remove the section")
    out = Path(cfg.output_dir or default_run_path("compare"))
    plans = {}
    for name in names:
        method = METHODS[name]
        section = {**sections.get(method.variant_of, {}), **sections.get(name, {})}  # a variant: its method's first
        plans[name] = method_config(method, cfg, budget, section, out, where)
        check_method_config(method, plans[name])
    return ComparePlan(cfg, budget, plans, sections, out)


def parse_compare(argv: list[str]) -> ComparePlan:
    """`rlhflab compare` arguments -> a checked plan: the shared fields via parse_config, the sections from --config."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    cfg = parse_config(CompareConfig, argv, prog=WHERE)
    return plan_compare(cfg, read_sections(known.config), known.config or "--config")
