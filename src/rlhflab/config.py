"""One frozen config dataclass per stage, built from small shared parts.

Every stage config is a flat dataclass assembled by inheritance from the parts
below (model, data, optimiser, generation, run), so a YAML file's keys are the
field names and `--field value` flags override them. Parsing goes through
`transformers.HfArgumentParser`, as TRL users know it; see `parse_config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from transformers import HfArgumentParser

from rlhflab.errors import UserInputError
from rlhflab.trl_names import TRL_NAMES


def arg(default: Any, help: str, **extra: Any) -> Any:
    """A config field with its one-line help (shown by `rlhflab <stage> --help`)."""
    return dataclasses.field(default=default, metadata={"help": help, **extra})


# `rlhflab compare --methods`: the trainers it can run, in the order they are reported
COMPARE_METHODS = ("ppo", "grpo", "rloo", "reinforce", "dpo", "online-dpo")


# --- shared parts -----------------------------------------------------------------


@dataclass(frozen=True)
class RunFields:
    output_dir: str = arg("", "run folder to write; empty = runs/<stage>-<timestamp>", aliases=["--out"])
    overwrite: bool = arg(False, "allow writing into a folder that already holds another run")
    seed: int = arg(0, "seed for model init, data order and sampling")
    deterministic: bool = arg(False, "torch.use_deterministic_algorithms(True) (warn_only) and, on CUDA, "
                                     "deterministic cuDNN and CUBLAS_WORKSPACE_CONFIG=:4096:8; recorded in "
                                     "versions.json")
    threads: int = arg(0, "torch CPU threads; 0 = all cores (OMP_WAIT_POLICY=PASSIVE is set for you)")
    log_every: int = arg(10, "write metrics every N optimiser steps")
    report_to: str = arg("none", "extra metric sinks besides metrics.jsonl: none, or any of tensorboard, wandb, "
                                 "trackio (comma-separated)")
    progress: bool = arg(True, "show a progress bar")


@dataclass(frozen=True)
class LoadFields:
    trust_remote_code: bool = arg(False, "run code shipped with a hub model (off unless you trust it)")
    dtype: str = arg("float32", "weights dtype: float32, bfloat16, float16 or auto")
    device: str = arg("auto", "where models run: auto (cuda if available), cpu, cuda, cuda:1 ...")


@dataclass(frozen=True)
class ModelFields(LoadFields):
    model: str = arg("", "causal LM: local folder or hub id; empty = build the tiny default model")
    tokenizer: str = arg("", "tokenizer folder or hub id; empty = the model's own")


@dataclass(frozen=True)
class TinyModelFields:
    arch: str = arg("llama", "tiny model architecture: llama, gpt2, qwen2 or gpt_neox")
    hidden_size: int = arg(96, "tiny model width")
    num_layers: int = arg(3, "tiny model depth")
    num_heads: int = arg(4, "tiny model attention heads")
    intermediate_size: int = arg(256, "tiny model MLP width")
    vocab_size: int = arg(384, "BPE vocabulary size of the tiny tokenizer")


@dataclass(frozen=True)
class SuiteFields:
    split_seed: int = arg(0, "seed of the built-in suite's train/validation/test split")
    num_train_prompts: int = arg(400, "built-in suite: prompts in the train split")
    num_validation_prompts: int = arg(100, "built-in suite: prompts in the validation split")
    num_test_prompts: int = arg(100, "built-in suite: prompts in the test split")
    sft_examples: int = arg(20000, "built-in suite: SFT demonstrations drawn from the train split's content")
    violation_fraction: float = arg(0.75, "built-in suite: share of SFT demonstrations that violate the format")
    dominant_share: float = arg(0.75, "built-in suite: share of violations that are the family's dominant kind")


@dataclass(frozen=True)
class DatasetFields:
    """How a data file or dataset name is read (rlhflab.data.load)."""

    dataset_split: str = arg("train", "split of --train_file when it is a datasets name or folder with splits; "
                                      "NAME:SPLIT in --train_file / --validation_file picks one for that file "
                                      "(e.g. trl-lib/tldr:validation); --validation_file without one uses its "
                                      "only split")
    dataset_config: str = arg("", "configuration (subset) of a datasets name in --train_file / --validation_file; "
                                  "empty = its default")
    max_prompt_tokens: int = arg(96, "prompts longer than this are bad rows")
    strict: bool = arg(False, "fail on the first bad data row instead of dropping bad rows")


@dataclass(frozen=True)
class DataFields(DatasetFields):
    train_file: str = arg("", "training data in any of TRL's formats (README \"Data formats\"): JSONL, Parquet, "
                              "a datasets folder or a datasets name (hub id); empty = built-in suite")
    validation_file: str = arg("", "validation data, same formats; empty = built-in suite's validation split")
    max_length: int = arg(160, "prompt + completion tokens per training sequence")


@dataclass(frozen=True)
class PromptFileFields(DatasetFields):
    """Prompts of the online stages (rlhflab.sources): a user's file or dataset, else the built-in suite."""

    train_file: str = arg("", "training prompts in TRL's prompt-only format (or any format with a prompt; README "
                              "\"Data formats\"): JSONL, Parquet, a datasets folder or name; other columns go to "
                              "reward / verifier functions; empty = built-in suite")
    validation_file: str = arg("", "validation prompts, same formats; empty = a seeded slice of the train prompts "
                                   "(or the suite's validation split)")


@dataclass(frozen=True)
class RewardFunctionFields:
    """A practitioner's reward and verifier functions (TRL's reward_funcs signature; README "Your own data")."""

    reward_fn: str = arg("", "your reward functions, comma-separated FILE.py:NAME or package.module:NAME; called as "
                             "fn(prompts, completions, **columns) -> list of float or None (None: row left out)")
    reward_weights: str = arg("", "comma-separated weights of the --reward_fn functions; empty = 1 each")
    verifier: str = arg("", "pass / fail function (same signature, returns bools) that validation, alarms, stopping "
                            "and keep_best read; 'checker' = the suite's checker; empty = the checker on the suite, "
                            "none on your own prompts (then the held-out signal is the reward itself)")


@dataclass(frozen=True)
class OptimFields:
    learning_rate: float = arg(2e-3, "peak AdamW learning rate")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    adam_beta1: float = arg(0.9, "AdamW beta1")
    adam_beta2: float = arg(0.95, "AdamW beta2")
    adam_eps: float = arg(1e-8, "AdamW epsilon")
    lr_schedule: Literal["cosine", "linear", "constant"] = arg("cosine", "decay after warmup")
    warmup_steps: int = arg(100, "linear warmup steps")
    max_grad_norm: float = arg(1.0, "clip the global gradient norm to this; 0 = off")
    gradient_accumulation_steps: int = arg(1, "micro-batches per optimiser step")


@dataclass(frozen=True)
class GenerationFields:
    max_new_tokens: int = arg(32, "response-length cap in tokens")
    do_sample: bool = arg(False, "sample (True) or greedy decoding (False) in evaluation")
    temperature: float = arg(1.0, "sampling temperature")
    top_k: int = arg(0, "keep the k most likely tokens when sampling; 0 = off")
    top_p: float = arg(1.0, "nucleus sampling mass; 1.0 = off")
    eval_batch_size: int = arg(100, "prompts per generation batch in evaluation")


@dataclass(frozen=True)
class CheckpointFields:
    """Checkpoints, resume and non-finite guards (rlhflab.checkpoint; README "Checkpoints and resume")."""

    save_every: int = arg(0, "write RUN/checkpoints/step-N every N optimiser steps (PPO: updates) and at the end; "
                             "0 = only at the end")
    keep_last_n: int = arg(2, "complete checkpoints to keep; older ones are deleted once a newer one is complete; "
                              "0 = keep all")
    resume: str = arg("", "continue a run: 'latest' (newest complete checkpoint in --output_dir) or a "
                          "RUN/checkpoints/step-N folder; empty = start fresh")
    allow_config_change: bool = arg(False, "resume even though the config differs from the run's config.yaml "
                                           "(the differences are recorded in summary.json)")
    nonfinite: Literal["stop", "skip"] = arg(
        "stop", "on a non-finite loss, gradient norm or advantage: stop (naming step and rows; no checkpoint "
                "after it) or skip (drop that optimiser update, count it in nonfinite/skipped_updates)")


# --- stage configs ------------------------------------------------------------------


@dataclass(frozen=True)
class SFTConfig(CheckpointFields, RunFields, ModelFields, TinyModelFields, SuiteFields, DataFields, OptimFields,
                GenerationFields):
    """`rlhflab sft`: supervised fine-tuning on prompt/completion demonstrations."""

    max_steps: int = arg(1000, "optimiser steps (the tiny model learns to copy unseen words only after ~600)")
    batch_size: int = arg(64, "sequences per optimiser step (split over gradient_accumulation_steps)")
    gradient_accumulation_steps: int = arg(
        2, "micro-batches per optimiser step, cut from the step's sequences sorted by length (less padding, "
           "same gradient)")
    eval_every: int = arg(250, "validation loss and pass rate every N steps; 0 = only at the end")
    eval_prompts: int = arg(100, "validation prompts used for the periodic pass rate")
    group_by_length: int = arg(0, "sort runs of this many batches by length before cutting them (less padding); 0 = off")
    save_every: int = arg(250, "write RUN/checkpoints/step-N every N steps and at the end; 0 = only at the end")


@dataclass(frozen=True)
class EvalConfig(RunFields, ModelFields, SuiteFields, GenerationFields):
    """`rlhflab eval`: generate answers to a split's prompts and check them."""

    split: Literal["train", "validation", "test"] = arg("test", "which split of the built-in suite")
    prompts_file: str = arg("", "your prompts (JSONL, Parquet, save_to_disk folder or datasets name; prompt-only rows, "
                                "other columns go to the verifier); empty = the built-in suite's split")
    verifier: str = arg("", "pass / fail function FILE.py:NAME or package.module:NAME, called as fn(prompts, "
                            "completions, **columns) -> list of bool; empty = the suite's checker (needs 'family' and "
                            "'reference' columns in a prompts file)")


@dataclass(frozen=True)
class TasksExportConfig(RunFields, SuiteFields):
    """`rlhflab tasks export`: write the built-in suite as JSONL in TRL's columns."""

    pair_kinds: str = arg("", "comma-separated violation kinds for rejected answers; empty = all")
    pairs_per_prompt: int = arg(3, "rejected answers (pairs) per prompt")




@dataclass(frozen=True)
class LoraFields:
    lora_r: int = arg(0, "LoRA rank of the policy; 0 = full fine-tuning")
    lora_alpha: int = arg(16, "LoRA alpha (scale = alpha / r)")
    lora_dropout: float = arg(0.0, "LoRA dropout (kept 0 in RL: dropout makes ratio != 1 at the first step)")
    lora_target_modules: str = arg("all-linear", "modules LoRA adapts: all-linear or comma-separated names")


@dataclass(frozen=True)
class MonitorFields:
    """Training alarms and the stopping rule (rlhflab.eval.alarms / .stopping; README "Alarms and stopping")."""

    stop_patience: int = arg(0, "stop when val/pass_rate has not risen by stop_min_delta over its best in this "
                                "many evaluations (every eval_every updates); 0 = never stop early")
    stop_min_delta: float = arg(0.01, "smallest rise of val/pass_rate over its best that counts as an improvement")
    stop_on_alarms: str = arg("", "alarms that stop the run, comma-separated: reward_hacking, length_drift, "
                                  "mode_collapse, training_health, or all; empty = alarms only warn")
    keep_best: bool = arg(True, "keep the policy of the best val/pass_rate and save it if the run stops early "
                                "or ends below it")
    score_rise_bound: float = arg(0.25, "alarm reward_hacking: objective/scores up by this much since the best "
                                       "evaluation while 3 evaluations in a row did not beat its pass rate")
    kl_rate_bound: float = arg(1.5, "alarm reward_hacking: objective/kl growing faster than this many nats per "
                                    "1,000 episodes (slope over the last 20 updates)")
    kl_cap: float = arg(10.0, "alarm reward_hacking: objective/kl (median of 5 updates) above this many nats")
    length_drift_bound: float = arg(0.5, "alarm length_drift: mean response length moved by more than this "
                                         "fraction of its start")
    capped_share_bound: float = arg(0.3, "alarm length_drift: share of responses hitting the length cap above this")
    min_distinct_ratio: float = arg(0.5, "alarm mode_collapse: response/distinct_2 below this fraction of its start")
    duplicate_share_bound: float = arg(0.5, "alarm mode_collapse: share of duplicate responses above this")
    min_entropy_ratio: float = arg(0.2, "alarm mode_collapse: objective/entropy below this fraction of its start")


@dataclass(frozen=True)
class OnlineFields(MonitorFields, CheckpointFields, RunFields, ModelFields, SuiteFields, PromptFileFields,
                   RewardFunctionFields, LoraFields, OptimFields, GenerationFields):
    """What every online method (PPO, GRPO, RLOO, REINFORCE, online DPO) shares: the roles, the reward,
    the rollout cycle, evaluation during the run (trainers/online/loop.py)."""

    # the roles
    reference: str = arg("", "reference model folder; empty = the policy's starting weights")
    reward: Literal["auto", "checker", "model", "combined", "random"] = arg(
        "auto", "reward source: auto = the reward model and/or --reward_fn functions when given, else the suite's "
                "checker; checker / model / combined (checker + model) / random; --reward_fn adds to any of them")
    reward_model: str = arg("", "reward model folder (sequence classifier with one output)")
    checker_weight: float = arg(1.0, "weight of the checker reward in reward=combined")
    reward_model_weight: float = arg(1.0, "weight of the reward model in reward=combined")
    reward_shift: float = arg(0.0, "reward-model scores are (score - shift) / scale")
    reward_scale: float = arg(1.0, "reward-model scores are (score - shift) / scale")
    normalize_reward: bool = arg(False, "set shift/scale so the starting policy's answers score mean 0, std 1")
    calibration_prompts: int = arg(64, "train prompts answered by the starting policy to normalise the reward model")
    reference_mode: Literal["resident", "reload"] = arg(
        "resident", "keep a reference copy in memory, or reload it for each rollout's log-probs and free it")
    lora_merge_generation: bool = arg(
        False, "LoRA: sample rollouts with the adapter merged into temporary weight copies (somewhat faster "
               "decoding; costs one extra copy of the adapted weights while generating; originals restored bit for bit)")
    reuse_rollout_forward: bool = arg(
        True, "with one minibatch of one micro-batch: keep the rollout's policy forward (with its autograd graph) "
              "as the first training step's forward instead of repeating it (its activations stay alive during scoring)")
    mmap_threshold_mib: int = arg(
        0, "CPU memory (glibc): allocations of at least this many MiB are mmapped and handed back to the OS when "
           "freed, which lowers peak RSS for big models (1 is a good value at ~25M+ parameters); 0 = malloc's default")
    # the cycle
    total_episodes: int = arg(3840, "responses generated over the run")
    max_seconds: float = arg(0.0, "stop after this many seconds of the run's cycle (updates and evaluations, not "
                                  "loading); 0 = no limit (rlhflab compare's wall-time budget)")
    batch_size: int = arg(64, "responses per rollout (one update); with num_generations k: batch_size / k prompts")
    num_mini_batches: int = arg(1, "minibatches (optimiser steps) each rollout is split into per pass")
    response_length: int = arg(26, "response-length cap in tokens during rollouts")
    missing_eos_penalty: float = arg(1.0, "subtracted from the score of a response that hit the length cap")
    temperature: float = arg(1.0, "sampling temperature of rollouts; log-probs use the same one")
    # evaluation during the run
    eval_every: int = arg(10, "validation pass rate every N updates; 0 = start and end only")
    eval_prompts: int = arg(100, "validation prompts used for the pass rate")
    sample_prompts: int = arg(8, "fixed validation prompts whose answers go to samples.jsonl at each evaluation")
    save_every: int = arg(20, "write RUN/checkpoints/step-N every N updates and at the end; 0 = only at the end")
    console_samples: int = arg(4, "answers to the first N fixed validation prompts logged as a table (prompt, "
                                  "answer, pass/fail) at each evaluation; 0 = off")
    # RL optimiser defaults (FACTS.md: lr 3e-4 or 4 epochs blew PPO's KL up)
    learning_rate: float = arg(1e-4, "peak AdamW learning rate")
    adam_eps: float = arg(1e-5, "AdamW epsilon")
    warmup_steps: int = arg(0, "linear warmup in optimiser steps")
    lr_schedule: Literal["cosine", "linear", "constant"] = arg("linear", "decay after warmup")


@dataclass(frozen=True)
class PPOConfig(OnlineFields):
    """`rlhflab ppo`: PPO-RLHF with policy, reference, reward and value roles."""

    value_mode: Literal["shared", "separate", "lora_adapter"] = arg(
        "shared", "value head on the policy trunk, a separate value model, or a 2nd LoRA adapter on the shared base")
    value_model: str = arg("", "value model init for value_mode=separate; empty = the policy (a reward model also works)")
    batch_size: int = arg(64, "prompts per rollout (one PPO update), one response each")
    num_mini_batches: int = arg(2, "minibatches each rollout is split into per PPO epoch")
    num_ppo_epochs: int = arg(2, "passes over each rollout")
    cliprange: float = arg(0.2, "policy ratio clip epsilon")
    cliprange_value: float = arg(0.2, "value clip epsilon around the rollout's values")
    vf_coef: float = arg(0.1, "weight of the value loss")
    kl_coef: float = arg(0.05, "beta: per-token KL penalty in the reward (initial value if adaptive)")
    kl_estimator: Literal["k1", "k2", "k3"] = arg("k1", "per-token KL estimator in the reward")
    adaptive_kl: bool = arg(False, "adapt kl_coef towards kl_target (Ziegler et al. 2019)")
    kl_target: float = arg(6.0, "adaptive KL: target KL per sequence (nats)")
    kl_horizon: int = arg(10000, "adaptive KL: horizon in episodes")
    gamma: float = arg(1.0, "discount")
    lam: float = arg(0.95, "GAE lambda")
    whiten_rewards: bool = arg(False, "whiten per-token rewards before GAE")
    whiten_advantages: bool = arg(True, "whiten advantages over the rollout")


@dataclass(frozen=True)
class GroupFields:
    """k samples per prompt and a clipped ratio: what GRPO and RLOO share (TRL's names)."""

    num_generations: int = arg(4, "responses sampled per prompt (the group); batch_size must be a multiple of it")
    num_iterations: int = arg(1, "mu: optimisation passes over each rollout (> 1 makes the clipped ratio matter)")
    epsilon: float = arg(0.2, "clip: the ratio is kept within [1 - epsilon, 1 + epsilon_high]")
    epsilon_high: float = arg(0.0, "upper clip; 0 = epsilon (DAPO's clip-higher: 0.28)")


@dataclass(frozen=True)
class GRPOConfig(GroupFields, OnlineFields):
    """`rlhflab grpo`: group-relative policy optimisation, no critic (Shao et al. 2024), with TRL's variants."""

    beta: float = arg(0.04, "KL coefficient to the reference: a k3 loss term, or with kl_in_reward a penalty in the reward")
    kl_in_reward: bool = arg(False, "subtract beta * the sequence KL (k1) from the reward instead of a KL loss term")
    scale_rewards: Literal["group", "batch", "none"] = arg(
        "group", "divide centred rewards by the group's std, the batch's std, or not at all (Dr. GRPO)")
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = arg(
        "dapo", "token aggregation: grpo = mean per response then over responses; bnpo = over the minibatch's tokens; "
                "dr_grpo = sum / (responses x response_length); dapo = over the whole rollout's tokens")
    importance_sampling_level: Literal["token", "sequence"] = arg(
        "token", "ratio per token, or one per response from its mean log-ratio (GSPO)")


@dataclass(frozen=True)
class RLOOConfig(GroupFields, OnlineFields):
    """`rlhflab rloo`: REINFORCE leave-one-out with k samples per prompt (Ahmadian et al. 2024)."""

    num_iterations: int = arg(2, "passes over each rollout (FACTS.md: 2 worked on the suite)")
    beta: float = arg(0.05, "KL coefficient: beta * the sequence KL (k1) is subtracted from each response's reward")
    normalize_advantages: bool = arg(False, "whiten the leave-one-out advantages over the rollout")


@dataclass(frozen=True)
class REINFORCEConfig(OnlineFields):
    """`rlhflab reinforce`: the policy gradient with a baseline (Williams 1992), no critic, no clipping."""

    baseline: Literal["batch_mean", "moving_average", "leave_one_out"] = arg(
        "batch_mean", "what is subtracted from each return: the batch's mean score, a moving average of past "
                      "batches' means, or the mean of the prompt's other samples (needs num_generations >= 2)")
    baseline_decay: float = arg(0.9, "moving_average: weight of the old average at each update")
    num_generations: int = arg(1, "responses sampled per prompt; batch_size must be a multiple of it")
    kl_coef: float = arg(0.05, "per-token KL penalty -kl_coef * KL_t in the reward (reward-to-go); 0 = off")
    normalize_advantages: bool = arg(False, "whiten the advantages over the rollout")


@dataclass(frozen=True)
class OnlineDPOConfig(OnlineFields):
    """`rlhflab online-dpo`: iterative on-policy DPO (Guo et al. 2024): sample k answers per prompt from the
    current policy, rank them with the reward (model, functions or the checker), train on best vs worst."""

    num_generations: int = arg(4, "answers sampled per prompt; the best and the worst make one pair")
    num_iterations: int = arg(1, "passes over each rollout's pairs")
    beta: float = arg(0.1, "DPO beta: strength of the pull towards the reference")
    loss_type: Literal["sigmoid", "ipo"] = arg("sigmoid", "sigmoid = DPO (summed log-probs), ipo = IPO (length-averaged)")
    label_smoothing: float = arg(0.0, "cDPO: assumed share of flipped preferences (sigmoid only)")
    learning_rate: float = arg(5e-5, "peak AdamW learning rate")


@dataclass(frozen=True)
class RMConfig(CheckpointFields, RunFields, ModelFields, SuiteFields, DataFields, OptimFields):
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
    length_chunks: int = arg(2, "forward passes per step over the step's sequences sorted by length (less padding, "
                                "same gradient); 1 = one pass")
    shared_prefix: bool = arg(True, "score a pair's chosen and rejected in one row that runs their shared prompt once "
                                    "(Llama / Qwen2 layouts; the same scores, about 40 percent fewer tokens on the suite)")
    margin: float = arg(0.0, "Bradley-Terry margin: -log sigmoid(r_c - r_r - margin)")
    average_weights: float = arg(0.0, "save the mean of the weights over this last fraction of the steps "
                                      "(stochastic weight averaging); 0 = the last step's weights")
    center_rewards_coef: float = arg(0.0, "reward-centring penalty coef * (r_c + r_r)^2 (Eisenstein et al. 2023)")
    learning_rate: float = arg(3e-4, "peak AdamW learning rate")
    warmup_steps: int = arg(5, "linear warmup steps")
    lr_schedule: Literal["cosine", "linear", "constant"] = arg("linear", "decay after warmup")


@dataclass(frozen=True)
class RMDiagnoseConfig(RunFields, LoadFields, SuiteFields, GenerationFields):
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
    the reward model takes RMConfig's defaults, `rm_epochs` and `rm_config`.
    """

    run_ppo: bool = arg(True, "run the PPO stage with the task checker as reward")
    run_rm: bool = arg(True, "train a reward model on the suite's pairs, diagnose it, and run PPO with it as reward")
    ppo_config: str = arg("", "YAML of PPOConfig fields for the demo's PPO stages (e.g. configs/ppo_tiny.yaml)")
    ppo_total_episodes: int = arg(2560, "PPO stages: responses generated")
    ppo_learning_rate: float = arg(1e-4, "PPO stages: learning rate")
    ppo_kl_coef: float = arg(0.05, "PPO stages: KL penalty coefficient beta")
    rm_config: str = arg("", "YAML of RMConfig fields for the demo's reward model (e.g. configs/rm_tiny.yaml)")
    rm_epochs: int = arg(7, "reward model: passes over the pairs")
    rm_hard_negatives: int = arg(2, "reward model: SFT answers sampled per prompt; the failing ones become rejected answers")
    rm_pair_prompts: int = arg(2400, "reward model: fresh train-pool prompts the pairs are built on")
    rm_learning_rate: float = arg(3e-4, "reward model: learning rate")
    rm_center_rewards_coef: float = arg(0.01, "reward model: reward-centring coefficient (keeps families on one scale)")
    rm_pair_kinds_always: str = arg("wrong_content", "reward model: kinds every prompt's training pairs include "
                                                     "(content errors are the ones it finds hardest)")
    rm_near_misses: int = arg(0, "reward model: near-miss rejected answers per train prompt (one copied letter changed)")
    rm_diagnosis_samples: int = arg(8, "reward-model diagnosis: answers sampled per test prompt (8 x the default 100 "
                                       "test prompts = 800 answers: a correlation steady to about +-0.01)")
    compare: bool = arg(False, "after the demo, compare every available method (ppo, grpo, rloo, reinforce, dpo, "
                               "online-dpo) from the SFT model on the suite: rlhflab compare's defaults, into RUN/compare")


@dataclass(frozen=True)
class DPOConfig(CheckpointFields, RunFields, ModelFields, SuiteFields, DataFields, OptimFields, LoraFields,
                GenerationFields):
    """`rlhflab dpo`: direct preference optimisation on (prompt, chosen, rejected) pairs: DPO, IPO or SimPO."""

    reference: str = arg("", "reference model folder; empty = the policy's starting weights (its log-probs are "
                             "computed once before training; the reference is never resident)")
    loss_type: Literal["sigmoid", "ipo", "simpo"] = arg(
        "sigmoid", "sigmoid = DPO (Rafailov et al. 2023) on summed log-probs; ipo = IPO (Azar et al. 2023) and simpo = "
                   "SimPO (Meng et al. 2024, no reference) on length-averaged log-probs, as TRL")
    beta: float = arg(2.0, "implicit-reward scale beta: the larger, the sooner a pair stops pushing away from the "
                           "reference (IPO: its tau, target margin 1 / (2 beta); SimPO's paper: 2.0-2.5). TRL's "
                           "default is 0.1; on the suite 0.1 gained +12 points, 2.0 +36 (README \"DPO, IPO and SimPO\")")
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
    save_every: int = arg(50, "write RUN/checkpoints/step-N every N steps and at the end; 0 = only at the end")


@dataclass(frozen=True)
class CompareConfig(RunFields, ModelFields, SuiteFields, PromptFileFields, RewardFunctionFields, LoraFields,
                    GenerationFields):
    """`rlhflab compare`: several methods from one SFT model, each with the same prompts, seed, reward, generation
    settings, budget and test evaluation, side by side (README "Comparing methods").

    Every field here is shared by all methods; a method's own settings go in a section of the --config YAML named
    after it (e.g. `grpo: {learning_rate: 2.0e-5}`), which may not set a shared field or the budget.
    """

    yaml_sections: typing.ClassVar[tuple[str, ...]] = COMPARE_METHODS + ("online_dpo",)

    methods: str = arg(",".join(COMPARE_METHODS), "methods to run, comma-separated, from "
                                                  f"{', '.join(COMPARE_METHODS)}")
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


# --- parsing --------------------------------------------------------------------------


def field_names(config_cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(config_cls)]


def _closest(name: str, config_cls: type, flag: bool) -> str:
    """What to do about an unknown flag (`flag`) or YAML key: TRL's name for a field if it is one, else the
    closest field name."""
    names = field_names(config_cls)
    if name in TRL_NAMES:
        return _trl_hint(name, names, flag)
    match = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return f"did you mean '{match[0]}'?" if match else f"run with --help to list the {len(names)} valid keys"


def _trl_hint(name: str, names: list[str], flag: bool) -> str:
    """README "Coming from TRL" in one line: the field this stage has for TRL's `name`, or why there is none."""
    show = (lambda n: f"--{n}") if flag else (lambda n: f"'{n}'")
    counterpart = TRL_NAMES[name]
    if not counterpart.fields:
        return f"TRL's {show(name)} has no rlhflab counterpart: {counterpart.note}"
    here = [f for f in counterpart.fields if f in names]
    if not here:  # e.g. --reward_model_path on sft: say which stages take it rather than guess a neighbour
        stages = [stage for stage, cls in STAGES.items() if counterpart.fields[0] in field_names(cls)]
        return (f"TRL's {show(name)} is rlhflab's {show(counterpart.fields[0])}, which this stage does not take "
                f"(stages that do: {', '.join(stages) or 'none yet'})")
    if not counterpart.rename:  # the note says how the value changes
        return f"did you mean {show(here[0])}? (TRL's {show(name)}: {counterpart.note})"
    note = f": {counterpart.note}" if counterpart.note else ""
    return f"did you mean {show(here[0])}? (TRL's {show(name)} is rlhflab's {show(here[0])}{note})"


def _unknown(names: list[str], config_cls: type, what: str, where: str, flag: bool) -> UserInputError:
    """One error naming every unknown flag or key, each with its hint, so a TRL command is fixed in one pass."""
    def bare(name: str) -> str:
        return name.lstrip("-").split("=")[0].replace("-", "_")

    if len(names) == 1:
        return UserInputError(f"unknown {what} '{names[0]}'", where, _closest(bare(names[0]), config_cls, flag))
    listed = ", ".join(f"'{n}'" for n in names)
    hints = "".join(f"\n  {n.split('=')[0]}: {_closest(bare(n), config_cls, flag)}" for n in names)
    return UserInputError(f"unknown {what}s {listed}", where, f"for each:{hints}")


_EXAMPLES = {bool: "true", int: "10", float: "0.001", str: "some-text"}


def _coerce(name: str, value: Any, kind: Any, where: str) -> Any:
    """Check a YAML value against the field's type; ints are accepted for floats."""
    origin = typing.get_origin(kind)
    if origin is Literal:
        if value not in typing.get_args(kind):
            raise UserInputError(f"'{name}' must be one of {list(typing.get_args(kind))}, got {value!r}", where)
        return value
    if origin is list:  # e.g. report's `runs`: a YAML list of strings
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise UserInputError(f"'{name}' should be a list of strings, got {value!r}", where,
                                 f"write e.g. {name}: [runs/a, runs/b]")
        return value
    if kind is float and isinstance(value, str):
        try:  # PyYAML reads 1e-4 (no dot) as a string
            value = float(value)
        except ValueError:
            pass
    expected = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}[kind]
    if isinstance(value, bool) and kind is not bool or not isinstance(value, expected):
        raise UserInputError(
            f"'{name}' should be {kind.__name__}, got {type(value).__name__} {value!r}",
            where,
            f"write e.g. {name}: {_EXAMPLES[kind]}",
        )
    return float(value) if kind is float else value


def read_yaml_config(path: str, config_cls: type) -> dict[str, Any]:
    """Load a YAML mapping and check every key and value against `config_cls`."""
    file = Path(path)
    if not file.is_file():
        raise UserInputError(f"config file not found: {path}", "--config", "pass the path of an existing YAML file")
    try:
        values = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserInputError(f"not valid YAML ({err})", path, "fix the syntax or pass another file") from err
    if not isinstance(values, dict):
        raise UserInputError("a config file must be a mapping of field: value", path)
    sections = getattr(config_cls, "yaml_sections", ())  # keys its command reads itself (compare's per-method ones)
    return check_values({k: v for k, v in values.items() if k not in sections}, config_cls, path)


def check_values(values: dict[str, Any], config_cls: type, where: str) -> dict[str, Any]:
    """Check every key and value of a mapping (a YAML file, or one section of it) against `config_cls`."""
    names = field_names(config_cls)
    unknown = [str(key) for key in values if key not in names]
    if unknown:
        raise _unknown(unknown, config_cls, "config key", where, flag=False)
    hints = typing.get_type_hints(config_cls)
    return {key: _coerce(key, value, hints[key], f"{where}: {key}") for key, value in values.items()}


def build_parser(config_cls: type, prog: str) -> HfArgumentParser:
    parser = HfArgumentParser(config_cls, prog=prog, description=config_cls.__doc__, allow_abbrev=False)
    parser.add_argument("--config", default=None, help="YAML file whose keys are the field names; flags override it")
    for action in parser._actions:  # HfArgumentParser gives --no_X the help of --X, which reads backwards
        if action.const is False and any(o.startswith("--no_") for o in action.option_strings):
            action.help = f"turn {action.dest} off (the same as --{action.dest} false)"
            action.default = argparse.SUPPRESS  # keeps "(default: False)" out of the help; --X holds the default
    return parser


def _stray_value(value: str, argv: list[str], prog: str) -> UserInputError:
    """A value no flag took, most often the second item of a TRL-style list (`--lora_target_modules q_proj v_proj`)."""
    before = [token for token in argv[: argv.index(value)] if token.startswith("--")] if value in argv else []
    if not before:
        return UserInputError(f"unexpected value '{value}'", prog, "give settings as --field value; --help lists them")
    return UserInputError(f"unexpected value '{value}' after {before[-1]}", prog,
                          "each flag takes one value; write lists comma-separated, e.g. --lora_target_modules "
                          "q_proj,v_proj (TRL's scripts take them space-separated)")


def parse_config(config_cls: type, argv: list[str], prog: str) -> Any:
    """Defaults < YAML file (`--config`) < command-line flags -> a frozen config."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    parser = build_parser(config_cls, prog)
    if known.config:
        parser.set_defaults(**read_yaml_config(known.config, config_cls))
    namespace, unknown = parser.parse_known_args(argv)
    if unknown:  # the values after an unknown flag land here too: name the flags
        flags = [token for token in unknown if token.startswith("--")]
        raise _unknown(flags, config_cls, "option", prog, flag=True) if flags else _stray_value(unknown[0], argv, prog)
    values = {k: v for k, v in vars(namespace).items() if k != "config"}
    return config_cls(**values)


def config_to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def write_config(config: Any, path: Path) -> None:
    """Write the effective config as YAML; it can be passed back with --config."""
    path.write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
