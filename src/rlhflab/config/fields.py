"""The small shared parts every stage config is assembled from (model, data, optimiser, generation, run ...)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal


def arg(default: Any, help: str, **extra: Any) -> Any:
    """A config field with its one-line help (shown by `rlhflab <stage> --help`)."""
    return dataclasses.field(default=default, metadata={"help": help, **extra})



# --- shared parts -----------------------------------------------------------------


@dataclass(frozen=True)
class RunFields:
    output_dir: str = arg("", "run folder to write; empty = runs/<stage>-<timestamp>", aliases=["--out"])
    overwrite: bool = arg(False, "replace the run already in --output_dir: it is moved aside to "
                                 "OUTPUT_DIR.replaced-<time> and deleted once this run's first checkpoint is "
                                 "complete (kept if this run fails or is stopped before)")
    seed: int = arg(0, "seed for model init, data order and sampling")
    deterministic: bool = arg(False, "torch.use_deterministic_algorithms(True) (warn_only) and, on CUDA, "
                                     "deterministic cuDNN and CUBLAS_WORKSPACE_CONFIG=:4096:8; recorded in "
                                     "versions.json")
    threads: int = arg(0, "torch CPU threads; 0 = all cores (OMP_WAIT_POLICY=PASSIVE is set for you)")
    log_every: int = arg(10, "write metrics every N optimiser steps")
    report_to: str = arg("none", "extra metric sinks besides metrics.jsonl: none, or any of tensorboard, wandb, "
                                 "trackio (comma-separated)")
    progress: bool = arg(True, "show a progress bar")
    write_report: bool = arg(True, "end the command with RUN/report.html (rlhflab report RUN writes it later too)")


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
    num_validation_prompts: int = arg(300, "built-in suite: prompts in the validation split")
    num_test_prompts: int = arg(300, "built-in suite: prompts in the test split")
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
    train_file: str = arg("", "training data in any of TRL's formats (docs/own-data.md \"Data formats\"): JSONL, Parquet, "
                              "a datasets folder or a datasets name (hub id); empty = built-in suite")
    validation_file: str = arg("", "validation data, same formats; empty = built-in suite's validation split")
    max_length: int = arg(160, "prompt + completion tokens per training sequence")


@dataclass(frozen=True)
class PromptFileFields(DatasetFields):
    """Prompts of the online stages (rlhflab.sources): a user's file or dataset, else the built-in suite."""

    train_file: str = arg("", "training prompts in TRL's prompt-only format (or any format with a prompt; docs/own-data.md "
                              "\"Data formats\"): JSONL, Parquet, a datasets folder or name; other columns go to "
                              "reward / verifier functions; empty = built-in suite")
    validation_file: str = arg("", "validation prompts, same formats; empty = a seeded slice of the train prompts "
                                   "(or the suite's validation split)")


@dataclass(frozen=True)
class RewardCallFields:
    """How a practitioner's reward and verifier functions are called (docs/own-data.md "A function that hangs or
    fails")."""

    reward_timeout: float = arg(600.0, "seconds one call of a reward or verifier function of yours (--reward_fn, "
                                       "--verifier, reward_funcs) may take; a call gets the whole batch; past it the "
                                       "run ends naming the function, the row it hangs on and its prompt (or the rows "
                                       "are left out: --reward_errors invalid); 0 = no limit")
    reward_errors: Literal["stop", "invalid"] = arg(
        "stop", "rows a reward or verifier function of yours raises or times out on: stop = end the run naming the "
                "function, the row and its prompt; invalid = leave them out of the update as a None return is (a "
                "verifier's: failed) and count them per function in summary.json's reward_errors and the report")


@dataclass(frozen=True)
class RewardFunctionFields(RewardCallFields):
    """A practitioner's reward and verifier functions (TRL's reward_funcs signature; docs/own-data.md)."""

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
class PrecisionFields:
    """Mixed precision and activation memory of the models a stage trains and runs (rlhflab.models.precision,
    rlhflab.models.checkpointing; docs/scaling-out.md "Real-size models")."""

    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = arg(
        "auto", "forward passes under torch.autocast over float32 master weights and optimiser states: bf16, fp16 "
                "(with a gradient scaler: steps with inf / NaN gradients skipped and counted), no (float32); auto = "
                "bf16 on a CUDA device that has it, no on a CPU. --dtype still sets how weights are stored")
    bf16: bool = arg(False, "TRL's name for --mixed_precision bf16")
    fp16: bool = arg(False, "TRL's name for --mixed_precision fp16")
    gradient_checkpointing: bool = arg(
        False, "recompute each decoder layer's activations in the backward instead of keeping them (policy, value "
               "model and reward model; use_reentrant=False): less activation memory for about one more forward")
    logits_chunk_mib: int = arg(
        64, "token log-probs: form the logits of at most this many MiB of float32 at once; more positions than that "
            "go chunk by chunk, so no (batch x tokens x vocabulary) tensor is held (docs/ppo.md \"Memory modes\"); "
            "0 = always form them whole")


@dataclass(frozen=True)
class GenerationFields:
    max_new_tokens: int = arg(32, "response-length cap in tokens")
    do_sample: bool = arg(False, "sample (True) or greedy decoding (False) in evaluation")
    temperature: float = arg(1.0, "sampling temperature")
    top_k: int = arg(0, "keep the k most likely tokens when sampling; 0 = off")
    top_p: float = arg(1.0, "nucleus sampling mass; 1.0 = off")
    eval_batch_size: int = arg(100, "prompts per generation batch in evaluation")


@dataclass(frozen=True)
class GenerationBackendFields:
    """Which engine samples the responses (rlhflab.rollout.backends; docs/scaling-out.md "Generation backends and vLLM")."""

    generation_backend: Literal["lean", "hf", "vllm"] = arg(
        "lean", "lean = KV-cached lean decoder for Llama / Qwen2 layouts (other models: their own forward); hf = "
                "always the model's own forward with its KV cache; vllm = a vLLM engine on the same GPU, the "
                "policy's weights pushed into it before each rollout (pip install 'rlhflab[vllm]', CUDA only)")
    vllm_gpu_memory_utilization: float = arg(
        0.3, "vllm: share of the GPU's memory the vLLM engine may take (weights + KV cache); the rest is training's")
    vllm_sleep_mode: bool = arg(
        True, "vllm: put the engine to sleep between rollouts (weights to CPU, KV cache freed) so training gets "
              "that memory back")
    vllm_dtype: Literal["bfloat16", "float16", "float32", "auto"] = arg(
        "bfloat16", "vllm: the engine's weights and arithmetic, apart from --dtype (training's storage, float32 by "
                    "default, which vLLM's fast attention kernels do not take); auto = the checkpoint's")


@dataclass(frozen=True)
class CheckpointFields:
    """Checkpoints, resume and non-finite guards (rlhflab.checkpoint; docs/reading-a-run.md "Checkpoints and resume")."""

    save_every: int = arg(0, "write RUN/checkpoints/step-N every N optimiser steps (PPO: updates) and at the end; "
                             "0 = only at the end; -1 = none (only on SIGINT / SIGTERM; model/ is still written)")
    keep_last_n: int = arg(2, "complete checkpoints to keep; older ones are deleted once a newer one is complete; "
                              "0 = keep all")
    resume: str = arg("", "continue a run: 'latest' (newest complete checkpoint in --output_dir) or a "
                          "RUN/checkpoints/step-N folder; empty = start fresh")
    allow_config_change: bool = arg(False, "resume even though the config differs from the run's config.yaml, "
                                           "or what it reads (model, data, reward function files, versions) from "
                                           "RUN/fingerprints.json (the differences are recorded in summary.json)")
    nonfinite: Literal["stop", "skip"] = arg(
        "stop", "on a non-finite loss, gradient norm or advantage: stop (naming step and rows; no checkpoint "
                "after it) or skip (drop that optimiser update, count it in nonfinite/skipped_updates)")


@dataclass(frozen=True)
class ParallelFields:
    """Several processes (docs/scaling-out.md "Several processes"): launched by torchrun / accelerate launch; batch
    sizes stay global."""

    parallel_strategy: Literal["auto", "ddp", "fsdp2", "deepspeed"] = arg(
        "auto", "how several processes hold the model: ddp (a whole copy each, gradients averaged), fsdp2 (torch's "
                "fully_shard per decoder layer: weights, gradients and optimiser state sharded), deepspeed (through "
                "accelerate; the rlhflab[deepspeed] extra); auto = what an accelerate config file asked for, else ddp. "
                "One process: ignored")
    shard_frozen_models: bool = arg(True, "fsdp2: shard the frozen models (reference, reward model) like the policy "
                                          "(less memory) instead of a whole copy on every process (fewer gathers)")


@dataclass(frozen=True)
class LoraFields:
    lora_r: int = arg(0, "LoRA rank of the policy; 0 = full fine-tuning")
    lora_alpha: int = arg(16, "LoRA alpha (scale = alpha / r)")
    lora_dropout: float = arg(0.0, "LoRA dropout (kept 0 in RL: dropout makes ratio != 1 at the first step)")
    lora_target_modules: str = arg("all-linear", "modules LoRA adapts: all-linear or comma-separated names")


@dataclass(frozen=True)
class MonitorFields:
    """Training alarms and the stopping rule (rlhflab.eval.alarms / .stopping; docs/reading-a-run.md "Alarms and stopping")."""

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
