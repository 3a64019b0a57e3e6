"""One-at-a-time sweeps: `rlhflab sweep --stage ppo --config base.yaml --vary cliprange=0.1,0.2,0.3`.

A setting is judged by changing it alone. Every run of a sweep gets the same config —
model, prompts (suite seed and sizes), seed, generation settings, every other field —
except the varied field and its own folder `OUT/<field>=<value>/`; two fields at once
are refused, since a difference could then not be attributed to either. All values are
parsed and every run's config checked before the first run starts, so a typo in the
third value does not surface an hour into the sweep. At the end `OUT/comparison.html`
(rlhflab.report.write_comparison) overlays the runs' curves and lists their config
differences, and `OUT/sweep.json` holds the table the console prints: per value the
final held-out number with its 95 % interval, its difference from the best value with the
interval of that difference (rlhflab.intervals), final KL, alarms and wall time. A value is
said to beat another only when that interval excludes 0; the runs answer the same validation
prompts but keep only a few answers each, so the difference is unpaired (Newcombe), which is
conservative.

This module runs trainers and writes reports, so it sits above both (layer 6, below cli).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import json
import logging
import math
import re
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rlhflab.config import STAGES, field_names, parse_config
from rlhflab.errors import UserInputError
from rlhflab.eval import RunMonitor
from rlhflab.intervals import Interval, percent, points, rate_interval, unpaired_difference, verdict
from rlhflab.report import is_run_folder, write_comparison, write_report
from rlhflab.report.verdict import prompt_count
from rlhflab.tracking import RUN_MARKERS, default_run_path
from rlhflab.trainers import reward, sft

log = logging.getLogger("rlhflab")

WHERE = "rlhflab sweep"
NOT_VARIED = ("output_dir", "overwrite", "resume")  # where a run goes or starts from, not how it trains
# the stages run by a module of rlhflab.trainers with its own check_config: the online methods (run with their
# alarms and stopping rule, as their commands do) and the pair methods
TRAINER_MODULES = {"ppo": "ppo", "grpo": "grpo", "rloo": "rloo", "reinforce": "reinforce", "dpo": "dpo",
                   "online-dpo": "online_dpo"}


def _saved_policy(s: dict) -> Any:
    """The saved policy's (after keep_best) held-out number by the verifier; the reward's own mean without one."""
    return (s.get("validation_pass_rate") or s.get("validation_reward") or {}).get("end")


# stage -> (label of its held-out number, how to read it from summary.json)
HELD_OUT = {
    **{stage: ("saved val pass rate", _saved_policy) for stage in ("ppo", "grpo", "rloo", "reinforce", "online-dpo")
       if stage in STAGES},
    "dpo": ("final val pass rate", lambda s: (s.get("validation_pass_rate") or {}).get("end")),
    "sft": ("final val pass rate", lambda s: (s.get("validation") or {}).get("val/pass_rate")),
    "rm": ("val pair accuracy", lambda s: ((s.get("pairs") or {}).get("validation") or {}).get("accuracy")),
}
USAGE = f"""rlhflab sweep [--stage STAGE] --vary FIELD=V1,V2[,...] [--config BASE.yaml] [--out DIR] [--FIELD VALUE ...]

STAGE: {', '.join(HELD_OUT)} (default ppo).

Runs the stage once per value of FIELD, everything else held fixed, into DIR/FIELD=VALUE/,
then writes DIR/comparison.html and DIR/sweep.json and prints a table. Flags other than
--stage / --vary / --out are the stage's own (`rlhflab <stage> --help` lists them)."""


@dataclass(frozen=True)
class SweepPlan:
    """What a sweep will run: checked in full before the first run."""

    stage: str
    field: str
    labels: tuple[str, ...]  # each value as typed
    configs: tuple[Any, ...]  # one stage config per value; they differ in `field` and output_dir only
    out: Path


@dataclass
class SweepRun:
    label: str
    run_dir: Path
    summary: dict
    wall_time_s: float
    error: str | None = None
    held_out_n: int | None = None  # prompts (rm: pairs) behind the held-out number; None: unknown or not a rate


def held_out_count(stage: str, summary: dict, cfg: Any) -> int | None:
    """How many validation prompts (rm: pairs) the held-out rate rests on; None for a reward mean or a count unknown."""
    if stage == "rm":
        pairs = ((summary.get("pairs") or {}).get("validation") or {}).get("pairs")
        return pairs if isinstance(pairs, int) else None
    is_rate = "validation_pass_rate" in summary or "val/pass_rate" in (summary.get("validation") or {})
    return prompt_count(dataclasses.asdict(cfg), summary.get("validation_pass_rate")) if is_rate else None


def parse_value(field: str, text: str, kind: Any) -> Any:
    """One `--vary` value as the field's type, or a UserInputError naming it."""
    where = f"--vary {field}"
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        if text not in choices:
            raise UserInputError(f"'{text}' is not a valid {field}", where, f"choose from {', '.join(choices)}")
        return text
    if kind is bool:
        flag = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}.get(text.lower())
        if flag is None:
            raise UserInputError(f"'{text}' is not a boolean", where, "use true or false")
        return flag
    if kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            raise UserInputError(f"'{text}' is not {'an int' if kind is int else 'a number'}", where,
                                 f"{field} takes {kind.__name__} values, e.g. --vary {field}="
                                 f"{'8,16' if kind is int else '0.1,0.2'}") from None
    if kind is str:
        return text
    raise UserInputError(f"{field} cannot be swept (type {kind})", where)


def split_vary(vary: list[str], config_cls: type) -> tuple[str, list[str]]:
    """['cliprange=0.1,0.2'] -> ('cliprange', ['0.1', '0.2']); refuses 0 or 2+ fields and unknown ones."""
    example = "e.g. --vary cliprange=0.1,0.2,0.3"
    if not vary:
        raise UserInputError("nothing to vary", WHERE, f"add --vary FIELD=V1,V2,... ({example})")
    if len(vary) > 1:
        raise UserInputError(f"one field at a time, got --vary {' --vary '.join(vary)}", WHERE,
                             "a one-at-a-time sweep varies one field; run one sweep per field")
    field, sep, values = vary[0].partition("=")
    field = field.strip().lstrip("-").replace("-", "_")
    names = field_names(config_cls)
    if not sep or not field:
        raise UserInputError(f"cannot read --vary {vary[0]!r}", WHERE, f"write FIELD=V1,V2 ({example})")
    if field not in names:
        close = difflib.get_close_matches(field, names, n=1)
        raise UserInputError(f"unknown field '{field}' for this stage", f"--vary {field}",
                             f"did you mean '{close[0]}'?" if close else "`rlhflab <stage> --help` lists the fields")
    if field in NOT_VARIED:
        raise UserInputError(f"{field} cannot be varied", f"--vary {field}", "each run gets DIR/<field>=<value>")
    texts = [v.strip() for v in values.split(",")]
    for text in texts:
        other = text.partition("=")[0].strip()
        if "=" in text and other in names:
            raise UserInputError(f"one field at a time: '{field}' and '{other}' both varied", f"--vary {vary[0]}",
                                 "a one-at-a-time sweep varies one field; run one sweep per field")
    if any(not t for t in texts):
        raise UserInputError(f"empty value in '{values}'", f"--vary {field}", "separate values by single commas")
    return field, texts


def folder_names(field: str, texts: list[str]) -> list[str]:
    """'field=value' per value, made safe for a path; a numbered suffix where two would collide."""
    names = [f"{field}={re.sub(r'[^A-Za-z0-9._+-]', '_', t)}" for t in texts]
    return [f"{n}-{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]


def check_stage_config(stage: str, cfg: Any) -> None:
    """The checks a stage does before loading anything, done for every value up front."""
    if stage in TRAINER_MODULES:
        module = importlib.import_module(f"rlhflab.trainers.{TRAINER_MODULES[stage]}")
        (getattr(module, "check_config", None) or getattr(module, f"check_{TRAINER_MODULES[stage]}_config"))(cfg)
    if hasattr(cfg, "stop_on_alarms"):
        RunMonitor.from_config(cfg)  # a bad stop_on_alarms
    for name in ("max_steps", "batch_size", "num_epochs", "total_episodes"):
        if stage == "dpo" and name == "max_steps":  # 0 = num_epochs decide
            continue
        if isinstance(getattr(cfg, name, None), int) and getattr(cfg, name) < 1:
            raise UserInputError(f"{name} must be >= 1, got {getattr(cfg, name)}", f"--{name}")


def plan_sweep(argv: list[str]) -> SweepPlan:
    """Parse `rlhflab sweep` arguments, parse every value and check every run's config; run nothing."""
    parser = argparse.ArgumentParser(prog=WHERE, usage=USAGE, allow_abbrev=False, add_help=True)
    parser.add_argument("--stage", default="ppo", help=f"stage to sweep: ppo (default), {', '.join(list(HELD_OUT)[1:])}")
    parser.add_argument("--vary", action="append", default=[], help="FIELD=V1,V2,...: the one field to vary")
    parser.add_argument("--out", "--output_dir", dest="out", default="", help="sweep folder; default runs/sweep-...")
    known, rest = parser.parse_known_args(argv)
    if known.stage not in HELD_OUT:
        close = difflib.get_close_matches(known.stage, list(HELD_OUT), n=1)
        raise UserInputError(f"cannot sweep stage '{known.stage}'", "--stage",
                             f"did you mean '{close[0]}'?" if close else f"choose from {', '.join(HELD_OUT)}")
    config_cls = STAGES[known.stage]
    field, texts = split_vary(known.vary, config_cls)
    if any(t == f"--{field}" or t.startswith(f"--{field}=") for t in rest):
        raise UserInputError(f"--{field} is both varied and fixed", WHERE, f"drop --{field} or --vary {field}")
    kind = typing.get_type_hints(config_cls)[field]
    values = [parse_value(field, t, kind) for t in texts]  # every value, before any run
    if len(set(values)) < len(values) or len(values) < 2:
        raise UserInputError(f"need two or more distinct values, got {', '.join(texts)}", f"--vary {field}")
    base = parse_config(config_cls, rest, prog=f"rlhflab {known.stage}")
    out = Path(known.out or base.output_dir or default_run_path(f"sweep-{field}"))
    configs = tuple(dataclasses.replace(base, **{field: v, "output_dir": str(out / name)})
                    for v, name in zip(values, folder_names(field, texts)))
    for cfg in configs:
        check_stage_config(known.stage, cfg)
        held = [m for m in RUN_MARKERS if (Path(cfg.output_dir) / m).exists()]
        if held and not cfg.overwrite and not getattr(cfg, "resume", ""):
            raise UserInputError(f"folder already holds a run ({', '.join(held)})", cfg.output_dir,
                                 "choose another --out, or pass --overwrite to replace the sweep's runs")
    return SweepPlan(known.stage, field, tuple(texts), configs, out)


def train_one(stage: str, cfg: Any):
    """The stage's trainer, as its own command runs it (online methods with their alarms and stopping rule)."""
    if stage in TRAINER_MODULES:
        train = importlib.import_module(f"rlhflab.trainers.{TRAINER_MODULES[stage]}").train
        return train(cfg, monitor=RunMonitor.from_config(cfg)) if hasattr(cfg, "stop_on_alarms") else train(cfg)
    return {"sft": sft.train, "rm": reward.train}[stage](cfg)


def run_sweep(plan: SweepPlan) -> list[SweepRun]:
    """Run every value in turn, then write comparison.html and sweep.json into `plan.out`.

    A run stopped by a non-finite loss (too high a learning rate is a common sweep value)
    is recorded with its error and the sweep goes on; a user mistake stops it.
    """
    plan.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for i, (label, cfg) in enumerate(zip(plan.labels, plan.configs), start=1):
        log.info("sweep %d/%d: %s=%s -> %s", i, len(plan.configs), plan.field, label, cfg.output_dir)
        started, error, summary = time.time(), None, {}
        try:
            summary = train_one(plan.stage, cfg).summary
        except FloatingPointError as err:
            error = str(err)
            log.warning("sweep %s=%s stopped: %s", plan.field, label, err)
        runs.append(SweepRun(label, Path(cfg.output_dir), summary, round(time.time() - started, 1), error,
                             held_out_count(plan.stage, summary, cfg)))
        try:
            if is_run_folder(Path(cfg.output_dir)):
                write_report(cfg.output_dir)
        except Exception as err:  # noqa: BLE001 - the run is written; its page can be rebuilt with `rlhflab report`
            log.warning("report of %s not written (%s: %s)", cfg.output_dir, type(err).__name__, err)
    folders = [r.run_dir for r in runs if is_run_folder(r.run_dir)]
    if len(folders) >= 2:
        write_comparison(folders, plan.out / "comparison.html")
    write_sweep_json(plan, runs)
    return runs


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def held_out_intervals(stage: str, runs: list[SweepRun]) -> tuple[list[Interval | None], list[Interval | None]]:
    """Each run's held-out rate with its 95 % interval, and its difference from the best run's (unpaired)."""
    read_held_out = HELD_OUT[stage][1]
    rates = []
    for run in runs:
        value = _number(read_held_out(run.summary))
        rates.append(rate_interval(value, run.held_out_n) if value is not None and run.held_out_n else None)
    known = [r for r in rates if r is not None]
    best = max(known, key=lambda r: r.estimate) if known else None
    return rates, [unpaired_difference(best, r) if r is not None and best is not None else None for r in rates]


def table_rows(stage: str, runs: list[SweepRun]) -> list[dict[str, Any]]:
    """Per run: the value, final held-out number (with its 95 % interval and its difference from the best run's),
    final KL, alarms fired, wall time (and any error)."""
    read_held_out = HELD_OUT[stage][1]
    rates, versus_best = held_out_intervals(stage, runs)
    rows = []
    for run, rate, diff in zip(runs, rates, versus_best):
        alarms = run.summary.get("alarms")
        rows.append({
            "value": run.label, "held_out": _number(read_held_out(run.summary)),
            "held_out_interval": rate.as_rate() if rate is not None else None,
            "vs_best": {**diff.as_difference(), "verdict": verdict(diff)} if diff is not None else None,
            "final_kl": _number((run.summary.get("final") or {}).get("objective/kl")),
            "alarms": [f"{a.get('name')}@{a.get('step')}" for a in alarms] if isinstance(alarms, list) else None,
            "stopped_at": (run.summary.get("stopped") or {}).get("step"),
            "wall_time_s": run.wall_time_s, "run_dir": str(run.run_dir), "error": run.error,
        })
    return rows


def write_sweep_json(plan: SweepPlan, runs: list[SweepRun]) -> Path:
    """sweep.json: what was varied and the console table, machine-readable."""
    payload = {"stage": plan.stage, "field": plan.field, "values": list(plan.labels),
               "held_out": HELD_OUT[plan.stage][0], "runs": table_rows(plan.stage, runs)}
    target = plan.out / "sweep.json"
    target.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return target


def _cell(value: Any, kind: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return {"pct": f"{value:.1%}", "kl": f"{value:.3g}", "s": f"{value:.1f}"}.get(kind, str(value))


def _held_out_cells(row: dict[str, Any]) -> tuple[str, str]:
    """('62.0% [52.2–70.9]', '-3.0 pts [-16.5, +10.6] within noise') or plain numbers without an interval."""
    rate = row["held_out_interval"]
    if rate is None:
        return _cell(row["held_out"], "pct"), "—"
    diff = row["vs_best"]
    interval = Interval(diff["difference"], diff["low"], diff["high"], diff["n"])
    versus = "best" if diff["difference"] == 0 else f"{points(interval)} {diff['verdict']}"
    return percent(Interval(rate["rate"], rate["low"], rate["high"], rate["n"])), versus


def format_sweep_table(plan: SweepPlan, runs: list[SweepRun]) -> str:
    """The plain-text table the console shows: one line per value, columns aligned, then what is beyond noise."""
    held_label = HELD_OUT[plan.stage][0]
    header = [plan.field, f"{held_label} [95 %]", "vs best [95 %]", "final KL", "alarms fired", "wall time (s)"]
    lines = [header]
    rows = table_rows(plan.stage, runs)
    for row in rows:
        alarms = "—" if row["alarms"] is None else ", ".join(row["alarms"]) or "none"
        if row["stopped_at"] is not None:
            alarms += f" (stopped at {row['stopped_at']})"
        if row["error"]:
            alarms = f"run stopped: {row['error'][:60]}"
        lines.append([row["value"], *_held_out_cells(row), _cell(row["final_kl"], "kl"), alarms,
                      _cell(row["wall_time_s"], "s")])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(c.ljust(w) if i in (0, 4) else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))).rstrip()
            for line in lines]
    return "\n".join([text[0], "  ".join("-" * w for w in widths), *text[1:], noise_line(plan.field, rows)])


def noise_line(field: str, rows: list[dict[str, Any]]) -> str:
    """Which values the best one beats beyond noise: the one rule (a difference's 95 % interval excludes 0)."""
    judged = [r for r in rows if r["vs_best"] is not None]
    if len(judged) < 2:
        return "no 95 % interval: the held-out number is a reward mean, or its prompt count is unknown"
    best = next(r for r in judged if r["vs_best"]["difference"] == 0)
    beaten = [r["value"] for r in judged if r["vs_best"]["verdict"] == "worse"]
    close = [r["value"] for r in judged if r is not best and r["vs_best"]["verdict"] != "worse"]
    n = best["held_out_interval"]["n"]
    said = [f"{field}={best['value']} has the best held-out number"]
    if beaten:
        said.append(f"better beyond noise than {', '.join(beaten)}")
    if close:
        said.append(f"within noise of {', '.join(close)}")
    return "; ".join(said) + f" (95 % intervals over {n} held-out prompts, unpaired: conservative)"
