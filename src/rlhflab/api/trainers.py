"""Trainer objects for scripts and notebooks, in TRL's shape: `GRPOTrainer(model, args, train_dataset,
reward_funcs=[...]).train()`.

Each one checks what it was given (the config's field types, the reward functions' signatures, the peft
settings), writes what it holds in memory into RUN/inputs/ (rlhflab/api/inputs.py), and runs the stage through
`run_stage`, the same call the command line makes: one path, not two. `train()` returns the `RunResult`
(`.run_dir`, `.summary`, `.model_dir`); the object passed as `model` is not changed (the trained weights are the
HF folder `result.model_dir`, as `from_pretrained` loads them).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from rlhflab.api.inputs import (check_config, check_function, lora_fields, reward_functions, write_dataset,
                                write_model)
from rlhflab.callbacks import Callback
from rlhflab.checkpoint.ownership import releasing_locks
from rlhflab.checkpoint.resume import resume_target
from rlhflab.config import (STAGES, DPOConfig, GRPOConfig, OnlineDPOConfig, PPOConfig, REINFORCEConfig, RLOOConfig,
                            RMConfig, SFTConfig)
from rlhflab.errors import UserInputError, WriteFailed
from rlhflab.tracking import RunResult, check_folder_free, default_run_path
from rlhflab.trainers.given import NOTHING, Given

# training stage -> its module in rlhflab.trainers
STAGE_MODULES = {"sft": "sft", "rm": "reward", "dpo": "dpo", "ppo": "ppo", "grpo": "grpo", "rloo": "rloo",
                 "reinforce": "reinforce", "online-dpo": "online_dpo"}
ONLINE_STAGES = ("ppo", "grpo", "rloo", "reinforce", "online-dpo")


def run_stage(stage: str, cfg, given: Given = NOTHING) -> RunResult:
    """Run one training stage on `cfg` (what `rlhflab STAGE` does after parsing its flags); the run folder's lock
    is released however the stage ends, and a failure says where a run it was replacing is kept."""
    with releasing_locks():
        return _run_stage(stage, cfg, given)


def _run_stage(stage: str, cfg, given: Given = NOTHING) -> RunResult:
    """Run one training stage on `cfg` (what `rlhflab STAGE` does after parsing its flags): sft, rm, dpo, or an
    online stage with its alarms and stopping rule (`RunMonitor.from_config`)."""
    import importlib

    if stage not in STAGE_MODULES:
        raise UserInputError(f"no training stage {stage!r}", "run_stage", f"one of {', '.join(STAGE_MODULES)}")
    if not isinstance(cfg, STAGES[stage]):
        raise UserInputError(f"stage {stage} takes a {STAGES[stage].__name__}, not a {type(cfg).__name__}",
                             "run_stage", f"pass {STAGES[stage].__name__}(...)")
    module = importlib.import_module(f"rlhflab.trainers.{STAGE_MODULES[stage]}")
    try:
        if stage in ONLINE_STAGES:
            from rlhflab.eval import RunMonitor

            return module.train(cfg, monitor=RunMonitor.from_config(cfg, given), given=given)
        return module.train(cfg, given=given)
    except WriteFailed as err:  # a full disk: its message names the command that resumes this stage
        err.stage = err.stage or stage
        raise


class Trainer:
    """What every stage's trainer takes: a model (hub id, folder, or a loaded `PreTrainedModel`), its config
    (`args`; the stage's defaults when None), data (a `datasets.Dataset`, a list of dicts, or a file / dataset
    name; None = the config's `train_file` / `validation_file`, or the built-in suite), a tokenizer
    (`processing_class`; the model's own when None), a peft `LoraConfig` and callbacks (rlhflab.Callback)."""

    stage = ""
    config_class: type = object
    data_kind = "prompts"  # what its rows are (rlhflab.data.validate): sft, pairs or prompts

    def __init__(self, model: Any = None, args: Any = None, train_dataset: Any = None, eval_dataset: Any = None,
                 processing_class: Any = None, peft_config: Any = None, callbacks: list[Callback] | None = None):
        name = type(self).__name__
        self.args = self.config_class() if args is None else args
        check_config(self.args, self.config_class, name)
        self.model, self.processing_class = model, processing_class
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.lora = lora_fields(peft_config, self.config_class)
        self.callbacks = list(callbacks or [])
        bad = [c for c in self.callbacks if not isinstance(c, Callback)]
        if bad:
            raise UserInputError(f"callbacks holds a {type(bad[0]).__name__}", f"{name} callbacks",
                                 "subclass rlhflab.Callback and override on_log / on_evaluate / on_train_end")
        self.result: RunResult | None = None

    def given(self) -> Given:
        return Given(callbacks=tuple(self.callbacks))

    def config(self):
        """The stage's config with what was handed in memory written into RUN/inputs/ and named there."""
        args = self.args
        if args.resume:  # the folder of the run resumed, which holds its inputs already
            run = resume_target(args)[0]
        else:  # a run already there is refused before anything of this one is written into it
            run = Path(args.output_dir or default_run_path(self.stage))
            check_folder_free(run, args.overwrite)
        inputs = run / "inputs"
        changes: dict[str, Any] = {"output_dir": str(run), **self.lora}
        if self.model is not None or self.processing_class is not None:
            if several_processes() and not isinstance(self.model, (str, Path)):
                raise UserInputError("a model object under several processes", "model",
                                     "save it (model.save_pretrained(DIR)) and pass DIR: every process loads it")
            changes["model"], tokenizer = write_model(self.model if self.model is not None else args.model,
                                                      self.processing_class, inputs, "model")
            if tokenizer:
                changes["tokenizer"] = tokenizer
        resumed = dict(kind=self.data_kind, resumed=bool(args.resume), allow_change=args.allow_config_change)
        if self.train_dataset is not None:
            changes["train_file"] = write_dataset(self.train_dataset, inputs / "train", "train_dataset", **resumed)
        if self.eval_dataset is not None:
            changes["validation_file"] = write_dataset(self.eval_dataset, inputs / "validation", "eval_dataset",
                                                       **resumed)
        return dataclasses.replace(args, **changes, **self.extra_fields(inputs))

    def extra_fields(self, inputs: Path) -> dict[str, Any]:
        """Fields a stage fills from its own arguments (reference, reward model, reward function specs)."""
        return {}

    def train(self) -> RunResult:
        """Run the stage; the result's `.summary` holds the run's figures, `.run_dir` its folder."""
        self.result = run_stage(self.stage, self.config(), self.given())
        return self.result


def given_verifier(verifier: Any, args: Any):
    """A verifier function handed in memory, checked; refused beside the config's own --verifier."""
    if verifier is None:
        return None
    if args.verifier.strip():
        raise UserInputError(f"a verifier both in verifier= and in args.verifier ({args.verifier!r})", "verifier",
                             "name it in one place")
    return check_function(verifier, "verifier")


def several_processes() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


class SFTTrainer(Trainer):
    """Supervised fine-tuning on prompt / completion (or messages, or text) rows."""

    stage, config_class, data_kind = "sft", SFTConfig, "sft"


class RewardTrainer(Trainer):
    """A scalar reward model on (prompt, chosen, rejected) pairs with Bradley-Terry."""

    stage, config_class, data_kind = "rm", RMConfig, "pairs"


class DPOTrainer(Trainer):
    """DPO / IPO / SimPO on preference pairs; `ref_model` (id, folder or model object): the reference, the
    policy's starting weights when None. `verifier` (TRL's reward-function signature, returning bools) gives
    the validation pass rate."""

    stage, config_class, data_kind = "dpo", DPOConfig, "pairs"

    def __init__(self, model: Any = None, ref_model: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, peft_config: Any = None,
                 callbacks: list[Callback] | None = None, verifier: Any = None):
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, peft_config, callbacks)
        self.ref_model = ref_model
        self.verifier = given_verifier(verifier, self.args)

    def given(self) -> Given:
        return Given(verifier=self.verifier, callbacks=tuple(self.callbacks))

    def extra_fields(self, inputs: Path) -> dict[str, Any]:
        if self.ref_model is None:
            return {}
        return {"reference": write_model(self.ref_model, self.processing_class, inputs / "reference", "ref_model")[0]}


class OnlineTrainer(Trainer):
    """An online stage: `reward_funcs` (TRL's: one function or a list, each fn(prompts, completions, **kwargs)
    -> list of floats; or "FILE.py:NAME" specs) with `reward_weights`, and / or `reward_model` (id, folder or a
    loaded sequence classifier, with `reward_processing_class` its tokenizer); `verifier` (the same signature,
    returning bools) is what validation, alarms, stopping and keep_best read."""

    def __init__(self, model: Any = None, reward_funcs: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, peft_config: Any = None,
                 callbacks: list[Callback] | None = None, verifier: Any = None, reward_weights: list[float] | None = None,
                 reward_model: Any = None, reward_processing_class: Any = None):
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, peft_config, callbacks)
        self.specs, self.functions = reward_functions(reward_funcs, reward_weights)
        if self.specs and (self.args.reward_fn or self.args.reward_weights):
            raise UserInputError("reward function specs both in reward_funcs and in args.reward_fn", "reward_funcs",
                                 "name them in one place")
        self.verifier = given_verifier(verifier, self.args)
        self.reward_model, self.reward_processing_class = reward_model, reward_processing_class

    def given(self) -> Given:
        return Given(reward_functions=tuple(self.functions), verifier=self.verifier, callbacks=tuple(self.callbacks))

    def extra_fields(self, inputs: Path) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if self.specs:
            fields["reward_fn"] = ",".join(spec for spec, _ in self.specs)
            fields["reward_weights"] = ",".join(repr(weight) for _, weight in self.specs)
        if self.reward_model is not None:
            fields["reward_model"] = write_reward_model(self.reward_model, self.reward_processing_class,
                                                        inputs / "reward_model")
        return fields


def write_reward_model(model: Any, tokenizer: Any, folder: Path) -> str:
    """A reward model as the config names it: an id / folder as is, a model object (with its tokenizer) saved."""
    if isinstance(model, (str, Path)):
        if tokenizer is not None:
            raise UserInputError("reward_processing_class beside a reward model folder", "reward_processing_class",
                                 "a reward model folder holds its tokenizer: leave reward_processing_class out")
        return str(model)
    if tokenizer is None or isinstance(tokenizer, (str, Path)):
        raise UserInputError("a reward model object without its tokenizer", "reward_processing_class",
                             "pass reward_processing_class=the reward model's tokenizer")
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save_pretrained(str(folder))
    return str(folder)


class PPOTrainer(OnlineTrainer):
    """PPO with policy, reference, reward and value (rlhflab ppo)."""

    stage, config_class = "ppo", PPOConfig


class GRPOTrainer(OnlineTrainer):
    """GRPO: k answers per prompt, group-normalised advantages, no critic (rlhflab grpo)."""

    stage, config_class = "grpo", GRPOConfig


class RLOOTrainer(OnlineTrainer):
    """RLOO: k answers per prompt, leave-one-out baseline (rlhflab rloo)."""

    stage, config_class = "rloo", RLOOConfig


class ReinforceTrainer(OnlineTrainer):
    """REINFORCE with a baseline (rlhflab reinforce)."""

    stage, config_class = "reinforce", REINFORCEConfig


class OnlineDPOTrainer(OnlineTrainer):
    """On-policy DPO: k answers per prompt ranked by the reward, best vs worst (rlhflab online-dpo)."""

    stage, config_class = "online-dpo", OnlineDPOConfig
