"""`rlhflab demo`: the embedded default pipeline, end to end on a CPU.

    tiny tokenizer + Llama-style model  ->  SFT on the built-in suite
    ->  PPO with the task checker as reward (verifiable reward)
    ->  reward model on the suite's preference pairs  ->  its diagnosis on the
        SFT policy's own answers  ->  PPO with the reward model as reward
        (the checker only evaluates)
    ->  held-out test pass rate of every model, per family, same decoding, next
        to the reward-model score each one's answers get

The last table is the seeds' lesson on the user's screen: a reward model's
score and the real pass rate can part ways.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path

import torch

from rlhflab import models, rewards, sources
from rlhflab.data.prompt_rows import PromptRow
from rlhflab.config import (
    DemoConfig,
    EvalConfig,
    GenerationFields,
    LoadFields,
    PPOConfig,
    RMConfig,
    RMDiagnoseConfig,
    RunFields,
    SFTConfig,
    SuiteFields,
    field_names,
    read_yaml_config,
    write_config,
)
from rlhflab.eval import RunMonitor, answer_and_check, eval_prompts, table_from_rows
from rlhflab.eval.pass_rate import paired_versus, paired_versus_by_family
from rlhflab.eval.rm_diagnosis import diagnose
from rlhflab.errors import UserInputError, WriteFailed
from rlhflab.tracking import RunDir, RunResult, default_run_path
from rlhflab.trainers import ppo, reward, sft
from rlhflab.demo.beside import StageBeside
from rlhflab.demo.clock import StageClock
from rlhflab.trainers.headroom import headroom_verdict, record_start_headroom
from rlhflab.trainers.setup import configure_threads, resolve_device

log = logging.getLogger(__name__)

# Parts whose values the demo hands to every stage; other fields keep each stage's own defaults
# (SFT's learning rate is no PPO learning rate).
SHARED_PARTS = (RunFields, LoadFields, SuiteFields, GenerationFields)


def shared_fields(demo: DemoConfig, stage_cls: type) -> dict:
    """The demo's values of the shared parts that `stage_cls` has."""
    names = {n for part in SHARED_PARTS for n in field_names(part)} - {"output_dir", "overwrite"}
    names.add("nonfinite")  # the one CheckpointFields value every stage takes from the demo (save_every differs)
    return {n: getattr(demo, n) for n in names & set(field_names(stage_cls))}


def ppo_stage_config(demo: DemoConfig, model_dir: str, out: str, **reward_fields) -> PPOConfig:
    values = {**shared_fields(demo, PPOConfig), "temperature": PPOConfig().temperature}
    values |= {"total_episodes": demo.ppo_total_episodes, "learning_rate": demo.ppo_learning_rate,
               "kl_coef": demo.ppo_kl_coef, "value_mode": demo.ppo_value_mode, "lr_schedule": "constant",
               "headroom_samples": 0}  # the demo probes the SFT model once (probe_sft_model), not once per PPO stage
    if demo.ppo_config:
        values |= read_yaml_config(demo.ppo_config, PPOConfig)
    return PPOConfig(**{**values, **reward_fields, "model": model_dir, "tokenizer": "", "output_dir": out,
                        "overwrite": True})


def rm_stage_config(demo: DemoConfig, model_dir: str, out: str) -> RMConfig:
    values = {**shared_fields(demo, RMConfig), "num_epochs": demo.rm_epochs, "hard_negatives": demo.rm_hard_negatives,
              "pair_prompts": demo.rm_pair_prompts, "learning_rate": demo.rm_learning_rate,
              "center_rewards_coef": demo.rm_center_rewards_coef, "pair_kinds_always": demo.rm_pair_kinds_always,
              "near_misses": demo.rm_near_misses, "batch_size": demo.rm_batch_size,
              "calibration_coef": demo.rm_calibration_coef, "extra_layers": demo.rm_extra_layers,
              "frozen_layers": demo.rm_frozen_layers, "prompt_rows_together": demo.rm_prompt_rows_together}
    if demo.rm_config:
        values |= read_yaml_config(demo.rm_config, RMConfig)
    return RMConfig(**{**values, "model": model_dir, "tokenizer": "", "output_dir": out, "overwrite": True})


def diagnose_stage_config(demo: DemoConfig, rm_dir: str, policy_dir: str, out: str) -> RMDiagnoseConfig:
    values = {**shared_fields(demo, RMDiagnoseConfig), "do_sample": True, "temperature": 1.0,
              "samples_per_prompt": demo.rm_diagnosis_samples}
    return RMDiagnoseConfig(**{**values, "reward_model": rm_dir, "policy": policy_dir, "split": "test",
                               "output_dir": out, "overwrite": True, "progress": False})


def test_answers(run: RunDir, name: str, model_dir, demo: DemoConfig) -> list[dict]:
    """One model's checked answers to the test split, appended to the demo's samples."""
    cfg = EvalConfig(**{**shared_fields(demo, EvalConfig), "model": str(model_dir), "split": "test"})
    model = models.load_causal_lm(cfg.model, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code,
                                  device=resolve_device(cfg.device))
    tokenizer = models.load_tokenizer(cfg.model, trust_remote_code=cfg.trust_remote_code)
    rows = answer_and_check(model, tokenizer, eval_prompts(cfg), rewards.CheckerVerifier(), cfg, progress=False)
    run.add_samples({"stage": name, **row} for row in rows)
    run.log({f"test/pass_rate/{name}": table_from_rows(rows)["overall"]}, step=0)
    return rows


def mean_rm_scores(rm_dir, answers: dict[str, list[dict]], demo: DemoConfig) -> dict[str, float]:
    """Mean raw reward-model score of each model's test answers (the RM's view of each model)."""
    device = resolve_device(demo.device)
    tokenizer = models.load_tokenizer(str(rm_dir), trust_remote_code=demo.trust_remote_code)
    rm = models.load_reward_model(str(rm_dir), dtype=demo.dtype, trust_remote_code=demo.trust_remote_code,
                                  tokenizer=tokenizer).to(device)
    score = rewards.ModelReward(rm, tokenizer)
    means = {}
    with torch.no_grad():
        for name, rows in answers.items():
            prompts = [r["prompt"] for r in rows]
            scored = score(prompts, [r["answer"] for r in rows], [PromptRow(p) for p in prompts])
            means[name] = round(float(scored.scores.mean()), 4)
    return means


def probe_sft_model(cfg: DemoConfig, run: RunDir, sft_dir: str) -> dict | None:
    """The SFT model's headroom (trainers/headroom.py) on the PPO stage's validation prompts, rollout temperature
    and length: RUN/headroom.json, logged now, before RL; the end of the demo reads each family's gain against it."""
    if cfg.headroom_samples <= 0:
        return None
    stage = dataclasses.replace(ppo_stage_config(cfg, sft_dir, str(run.path)), headroom_samples=cfg.headroom_samples)
    tokenizer = models.load_tokenizer(sft_dir, trust_remote_code=cfg.trust_remote_code)
    model = models.load_causal_lm(sft_dir, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code,
                                  device=resolve_device(cfg.device))
    validation = sources.prompt_splits(stage, tokenizer).validation
    return record_start_headroom(model, tokenizer, validation, rewards.CheckerVerifier(), stage, run)


# The split whose numbers chose the demo's reward-model recipe (DemoConfig rm_* defaults): validation pairwise
# accuracy and `rlhflab rm diagnose --split validation`; the test split is read once, for the numbers reported
# (docs/reward-models.md "Training"). Recorded only when the run used that recipe.
RM_RECIPE_CHOSEN_ON = "validation"
RM_RECIPE_FIELDS = ("rm_epochs", "rm_batch_size", "rm_hard_negatives", "rm_pair_prompts", "rm_learning_rate",
                    "rm_center_rewards_coef", "rm_pair_kinds_always", "rm_calibration_coef", "rm_near_misses",
                    "rm_extra_layers", "rm_frozen_layers", "rm_prompt_rows_together")


def recipe_chosen_on(cfg: DemoConfig) -> str | None:
    """The split that chose this run's reward-model recipe, when the run used a chosen recipe unchanged: the demo's
    defaults (validation), or an --rm_config file's `recipe_chosen_on` with no rm_* flag moved from its default
    (a flag the file does not set would change the recipe); unknown otherwise."""
    defaults = DemoConfig()
    if any(getattr(cfg, f) != getattr(defaults, f) for f in RM_RECIPE_FIELDS):
        return None
    if not cfg.rm_config:
        return RM_RECIPE_CHOSEN_ON
    return read_yaml_config(cfg.rm_config, RMConfig).get("recipe_chosen_on") or None


def cores() -> int:
    """CPU cores this process may run on (its affinity, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def side_by_side(cfg: DemoConfig) -> bool:
    """Whether the checker's PPO stage runs in a second process beside the RM's later stages (DemoConfig
    stages_side_by_side): only on a CPU, with every core asked for and at least two of them."""
    return (cfg.stages_side_by_side and cfg.run_ppo and cfg.run_rm and cfg.threads == 0 and cores() >= 2
            and resolve_device(cfg.device).type == "cpu")


def rm_later_stages(cfg: DemoConfig, run: RunDir, sft_dir: str, rm_result: RunResult,
                    clock: StageClock) -> tuple[dict, RunResult]:
    """4-5: the reward model's diagnosis on the SFT policy's answers, PPO with it as the reward."""
    with clock("rm_diagnosis"):
        diagnosis = diagnose(diagnose_stage_config(cfg, str(rm_result.model_dir), sft_dir,
                                                   str(run.path / "rm_diagnosis")))
    ppo_cfg = ppo_stage_config(cfg, sft_dir, str(run.path / "ppo_rm"), reward="model",
                               reward_model=str(rm_result.model_dir), normalize_reward=True)
    with clock("ppo_rm"):
        ppo_rm_result = ppo.train(ppo_cfg, monitor=RunMonitor.from_config(ppo_cfg))
    test = rm_result.summary["pairs"]["test"]
    d = diagnosis.summary["rm_diagnosis"]
    rm_summary = {"recipe_chosen_on": recipe_chosen_on(cfg),
                  "validation_accuracy": rm_result.summary["pairs"]["validation"]["accuracy"],
                  "test_accuracy": test["accuracy"], "margin": test["margin"],
                  "pass_fail_correlation": d["point_biserial"], "roc_auc": d["roc_auc"],
                  "mean_reward_passing": d["mean_reward_passing"], "mean_reward_failing": d["mean_reward_failing"],
                  "normalisation": ppo_rm_result.summary["reward_normalisation"]}
    return rm_summary, ppo_rm_result


def stage_processes(cfg: DemoConfig) -> int:
    """Processes SFT and the reward model train in (DemoConfig.stage_processes): as asked, else 2 on a CPU with
    every core asked for and at least two of them, else 1."""
    if cfg.stage_processes:
        return cfg.stage_processes
    return 2 if cfg.threads == 0 and cores() >= 2 and resolve_device(cfg.device).type == "cpu" else 1


def train_stages(stages: list[tuple[str, object, object]], run: RunDir, clock: StageClock,
                 processes: int) -> list[RunResult]:
    """Each (name, trainer, config) in turn: `trainer.train(config)` here, or with processes > 1 all of them in one
    `torchrun -m rlhflab chain` of one thread per process (demo/beside.py: one start-up, one process group), its
    output in RUN/<first name>.log and its CPU seconds on the clock; as in this process, no report.html of their
    own (the demo's report covers them)."""
    if processes == 1:
        results = []
        for name, trainer, stage_cfg in stages:
            with clock(name):
                results.append(trainer.train(stage_cfg))
        return results
    names = [name for name, _, _ in stages]
    log_path = run.path / f"{names[0]}.log"
    log.info("%s: %d processes (torchrun, DDP, one thread each); log %s", ", then ".join(names), processes, log_path)
    configs = [(name, dataclasses.replace(stage_cfg, threads=1, write_report=False)) for name, _, stage_cfg in stages]
    started, started_cpu = time.time(), time.process_time()
    with StageBeside(*configs[0], log_path, processes, then=tuple(configs[1:])) as child:
        results = child.wait_all()
    wall = time.time() - started
    own = {name: r.summary["wall_time_s"][name] for name, r in zip(names, results)}
    own[names[0]] += max(wall - sum(own.values()), 0.0)  # the launch's start-up goes to the first stage
    waited_cpu = time.process_time() - started_cpu
    for name in names:  # this process's and the child's CPU seconds split as the wall time
        share = own[name] / max(sum(own.values()), 1e-9)
        clock.add(name, own[name], waited_cpu * share)
        clock.add_cpu(name, child.cpu_seconds * share)
    return results


def rl_stages(cfg: DemoConfig, run: RunDir, sft_dir: str, clock: StageClock, rm_result: RunResult | None) -> dict:
    """2-5: PPO with the checker; the reward model's diagnosis -> PPO with the learned reward. Side by side
    (side_by_side), the checker's PPO runs in a second process (the reward model, which needed every core, is
    trained) and the diagnosis and the RM's PPO take one thread here meanwhile."""
    out = {}
    checker_ppo = ppo_stage_config(cfg, sft_dir, str(run.path / "ppo")) if cfg.run_ppo else None
    beside = side_by_side(cfg)
    if checker_ppo is not None and not beside:
        with clock("ppo"):
            out["ppo"] = ppo.train(checker_ppo, monitor=RunMonitor.from_config(checker_ppo))
    if rm_result is None:
        return out
    out["rm"] = rm_result
    child = StageBeside("ppo", dataclasses.replace(checker_ppo, threads=1), run.path / "ppo.log") if beside else None
    with child or contextlib.nullcontext():  # the child is stopped if anything here fails
        try:
            here = dataclasses.replace(cfg, threads=1) if child else cfg
            out["rm_summary"], out["ppo_rm"] = rm_later_stages(here, run, sft_dir, out["rm"], clock)
        finally:
            configure_threads(cfg.threads)  # the stages above may have taken one thread
        if child:
            with clock("ppo"):  # the part of the second process's run not hidden behind steps 4-5
                out["ppo"] = child.wait()
            clock.add_cpu("ppo", child.cpu_seconds)
    return out


def saved_trunk_can_grow(cfg: DemoConfig) -> bool:
    """models.can_grow_saved_trunk for the demo's --model, a config that cannot be read named as such."""
    try:
        return models.can_grow_saved_trunk(cfg.model, cfg.trust_remote_code)
    except (OSError, ValueError) as err:
        raise UserInputError(f"cannot read the configuration of {cfg.model}: {err}", "--model",
                             "pass a model folder (config.json inside) or a hub id") from err


def check_later_stages(cfg: DemoConfig) -> None:
    """Build the PPO and RM stage configs and the monitor now, so a bad YAML or field fails before SFT runs."""
    if cfg.stage_processes < 0:
        raise UserInputError(f"stage_processes must be >= 0, not {cfg.stage_processes}", "--stage_processes",
                             "use 0 (2 on a CPU with >= 2 cores), 1 (this process) or the number of processes")
    placeholder = str(Path(cfg.output_dir or ".") / "sft" / "model")
    for reward_fields in ({}, {"reward": "model", "reward_model": placeholder, "normalize_reward": True}):
        ppo_cfg = ppo_stage_config(cfg, placeholder, placeholder, **reward_fields)
        try:
            ppo.check_config(ppo_cfg)
        except UserInputError as err:  # name the demo's own ways to set PPO fields
            raise UserInputError(err.what, f"demo PPO stage, {err.where}",
                                 f"{err.fix}; the demo sets PPO fields through --ppo_total_episodes, "
                                 "--ppo_learning_rate, --ppo_kl_coef or a YAML of PPO fields (--ppo_config)") from err
        RunMonitor.from_config(ppo_cfg)
    if cfg.run_rm:
        rm = rm_stage_config(cfg, placeholder, placeholder)  # the effective fields, --rm_config included
        if rm.calibration_coef and not rm.hard_negatives:
            raise UserInputError("the reward model's calibration term reads the SFT policy's sampled answers, but it "
                                 "samples none (hard_negatives 0)", "--rm_calibration_coef / --rm_hard_negatives",
                                 "keep --rm_hard_negatives >= 1, or set --rm_calibration_coef 0 (or those fields in "
                                 "--rm_config)")
        grows = rm.extra_layers > 0 or rm.frozen_layers > 0
        if cfg.model and grows and not saved_trunk_can_grow(cfg):
            raise UserInputError(f"the reward model grows or freezes decoder layers (extra {rm.extra_layers}, frozen "
                                 f"{rm.frozen_layers}), but {cfg.model} has none of the layouts that can (Llama, "
                                 "Qwen2, GPT-NeoX, GPT-2)", "--rm_extra_layers / --rm_frozen_layers (or --rm_config)",
                                 "use --rm_extra_layers 0 --rm_frozen_layers 0, or --rm_config "
                                 "configs/rm_shallow.yaml (the trunk as it is)")
        depth = None if cfg.model else cfg.num_layers  # the tiny model's; a given model's is checked once loaded
        too_many = depth is not None and rm.frozen_layers > depth + rm.extra_layers
        if rm.extra_layers < 0 or rm.frozen_layers < 0 or too_many:
            raise UserInputError(f"the reward model cannot grow {rm.extra_layers} layers and freeze "
                                 f"{rm.frozen_layers} of a {depth or 'given'}-layer SFT trunk",
                                 "--rm_extra_layers / --rm_frozen_layers (or --rm_config)",
                                 "use values >= 0, with frozen layers at most the trunk's layers")
        if rm.prompt_rows_together < 0:
            raise UserInputError(f"prompt_rows_together must be >= 0, not {rm.prompt_rows_together}",
                                 "--rm_prompt_rows_together (or --rm_config)", "use 3 (the demo's) or 0 (off)")
        if cfg.rm_diagnosis_samples < 1:
            raise UserInputError(f"rm_diagnosis_samples must be >= 1, not {cfg.rm_diagnosis_samples}",
                                 "--rm_diagnosis_samples", "use 8 (2,400 answers on the default test split)")


STAGE_FOLDERS = {"sft": "sft", "rm": "rm", "ppo": "ppo", "ppo_rm": "ppo"}  # RUN/<folder>: its stage's command


def run_demo(cfg: DemoConfig) -> RunResult:
    """The demo; a full disk in one of its stages names the command that resumes that stage's folder (the demo
    itself does not resume)."""
    try:
        return demo_stages(cfg)
    except WriteFailed as err:
        if err.stage is None and err.run is not None and (err.run / "checkpoints").is_dir():
            err.stage = STAGE_FOLDERS.get(err.run.name)
        raise


def demo_stages(cfg: DemoConfig) -> RunResult:
    clock = StageClock()  # before the demo's own clock starts: its speed probe is no part of the demo
    started, started_cpu = time.time(), time.process_time()
    if cfg.resume:
        raise UserInputError("the demo cannot resume as a whole", "--resume",
                             "resume the stage that stopped: rlhflab sft|rm|ppo --resume latest --output_dir RUN/<stage>")
    with clock("setup"):
        check_later_stages(cfg)
        run = RunDir(cfg.output_dir or default_run_path("demo"), overwrite=cfg.overwrite, report_to=cfg.report_to)
        write_config(cfg, run.path / "config.yaml")
        run.write_versions(cfg.seed)
    answers, runs, finals = {}, {}, {}

    # 1. SFT from scratch: builds the tokenizer and tiny model, trains, saves run/sft/model; then (3) the reward
    # model on the suite's pairs, from that model: in several processes, both in one launch
    sft_values = {n: getattr(cfg, n) for n in field_names(SFTConfig)}
    sft_cfg = SFTConfig(**{**sft_values, "output_dir": str(run.path / "sft"), "overwrite": True})
    stages = [("sft", sft, sft_cfg)]
    if cfg.run_rm:
        stages.append(("rm", reward, rm_stage_config(cfg, str(run.path / "sft" / "model"), str(run.path / "rm"))))
    trained = train_stages(stages, run, clock, stage_processes(cfg))
    sft_result, rm_result = trained[0], (trained[1] if cfg.run_rm else None)
    sft_dir, runs["sft"] = str(sft_result.model_dir), str(sft_result.run_dir)
    with clock("test_eval"):
        answers["sft"] = test_answers(run, "sft", sft_dir, cfg)
    with clock("headroom"):
        headroom = probe_sft_model(cfg, run, sft_dir)

    # 2, 4-5. PPO with the checker; the reward model's diagnosis -> PPO with the learned reward
    rl = rl_stages(cfg, run, sft_dir, clock, rm_result)
    rm_summary, rm_scores = rl.get("rm_summary", {}), {}
    for name in ("ppo", "ppo_rm"):
        if name in rl:
            runs[name], finals[name] = str(rl[name].run_dir), rl[name].summary["final"]
            with clock("test_eval"):
                answers[name] = test_answers(run, name, rl[name].model_dir, cfg)
    if "rm" in rl:
        runs |= {"rm": str(rl["rm"].run_dir), "rm_diagnosis": str(run.path / "rm_diagnosis")}
        with clock("test_eval"):  # 6. the reward model's view of every model's test answers, beside their pass rates
            rm_scores = mean_rm_scores(rl["rm"].model_dir, answers, cfg)

    tables = {name: table_from_rows(rows) for name, rows in answers.items()}
    verdict = [line for name, changes in paired_versus_by_family(answers, "sft").items()  # each RL stage vs SFT
               for line in headroom_verdict(headroom, changes, name)] if headroom else []
    summary = run.update_summary(
        stage="demo",
        test_pass_rate={name: t["overall"] for name, t in tables.items()},
        test_rm_score=rm_scores,
        test_tables=tables,
        test_vs_sft=paired_versus(answers, "sft"),  # each RL model's gain, paired over the test prompts
        rm=rm_summary,
        headroom_verdict=verdict,
        kl_to_reference={name: f["objective/kl"] for name, f in finals.items()},
        decoding="sampled" if cfg.do_sample else "greedy",
        sft_validation=sft_result.summary.get("validation"),
        parameters=sft_result.summary.get("parameters"),
        **clock.summary(time.time() - started, time.process_time() - started_cpu),
        side_by_side={"ppo": rl["ppo"].summary["wall_time_s"]["total"]} if side_by_side(cfg) else {},
        stage_processes=stage_processes(cfg),
        runs=runs,
    )
    run.close()
    return RunResult(run.path, summary, sft_result.model_dir)
