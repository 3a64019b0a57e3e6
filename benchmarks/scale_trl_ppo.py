"""One TRL 1.12 PPO run of benchmarks/scale.py, in its own process and benchmarks/.venv-trl.

    benchmarks/.venv-trl/bin/python benchmarks/scale_trl_ppo.py --spec SPEC.json

Imports nothing of rlhflab: policy, reward model and value model are HF folders, the prompts token ids (checked
against the rlhflab side's). TRL's PPOTrainer (trl.experimental.ppo) has its own train loop, so:
- gradient checkpointing: the trainer never turns it on itself (FACTS.md: it ignores the flag), so this child calls
  gradient_checkpointing_enable(use_reentrant=False) on the policy and the value model when the row asks for it;
- bf16: TRL builds its Accelerator without a mixed_precision argument; if that Accelerator comes out without
  bf16 although the row asks for it, the child wraps trainer.train() in torch.autocast("cpu", bfloat16) (every
  forward, generation included, like rlhflab's --bf16) and says so in its JSON ("bf16_by").
Prints one JSON line: peak RSS (VmHWM right after train()), per update the seconds of the update, of generation
(batch_generation) and of "scoring": from the end of generation to the update's first forward with gradients
(reference, value and reward forwards, log-probs, rewards, GAE, TRL's gc.collect there); training is the rest.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported (FACTS.md)
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from peak_rss import rss_mib  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", required=True)
    spec = json.loads(Path(parser.parse_args().spec).read_text())
    import torch
    import trl
    from datasets import Dataset
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedTokenizerFast,
                              TrainerCallback)
    from trl.experimental.ppo import PPOConfig, PPOTrainer, ppo_trainer

    torch.set_num_threads(spec["threads"])
    row, s, p = spec["row"], spec["settings"], spec["ppo"]
    before = rss_mib()
    t0 = time.time()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(spec["model"], padding_side="left")
    assert tokenizer.pad_token_id != tokenizer.eos_token_id, "TRL PPO needs pad != eos"
    prompts = [json.loads(line)["prompt"] for line in Path(spec["prompts"]).read_text().splitlines() if line.strip()]
    ids = tokenizer(prompts)["input_ids"]
    assert ids == json.loads(Path(spec["prompt_ids"]).read_text()), "TRL's prompt ids differ from rlhflab's"
    policy = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(spec["reward_model"], num_labels=1,
                                                                dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(spec["value_model"], num_labels=1, dtype=torch.float32)
    if row["gc"]:
        for model in (policy, value):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
    batch = p["prompts"]
    config = PPOConfig(
        output_dir=str(Path(spec["out"]) / "trl"), report_to="none", save_strategy="no", use_cpu=True,
        disable_tqdm=True, seed=spec["seed"], per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        local_rollout_forward_batch_size=batch, num_mini_batches=p["num_mini_batches"],
        num_ppo_epochs=p["num_ppo_epochs"], total_episodes=batch * spec["updates"],
        response_length=row["new_tokens"], temperature=s["temperature"], stop_token="eos", missing_eos_penalty=None,
        learning_rate=s["learning_rate"], adam_beta1=s["adam_beta1"], adam_beta2=s["adam_beta2"],
        adam_epsilon=s["adam_eps"], weight_decay=s["weight_decay"], max_grad_norm=s["max_grad_norm"],
        lr_scheduler_type=s["lr_schedule"], warmup_steps=0, kl_coef=p["kl_coef"], kl_estimator=p["kl_estimator"],
        cliprange=p["cliprange"], cliprange_value=p["cliprange_value"], vf_coef=p["vf_coef"], gamma=p["gamma"],
        lam=p["lam"], whiten_rewards=False, num_sample_generations=0, logging_steps=1, bf16=row["bf16"], fp16=False,
        gradient_checkpointing=row["gc"], gradient_checkpointing_kwargs={"use_reentrant": False} if row["gc"] else None,
    )
    train = Dataset.from_dict({"input_ids": ids})
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=reference,
                         reward_model=reward, train_dataset=train, value_model=value,
                         eval_dataset=train.select(range(batch)))
    clock = {"generation": 0.0, "scoring": 0.0, "generation_end": 0.0, "training_start": None}
    lengths: list[float] = []
    generate, forward = ppo_trainer.batch_generation, ppo_trainer.forward

    def timed_generation(*args, **kwargs):
        started = time.time()
        out = generate(*args, **kwargs)
        clock["generation"] += time.time() - started
        clock["generation_end"] = time.time()
        query_responses, queries = out[0], args[1]
        lengths.append(float(query_responses.shape[1] - queries.shape[1]))  # no EOS: every answer is this long
        return out

    def first_training_forward(*args, **kwargs):
        """scoring = from the end of generation to the update's first forward with gradients: the no-grad
        forwards (reference, value, reward), log-probs from the generation scores, rewards, GAE, whitening."""
        if torch.is_grad_enabled() and clock.get("training_start") is None:
            clock["training_start"] = time.time()
            clock["scoring"] += clock["training_start"] - clock["generation_end"]
        return forward(*args, **kwargs)

    ppo_trainer.batch_generation = timed_generation
    ppo_trainer.forward = first_training_forward
    steps: list[dict] = []

    class UpdateClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.started, self.before = time.time(), dict(clock)

        def on_step_end(self, args, state, control, **kwargs):
            total = time.time() - self.started
            gen = clock["generation"] - self.before["generation"]
            score = clock["scoring"] - self.before["scoring"]
            steps.append({"total": total, "generation": gen, "scoring": score, "training": total - gen - score,
                          "mean_length": lengths[-1] if lengths else None})
            self.started, self.before = time.time(), dict(clock)
            clock["training_start"] = None

    trainer.add_callback(UpdateClock())
    bf16_by = "accelerate" if str(trainer.accelerator.mixed_precision) == "bf16" else None
    autocast = contextlib.nullcontext()
    if row["bf16"] and bf16_by is None:
        bf16_by = "torch.autocast around train() (the trainer's Accelerator has no bf16)"
        autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    t1 = time.time()
    with autocast:
        trainer.train()
    t2 = time.time()
    peak = rss_mib()
    print(json.dumps({"library": "trl", "trl_version": trl.__version__, "peak_rss_mib": peak,
                      "rss_before_models_mib": before, "setup_seconds": t1 - t0, "train_seconds": t2 - t1,
                      "updates": steps, "threads": torch.get_num_threads(), "bf16_by": bf16_by,
                      "mixed_precision": str(trainer.accelerator.mixed_precision),
                      "gradient_checkpointing": bool(policy.is_gradient_checkpointing)}))


if __name__ == "__main__":
    main()
