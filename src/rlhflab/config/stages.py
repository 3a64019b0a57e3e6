"""One config per offline stage (sft, eval, rm, dpo, demo, compare, report ...) and the table of every stage."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Literal

from rlhflab.config.fields import (CheckpointFields, DataFields, GenerationBackendFields, GenerationFields, LoadFields,
                                   LoraFields, ModelFields, OptimFields, ParallelFields, PrecisionFields,
                                   PromptFileFields, RewardCallFields, RewardFunctionFields, RunFields, SuiteFields,
                                   TinyModelFields, arg)
from rlhflab.config.online import (GRPOConfig, OnlineDPOConfig, PPOConfig, REINFORCEConfig, RLOOConfig)

# `rlhflab compare --methods`: the trainers it can run, in the order they are reported
COMPARE_METHODS = ("ppo", "grpo", "rloo", "reinforce", "dpo", "online-dpo")
# variants, not in the default --methods: the online methods with --async_generation (max_staleness 1 unless a
# section says otherwise), what overlapping generation with training buys in time and costs in learning; and the
# group-relative ones with --dynamic_sampling or --filter_prompts pass_rate, what each control buys against its
# generation cost; GRPO and RLOO with adaptive entropy control (--use_adaptive_entropy)
COMPARE_VARIANTS = (*(f"{m}-async" for m in COMPARE_METHODS if m != "dpo"),
                    *(f"{m}+{control}" for control in ("dynamic", "filter") for m in ("grpo", "rloo", "online-dpo")),
                    "grpo+entropy", "rloo+entropy")


# --- stage configs ------------------------------------------------------------------


@dataclass(frozen=True)
class SFTConfig(ParallelFields, CheckpointFields, RunFields, ModelFields, TinyModelFields, SuiteFields, DataFields,
                OptimFields, PrecisionFields, LoraFields, GenerationFields):
    """`rlhflab sft`: supervised fine-tuning on prompt/completion demonstrations."""

    max_steps: int = arg(1000, "optimiser steps (the tiny model learns to copy unseen words only after ~600)")
    batch_size: int = arg(64, "sequences per optimiser step (split over gradient_accumulation_steps)")
    gradient_accumulation_steps: int = arg(
        2, "micro-batches per optimiser step, cut from the step's packed rows (or its sequences sorted by length), "
           "same gradient")
    packing: bool = arg(True, "several sequences per row, each with its own positions and attention: the padded "
                              "batch's loss and gradient without running its padding (Llama / Qwen2 layouts; "
                              "others are padded)")
    eval_every: int = arg(250, "validation loss and pass rate every N steps; 0 = only at the end")
    eval_prompts: int = arg(100, "validation prompts used for the periodic pass rate")
    group_by_length: int = arg(0, "sort runs of this many batches by length before cutting them (less padding); 0 = off")
    save_every: int = arg(250, "write RUN/checkpoints/step-N every N steps and at the end; 0 = only at the end; "
                               "-1 = none (only on SIGINT / SIGTERM)")


@dataclass(frozen=True)
class EvalConfig(RunFields, ModelFields, SuiteFields, GenerationBackendFields, GenerationFields, RewardCallFields):
    """`rlhflab eval`: generate answers to a split's prompts and check them."""

    split: Literal["train", "validation", "test"] = arg("test", "which split of the built-in suite")
    prompts_file: str = arg("", "your prompts (JSONL, Parquet, save_to_disk folder or datasets name; prompt-only rows, "
                                "other columns go to the verifier); empty = the built-in suite's split")
    verifier: str = arg("", "pass / fail function FILE.py:NAME or package.module:NAME, called as fn(prompts, "
                            "completions, **columns) -> list of bool; empty = the suite's checker (needs 'family' and "
                            "'reference' columns in a prompts file)")
    samples_per_prompt: int = arg(
        1, "headroom probe: answers sampled per prompt at --temperature from the full softmax (as rollouts); > 1 "
           "adds per-family greedy pass@1, sampled pass@1 and pass@k on --headroom_split to summary.json and "
           "headroom.json; 1 = off")
    headroom_split: Literal["train", "validation", "test"] = arg(
        "validation", "split the headroom probe reads (validation: the test split is read once, for reported "
                      "numbers); --prompts_file: its rows")
    headroom_prompts: int = arg(0, "headroom probe: the first N prompts of its split; 0 = all")


@dataclass(frozen=True)
class TasksExportConfig(RunFields, SuiteFields):
    """`rlhflab tasks export`: write the built-in suite as JSONL in TRL's columns."""

    pair_kinds: str = arg("", "comma-separated violation kinds for rejected answers; empty = all")
    pairs_per_prompt: int = arg(3, "rejected answers (pairs) per prompt")




@dataclass(frozen=True)
class RMConfig(ParallelFields, CheckpointFields, RunFields, ModelFields, SuiteFields, DataFields, OptimFields,
               PrecisionFields):
    """`rlhflab rm`: a scalar reward model trained on preference pairs with Bradley-Terry."""

    pair_kinds: str = arg("", "built-in suite: violation kinds of the rejected answers (comma-separated); empty = all")
    pairs_per_prompt: int = arg(3, "built-in suite: rejected answers per prompt")
    pair_kinds_always: str = arg(
        "", "built-in suite: kinds every prompt's pairs include when its family has them, after the dominant kind "
            "(e.g. wrong_content, the errors reward models find hardest); empty = random")
    near_misses: int = arg(
        0, "built-in suite: extra rejected answers per train prompt that are the reference with one letter of a "
           "copied word changed (the copying slips small policies make); 0 = off")
    pair_prompts: int = arg(0, "built-in suite: train pairs on this many fresh train-pool prompts; 0 = the fixed train split")
    hard_negatives: int = arg(
        0, "built-in suite: answers sampled per prompt from --model (the policy); each failing one becomes a "
           "rejected answer against the reference, so the RM learns the policy's own mistakes; 0 = off")
    num_epochs: int = arg(1, "passes over the training pairs (reward models overfit fast)")
    batch_size: int = arg(32, "pairs per optimiser step")
    length_chunks: int = arg(0, "where sequences are scored one by one (no shared_prefix): forward passes per step "
                                "over this process's pairs sorted by length (less padding, same gradient); 0 = one per "
                                "16 pairs; 1 = one pass")
    shared_prefix: bool = arg(True, "score each prompt's distinct sequences in a batch together, the prompt run once "
                                    "(Llama / Qwen2 layouts; the same scores, fewer tokens)")
    prompt_rows_together: int = arg(0, "keep up to this many of a prompt's pairs side by side in the shuffled order, so "
                                       "that the grouped scorer (shared_prefix) runs the prompt once for them; rows "
                                       "of the policy's own sampled answers (hard_negatives, calibration) stay "
                                       "shuffled one by one; 0 = every row shuffled on its own (docs/reward-models.md: on the demo, 3 "
                                       "kept validation correlation and saved ~20 percent of the reward model's time)")
    margin: float = arg(0.0, "Bradley-Terry margin: -log sigmoid(r_c - r_r - margin)")
    average_weights: float = arg(0.0, "save the mean of the weights over this last fraction of the steps "
                                      "(stochastic weight averaging); 0 = the last step's weights")
    center_rewards_coef: float = arg(0.0, "reward-centring penalty coef * (r_c + r_r)^2 (Eisenstein et al. 2023)")
    pass_fail_coef: float = arg(0.0, "coef * binary cross-entropy of each score as the logit of 'acceptable' (chosen "
                                     "1, rejected 0): one threshold across prompts and families; only where every "
                                     "chosen answer is acceptable and every rejected one is not (the suite's pairs)")
    calibration_coef: float = arg(
        0.0, "built-in suite, with hard_negatives: coef * binary cross-entropy of the policy's sampled answers' scores "
             "(passing and failing, as sampled) against the checker's verdict, so scores follow how often answers "
             "like them pass; 0 = off")
    extra_layers: int = arg(
        0, "decoder layers appended to the backbone's trunk, each starting as the identity (a copy of the last layer "
           "with its residual outputs zeroed): a reward model deeper than the policy it judges (Llama, Qwen2, "
           "GPT-NeoX and GPT-2 layouts); 0 = the backbone as it is")
    frozen_layers: int = arg(0, "the backbone's embeddings (tokens, and positions where it learns them) and first N "
                                "decoder layers stay as they are (no gradient: the backward pass stops above them); "
                                "0 = every weight trains")
    learning_rate: float = arg(3e-4, "peak AdamW learning rate")
    warmup_steps: int = arg(5, "linear warmup steps")
    lr_schedule: Literal["cosine", "linear", "constant"] = arg("linear", "decay after warmup")
    recipe_chosen_on: Literal["", "train", "validation", "test"] = arg(
        "", "the split whose numbers chose this recipe, as a recipe file states it; the demo records it in "
            "summary.json when its run used that recipe unchanged; training does not read it")
    save_every: int = arg(50, "write RUN/checkpoints/step-N every N steps and at the end; 0 = only at the end; "
                              "-1 = none (only on SIGINT / SIGTERM)")  # as DPO: a step is about as much work


@dataclass(frozen=True)
class RMDiagnoseConfig(RunFields, LoadFields, SuiteFields, GenerationFields, RewardCallFields):
    """`rlhflab rm diagnose`: score the policy's own answers and compare with the checker."""

    reward_model: str = arg("", "reward model folder (sequence classifier with one output)")
    policy: str = arg("", "policy whose answers are scored, e.g. the SFT model")
    split: Literal["train", "validation", "test"] = arg("test", "which split of the built-in suite")
    prompts_file: str = arg("", "your prompts (same formats as eval --prompts_file); empty = the built-in suite's split")
    verifier: str = arg("", "pass / fail function FILE.py:NAME that says which answers are right; empty = the suite's "
                            "checker")
    samples_per_prompt: int = arg(2, "answers generated per prompt")
    worst_cases: int = arg(10, "failing answers with the highest reward (and passing with the lowest) to list")
    do_sample: bool = arg(True, "sample answers (a mix of passing and failing) rather than greedy")


@dataclass(frozen=True)
class DemoConfig(SFTConfig):
    """`rlhflab demo`: tiny model -> SFT -> PPO (checker) | RM -> diagnosis -> PPO (RM) -> held-out evaluation.

    Fields without a prefix configure the SFT stage (and the suite, decoding and run);
    the PPO stages take PPOConfig's defaults, the `ppo_*` fields below and `ppo_config`;
    the reward model takes RMConfig's defaults where the `rm_*` fields below leave them (those are the demo's
    own recipe, not RMConfig's), then `rm_config`.
    """

    gradient_accumulation_steps: int = arg(1, "SFT: micro-batches per optimiser step (the demo's packed rows of 64 "
                                              "demonstrations fit at once: one micro-batch, ~4 percent faster a step, "
                                              "the same gradient)")
    run_ppo: bool = arg(True, "run the PPO stage with the task checker as reward")
    run_rm: bool = arg(True, "train a reward model on the suite's pairs, diagnose it, and run PPO with it as reward")
    ppo_config: str = arg("", "YAML of PPOConfig fields for the demo's PPO stages (e.g. configs/ppo_tiny.yaml)")
    ppo_total_episodes: int = arg(1920, "PPO stages: responses generated (30 updates of 64; in the demo's runs of "
                                        "seeds 0-2 the validation pass rate of both PPO stages peaked by update 30, "
                                        "and keep_best restores the peak)")
    ppo_learning_rate: float = arg(1e-4, "PPO stages: learning rate")
    ppo_kl_coef: float = arg(0.05, "PPO stages: KL penalty coefficient beta")
    ppo_value_mode: Literal["shared", "separate", "lora_adapter"] = arg(
        "separate", "PPO stages: the critic (PPOConfig.value_mode). A separate value model (SFT trunk, zero head) "
                    "explained 0.26-0.60 of the returns' variance at the end of the demo's runs, the head on the "
                    "policy's trunk 0.14-0.39, at the same validation gain and ~15 percent more time")
    stages_side_by_side: bool = arg(True, "on a CPU with >= 2 cores and threads 0 (all), run the checker's PPO stage "
                                          "in a second process (RUN/ppo.yaml, RUN/ppo.log) beside the RM diagnosis "
                                          "and the RM's PPO stage, one thread each (a demo-size PPO stage keeps about "
                                          "one core busy whatever its threads; measured on 2 cores)")
    stage_processes: int = arg(0, "processes SFT and the reward model train in (torchrun -m rlhflab chain sft then "
                                  "rm: one launch, DDP, one thread each; RUN/sft.log); 0 = 2 on a CPU with >= 2 cores "
                                  "at threads 0 "
                                  "(an SFT step of the demo model: 107 ms against 186 at two threads in one process), "
                                  "else 1 (in this process)")
    rm_config: str = arg("", "YAML of RMConfig fields for the demo's reward model, over the rm_* fields (e.g. "
                             "configs/rm_shallow.yaml)")
    rm_epochs: int = arg(1, "reward model: passes over the pairs (the demo's recipe: one pass over many fresh "
                            "prompts' pairs; configs/rm_shallow.yaml is the faster 3 passes over 2,400)")
    rm_batch_size: int = arg(64, "reward model: pairs per optimiser step")
    rm_hard_negatives: int = arg(2, "reward model: SFT answers sampled per prompt; the failing ones become rejected "
                                    "answers, all of them calibration rows")
    rm_pair_prompts: int = arg(9600, "reward model: fresh train-pool prompts the pairs are built on")
    rm_learning_rate: float = arg(6e-4, "reward model: learning rate")
    rm_center_rewards_coef: float = arg(0.01, "reward model: reward-centring coefficient (keeps families on one scale)")
    rm_pair_kinds_always: str = arg("wrong_content,reordered_items",
                                    "reward model: kinds every prompt's training pairs include where its family has "
                                    "them (content and order errors are the ones it finds hardest)")
    rm_calibration_coef: float = arg(3.0, "reward model: weight of the calibration term on the SFT policy's own sampled "
                                          "answers (RMConfig.calibration_coef); 0 = off")
    rm_near_misses: int = arg(0, "reward model: near-miss rejected answers per train prompt (one copied letter changed)")
    rm_extra_layers: int = arg(2, "reward model: decoder layers added on top of the SFT trunk, each starting as the "
                                  "identity (RMConfig.extra_layers): depth for checks the policy cannot make")
    rm_frozen_layers: int = arg(0, "reward model: the SFT trunk's embeddings and first N layers kept frozen "
                                   "(RMConfig.frozen_layers)")
    rm_prompt_rows_together: int = arg(3, "reward model: a prompt's hand-made pairs kept side by side in the shuffled "
                                          "order, up to this many, so its prompt runs once for them "
                                          "(RMConfig.prompt_rows_together); 0 = every row shuffled on its own")
    rm_diagnosis_samples: int = arg(8, "reward-model diagnosis: answers sampled per test prompt (8 x the default 300 "
                                       "test prompts = 2400 answers)")
    headroom_samples: int = arg(8, "headroom probe of the SFT model before RL: answers sampled per validation prompt "
                                   "(the PPO stage's prompts and temperature); 0 = off")
    compare: bool = arg(False, "after the demo, compare every available method (ppo, grpo, rloo, reinforce, dpo, "
                               "online-dpo) from the SFT model on the suite: rlhflab compare's defaults, into RUN/compare")


@dataclass(frozen=True)
class DPOConfig(ParallelFields, CheckpointFields, RunFields, ModelFields, SuiteFields, DataFields, OptimFields,
                PrecisionFields, LoraFields, GenerationFields, RewardCallFields):
    """`rlhflab dpo`: direct preference optimisation on (prompt, chosen, rejected) pairs: DPO, IPO or SimPO."""

    reference: str = arg("", "reference model folder; empty = the policy's starting weights (its log-probs are "
                             "computed once before training; the reference is never resident)")
    loss_type: Literal["sigmoid", "ipo", "simpo"] = arg(
        "sigmoid", "sigmoid = DPO (Rafailov et al. 2023) on summed log-probs; ipo = IPO (Azar et al. 2023) and simpo = "
                   "SimPO (Meng et al. 2024, no reference) on length-averaged log-probs, as TRL")
    beta: float = arg(2.0, "implicit-reward scale beta: the larger, the sooner a pair stops pushing away from the "
                           "reference (IPO: its tau, target margin 1 / (2 beta); SimPO's paper: 2.0-2.5). TRL's "
                           "default is 0.1; on the suite 0.1 gained +12 points, 2.0 +36 (docs/dpo.md)")
    label_smoothing: float = arg(0.0, "sigmoid only: share of pairs assumed mislabelled (conservative DPO); 0 = off")
    simpo_gamma: float = arg(0.5, "simpo only: target reward margin gamma")
    num_epochs: int = arg(3, "passes over the training pairs (when max_steps is 0)")
    max_steps: int = arg(0, "optimiser steps; 0 = num_epochs decide")
    max_pairs: int = arg(0, "stop once this many pairs were trained on (rlhflab compare's equal-work budget); 0 = no limit")
    max_seconds: float = arg(0.0, "stop after this many seconds of the training loop (steps and evaluations, not "
                                  "loading); 0 = no limit (rlhflab compare's wall-time budget)")
    batch_size: int = arg(32, "pairs per optimiser step (split over gradient_accumulation_steps)")
    shared_prefix: bool = arg(True, "run a pair's chosen and rejected in one row that computes their shared prompt "
                                    "once (Llama / Qwen2 layouts; the same log-probs, fewer tokens)")
    length_chunks: int = arg(0, "forward passes per micro-batch over its pairs sorted by length (less padding, the "
                                "same loss and gradient); 0 = one per 16 pairs")
    eval_every: int = arg(20, "validation pairs' metrics and pass rate every N steps; 0 = start and end only")
    eval_prompts: int = arg(100, "validation prompts answered for val/pass_rate")
    verifier: str = arg("", "pass / fail function FILE.py:NAME for val/pass_rate, called as fn(prompts, completions, "
                            "**columns) -> list of bool; 'checker' = the suite's checker; empty = the checker on the "
                            "suite, none on your own pairs")
    pair_kinds: str = arg("", "built-in suite: violation kinds of the rejected answers (comma-separated); empty = all")
    pairs_per_prompt: int = arg(3, "built-in suite: rejected answers per prompt")
    pair_kinds_always: str = arg("", "built-in suite: kinds every prompt's training pairs include when its family has "
                                     "them, after the dominant kind; empty = random")
    near_misses: int = arg(0, "built-in suite: extra rejected answers per train prompt that are the reference with "
                              "one letter of a copied word changed; 0 = off")
    pair_prompts: int = arg(0, "built-in suite: train pairs on this many fresh train-pool prompts; 0 = the fixed "
                               "train split")
    hard_negatives: int = arg(0, "built-in suite: answers sampled per prompt from --model; each failing one becomes a "
                                 "rejected answer against the reference; 0 = off")
    learning_rate: float = arg(5e-5, "peak AdamW learning rate")
    warmup_steps: int = arg(5, "linear warmup steps")
    lr_schedule: Literal["cosine", "linear", "constant"] = arg("linear", "decay after warmup")
    save_every: int = arg(50, "write RUN/checkpoints/step-N every N steps and at the end; 0 = only at the end; "
                               "-1 = none (only on SIGINT / SIGTERM)")


@dataclass(frozen=True)
class CompareConfig(RunFields, ModelFields, SuiteFields, PromptFileFields, RewardFunctionFields, LoraFields,
                    GenerationFields):
    """`rlhflab compare`: several methods from one SFT model, each with the same prompts, seed, reward, generation
    settings, budget and test evaluation, side by side (docs/comparing-methods.md).

    Every field here is shared by all methods; a method's own settings go in a section of the --config YAML named
    after it (e.g. `grpo: {learning_rate: 2.0e-5}`), which may not set a shared field or the budget.
    """

    yaml_sections: typing.ClassVar[tuple[str, ...]] = tuple(dict.fromkeys(
        name for method in COMPARE_METHODS + COMPARE_VARIANTS for name in (method, method.replace("-", "_"))))

    methods: str = arg(",".join(COMPARE_METHODS), "methods to run, comma-separated, from "
                                                  f"{', '.join(COMPARE_METHODS)}, and the variants "
                                                  f"{', '.join(COMPARE_VARIANTS)} (-async: --async_generation; "
                                                  "+dynamic: --dynamic_sampling; +filter: --filter_prompts pass_rate; "
                                                  "+entropy: --use_adaptive_entropy)")
    budget: str = arg("episodes=3840", "what every method gets: episodes=N sampled responses (DPO: N preference "
                                       "pairs trained on) or seconds=S of training wall time")
    reward: Literal["auto", "checker", "model", "combined", "random"] = arg(
        "auto", "online methods' reward (and online DPO's ranking): auto = the reward model and/or --reward_fn "
                "functions when given, else the suite's checker; checker / model / combined / random")
    reward_model: str = arg("", "reward model folder (sequence classifier with one output)")
    normalize_reward: bool = arg(False, "set the reward model's shift/scale so the starting policy's answers score "
                                        "mean 0, std 1")
    response_length: int = arg(26, "response-length cap in tokens during rollouts and the KL measurement")
    temperature: float = arg(1.0, "sampling temperature of rollouts and of the KL measurement (and of evaluation "
                                  "with --do_sample)")
    prompts_file: str = arg("", "test prompts (same formats as eval --prompts_file); empty = the built-in suite's "
                                "test split")
    kl_samples: int = arg(4, "responses sampled per test prompt to measure each model's KL to the starting model")


@dataclass(frozen=True)
class ReportConfig:
    """`rlhflab report RUN_DIR [RUN_DIR ...] [--out FILE]`: an HTML report of one run folder,
    or one page comparing several."""

    runs: list[str] = dataclasses.field(
        default_factory=list, metadata={"help": "run folders: one = its report.html, several = a comparison"})
    out: str = arg("", "output HTML file; empty = RUN_DIR/report.html for one run, comparison.html for several")


STAGES: dict[str, type] = {
    "sft": SFTConfig,
    "eval": EvalConfig,
    "tasks export": TasksExportConfig,
    "demo": DemoConfig,
    "ppo": PPOConfig,
    "grpo": GRPOConfig,
    "rloo": RLOOConfig,
    "reinforce": REINFORCEConfig,
    "online-dpo": OnlineDPOConfig,
    "rm": RMConfig,
    "rm diagnose": RMDiagnoseConfig,
    "dpo": DPOConfig,
    "compare": CompareConfig,
    "report": ReportConfig,
}
