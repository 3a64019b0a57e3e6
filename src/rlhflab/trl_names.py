"""TRL's flag names and their rlhflab counterparts, for hints on unknown flags and YAML keys.

`rlhflab ppo --sft_model_path X` fails with "did you mean --model? (TRL's --sft_model_path is
rlhflab's --model)": `rlhflab.config` reads this table when a name is unknown. docs/coming-from-trl.md
explains each mapping at length; this table holds the one-line version.

Names come from TRL 1.12: `PPOConfig` (trl/experimental/ppo/ppo_config.py), `ScriptArguments`
(trl/scripts/utils.py), `ModelConfig` (trl/trainer/model_config.py), the transformers
`TrainingArguments` those scripts parse, and the GRPO script's reward flags. Names rlhflab spells
the same way (`--learning_rate`, `--num_mini_batches`, `--kl_coef`, ...) are not listed: they are
never unknown; where their meaning differs docs/coming-from-trl.md says so.

Pure data with no rlhflab imports, so it sits at layer 0 and `config` (layer 1) can read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Counterpart:
    fields: tuple[str, ...]  # rlhflab fields, in order of preference; the first one a stage has is suggested
    note: str = ""  # a rename: more about the field; otherwise: how to compute its value, or why there is none
    rename: bool = True  # False: the value is not carried over as is (a computation, or no counterpart at all)


def _to(*fields: str, note: str = "") -> Counterpart:
    """The same setting under another name (the note, if any, adds what to know)."""
    return Counterpart(fields, note)


def _computed(*fields: str, note: str) -> Counterpart:
    """A TRL flag whose rlhflab counterpart takes a different value; the note says how to get it."""
    return Counterpart(fields, note, rename=False)


def _none(note: str) -> Counterpart:
    """A TRL flag with no rlhflab equivalent; the note says why and what to do instead."""
    return Counterpart((), note, rename=False)


TRL_NAMES: dict[str, Counterpart] = {
    # ScriptArguments (data)
    "dataset_name": _to("train_file", "prompts_file",
                        note="a hub name, a JSONL or Parquet file, or a save_to_disk folder"),
    "dataset_train_split": _to("dataset_split"),
    "dataset_test_split": _to("validation_file", note="validation prompts come from their own file or name "
                                                      "(TRL's PPO example ignores this flag and holds out the "
                                                      "last 100 training rows)"),
    "dataset_streaming": _none("datasets are loaded whole"),
    "dataset_num_proc": _none("prompts are tokenised in one process"),
    "reward_funcs": _to("reward_fn", note="FILE.py:NAME or package.module:NAME (TRL: package.module.NAME), "
                                          "several comma-separated, weighted with --reward_weights"),
    "reward_model_name_or_path": _to("reward_model"),
    # PPOConfig
    "sft_model_path": _to("model", "policy"),
    "reward_model_path": _to("reward_model", note="TRL's example also starts the value model from it: "
                                                  "--value_mode separate --value_model PATH"),
    "per_device_train_batch_size": _computed(
        "batch_size", note="rlhflab's --batch_size is the global batch of one update (for PPO the prompts of one "
                           "rollout) = per_device_train_batch_size x gradient_accumulation_steps x GPUs in TRL; "
                           "rlhflab's --gradient_accumulation_steps then cuts it into micro-batches"),
    "local_rollout_forward_batch_size": _none("a rollout's --batch_size prompts are generated and run through the "
                                              "policy, reference and value in one batch; lower --batch_size to use "
                                              "less memory there"),
    "stop_token": _none("responses always stop at the tokenizer's EOS and everything after it is masked "
                        "(TRL's --stop_token eos)"),
    "stop_token_id": _none("responses always stop at the tokenizer's EOS (TRL's --stop_token eos)"),
    "num_sample_generations": _computed("eval_every", note="rlhflab writes validation answers to samples.jsonl "
                                                           "every --eval_every updates, so use updates / "
                                                           "num_sample_generations"),
    "ds3_gather_for_generation": _none("rlhflab runs in one process, without DeepSpeed"),
    "model_adapter_name": _none("the LoRA adapter is created by rlhflab (--lora_r)"),
    "ref_adapter_name": _none("with LoRA the reference is the base with the adapter switched off"),
    "beta": _to("kl_coef", note="TRL's GRPO, RLOO and DPO call the KL coefficient beta"),
    "max_completion_length": _to("response_length", "max_new_tokens"),
    "max_prompt_length": _to("max_prompt_tokens"),
    # ModelConfig
    "model_name_or_path": _to("model", "policy", note="in TRL's PPO example it names only the tokenizer (the "
                                                      "policy is --sft_model_path); rlhflab's --tokenizer defaults "
                                                      "to the model's own"),
    "use_peft": _computed("lora_r", note="rlhflab's LoRA is on when --lora_r > 0 (TRL's defaults: r 16, alpha "
                                         "32, dropout 0.05; rlhflab's dropout stays 0 in RL so the first ratio is "
                                         "exactly 1)"),
    "torch_dtype": _to("dtype"),
    "load_in_4bit": _none("quantised bases are not supported; use --dtype bfloat16 with --lora_r"),
    "load_in_8bit": _none("quantised bases are not supported; use --dtype bfloat16 with --lora_r"),
    "attn_implementation": _none("Llama / Qwen2 layouts run rlhflab's lean forward, others their own"),
    "model_revision": _none("pass a local folder or the hub id of the revision you want"),
    # TrainingArguments
    "num_train_epochs": _computed("num_epochs", "total_episodes", "max_steps",
                                  note="rm: --num_epochs; ppo: --total_episodes = epochs x prompts (what TRL's PPO "
                                       "derives when total_episodes is unset); sft: --max_steps optimiser steps"),
    "per_device_eval_batch_size": _to("eval_batch_size"),
    "lr_scheduler_type": _to("lr_schedule", note="cosine, linear or constant"),
    "warmup_ratio": _computed("warmup_steps", note="rlhflab counts warmup in optimiser steps: warmup_ratio x the "
                                                   "run's optimiser steps"),
    "adam_epsilon": _to("adam_eps"),
    "vllm_importance_sampling_mode": _to("sampler_correction", note="the same mode names; TRL turns it on with "
                                         "vllm_importance_sampling_correction, rlhflab with any mode but none"),
    "vllm_importance_sampling_correction": _computed("sampler_correction", note="a mode (e.g. sequence_mask, TRL's "
                                                     "default) turns it on, none off"),
    "vllm_importance_sampling_clip_max": _to("sampler_correction_max"),
    "vllm_importance_sampling_clip_min": _to("sampler_correction_min"),
    "vllm_importance_sampling_cap": _to("sampler_correction_max"),
    "logging_steps": _to("log_every"),
    "eval_steps": _to("eval_every"),
    "eval_strategy": _to("eval_every"),
    "save_steps": _to("save_every"),
    "save_total_limit": _to("keep_last_n"),
    "resume_from_checkpoint": _to("resume", note="'latest' or a RUN/checkpoints/step-N folder"),
    "push_to_hub": _none("upload the run's model/ folder with huggingface_hub"),
}
