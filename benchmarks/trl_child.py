"""One TRL 1.12 PPO run, in its own process and its own virtualenv (driven by ppo_vs_trl.py).

    benchmarks/.venv-trl/bin/python benchmarks/trl_child.py --spec SPEC.json

Imports neither rlhflab nor anything outside the TRL virtualenv: the models are
ordinary HF folders and the prompts are token ids in a JSON file. The spec holds
the settings shared with the rlhflab side (see `ppo_vs_trl.shared_settings`).
Prints one JSON line: wall time of `trainer.train()`, response tokens, peak RSS.
With `"no_gc": true` every `gc.collect()` in this process is a no-op (TRL's PPO
loop calls it twice per update; FACTS.md: about half its wall time).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported (FACTS.md)

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from peak_rss import rss_mib  # noqa: E402




def count_response_tokens(counter: dict) -> None:
    """Wrap TRL's `truncate_response` to count real response tokens (up to and including EOS),
    and its `batch_generation` to time generation."""
    from trl.experimental.ppo import ppo_trainer

    original = ppo_trainer.truncate_response

    def counting(stop_token_id, pad_token_id, responses):
        out = original(stop_token_id, pad_token_id, responses)
        counter["response_tokens"] += int((out != pad_token_id).sum())
        counter["generated_tokens"] += out.numel()  # what generate() produced, padding after EOS included
        return out

    ppo_trainer.truncate_response = counting
    generate = ppo_trainer.batch_generation

    def timed_generation(*args, **kwargs):
        started = time.time()
        out = generate(*args, **kwargs)
        counter["generation_seconds"] += time.time() - started
        return out

    ppo_trainer.batch_generation = timed_generation


def build_trainer(spec: dict, out: Path):
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    s = spec["settings"]
    tokenizer = AutoTokenizer.from_pretrained(spec["sft"], padding_side="left")
    assert tokenizer.pad_token_id != tokenizer.eos_token_id, "TRL PPO needs pad != eos"
    policy = AutoModelForCausalLM.from_pretrained(spec["sft"], dtype=torch.float32)
    lora = s["lora_r"] > 0
    reference = None if lora else AutoModelForCausalLM.from_pretrained(spec["sft"], dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(spec["reward_model"], num_labels=1)
    value = AutoModelForSequenceClassification.from_pretrained(spec["value_model"], num_labels=1)
    prompts = json.loads(Path(spec["prompts"]).read_text())
    train = Dataset.from_dict({"input_ids": prompts})
    config = PPOConfig(
        output_dir=str(out / "trl"), report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
        seed=spec["seed"], per_device_train_batch_size=s["batch_size"], gradient_accumulation_steps=1,
        local_rollout_forward_batch_size=s["batch_size"], num_mini_batches=s["num_mini_batches"],
        num_ppo_epochs=s["num_ppo_epochs"], total_episodes=s["total_episodes"],
        response_length=s["response_length"], temperature=s["temperature"], stop_token="eos",
        missing_eos_penalty=s["missing_eos_penalty"], learning_rate=s["learning_rate"],
        adam_beta1=s["adam_beta1"], adam_beta2=s["adam_beta2"], adam_epsilon=s["adam_eps"], weight_decay=0.0,
        lr_scheduler_type="linear", warmup_steps=0, kl_coef=s["kl_coef"], kl_estimator="k1",
        cliprange=s["cliprange"], cliprange_value=s["cliprange_value"], vf_coef=s["vf_coef"],
        gamma=s["gamma"], lam=s["lam"], whiten_rewards=False, num_sample_generations=0, logging_steps=1000,
    )
    peft_config = None
    if lora:
        peft_config = LoraConfig(r=s["lora_r"], lora_alpha=s["lora_alpha"], lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=reference,
                         reward_model=reward, train_dataset=train, value_model=value,
                         eval_dataset=train.select(range(s["batch_size"])), peft_config=peft_config)
    return trainer, tokenizer


def save_policy(trainer, tokenizer, folder: Path) -> None:
    """The trained policy as a plain HF folder (LoRA merged), for the held-out evaluation."""
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    if hasattr(policy, "merge_and_unload"):
        policy = policy.merge_and_unload()
    policy.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", required=True)
    spec = json.loads(Path(parser.parse_args().spec).read_text())
    out = Path(spec["out"])
    if spec["no_gc"]:
        gc.collect = lambda generation=2: 0  # TRL calls gc.collect() through the module attribute
    import torch

    torch.set_num_threads(spec["threads"])
    before = rss_mib()
    counter = {"response_tokens": 0, "generated_tokens": 0, "generation_seconds": 0.0}
    count_response_tokens(counter)
    t0 = time.time()
    trainer, tokenizer = build_trainer(spec, out)
    t1 = time.time()
    trainer.train()
    t2 = time.time()
    peak = rss_mib()
    if spec.get("save_model", True):
        save_policy(trainer, tokenizer, out / "model")
    print(json.dumps({"library": "trl", "seconds": t2 - t1, "setup_seconds": t1 - t0,
                      "episodes": trainer.state.episode, "peak_rss_mib": peak, "rss_before_models_mib": before,
                      "peak_rss_after_save_mib": rss_mib(),
                      "threads": torch.get_num_threads(), "model_dir": str(out / "model"),
                      "loadavg_1min_after": os.getloadavg()[0], **counter}))


if __name__ == "__main__":
    main()
