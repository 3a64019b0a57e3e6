"""One TRL 1.16 GRPO run of benchmarks/scale.py, in its own process and benchmarks/.venv-trl116.

    benchmarks/.venv-trl116/bin/python benchmarks/scale_trl_grpo.py --spec SPEC.json

Imports nothing of rlhflab: the model is an HF folder, the prompts a JSONL file, the reward the stdlib-only
benchmarks/scale_reward.py (the function the rlhflab side gets with --reward_fn). The tokenizer is loaded as
PreTrainedTokenizerFast (AutoTokenizer would build Qwen2Tokenizer for a Qwen2 config, FACTS.md) and its ids are
checked against the ones the rlhflab side uses. Prints one JSON line: the peak RSS (VmHWM right after
trainer.train()) and per optimiser step the seconds of the step, of generation (_generate_single_turn) and of
_generate_and_score_completions (generation + decoding + rewards + reference forward).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported (FACTS.md)
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from peak_rss import rss_mib  # noqa: E402


def load_function(path: str, name: str):
    spec = importlib.util.spec_from_file_location("scale_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def timed(owner, name: str, clock: dict, key: str) -> None:
    """Wrap owner.name to add its seconds to clock[key] (nested calls are not double-counted)."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        started = time.time()
        try:
            return original(*args, **kwargs)
        finally:
            clock[key] += time.time() - started

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", required=True)
    spec = json.loads(Path(parser.parse_args().spec).read_text())
    import torch
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(spec["threads"])
    row, s, g = spec["row"], spec["settings"], spec["grpo"]
    before = rss_mib()
    t0 = time.time()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(spec["model"], padding_side="left")
    prompts = [json.loads(line)["prompt"] for line in Path(spec["prompts"]).read_text().splitlines() if line.strip()]
    expected = json.loads(Path(spec["prompt_ids"]).read_text())
    assert tokenizer(prompts)["input_ids"] == expected, "TRL's tokenizer gives other prompt ids than rlhflab's"
    auto = AutoTokenizer.from_pretrained(spec["model"])
    auto_same = auto(prompts[:4])["input_ids"] == expected[:4]
    policy = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    batch = g["prompts"] * g["num_generations"]
    config = GRPOConfig(
        output_dir=str(Path(spec["out"]) / "trl"), report_to="none", save_strategy="no", eval_strategy="no",
        use_cpu=True, disable_tqdm=True, seed=spec["seed"], max_steps=spec["updates"], logging_steps=1,
        per_device_train_batch_size=batch, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=g["num_generations"], max_completion_length=row["new_tokens"],
        learning_rate=s["learning_rate"], lr_scheduler_type=s["lr_schedule"], warmup_steps=0,
        weight_decay=s["weight_decay"], adam_beta1=s["adam_beta1"], adam_beta2=s["adam_beta2"],
        adam_epsilon=s["adam_eps"], max_grad_norm=s["max_grad_norm"], temperature=s["temperature"], top_k=0,
        top_p=1.0, beta=g["beta"], num_iterations=g["num_iterations"], epsilon=g["epsilon"], epsilon_high=None,
        loss_type=g["loss_type"], scale_rewards=g["scale_rewards"],
        importance_sampling_level=g["importance_sampling_level"],
        mask_truncated_completions=False,  # every answer runs to the cap (no EOS): masking would drop them all
        use_bias_correction_kl=False,  # rlhflab's k3 term has no ratio factor
        vllm_importance_sampling_correction=False, use_vllm=False, use_liger_kernel=False,
        bf16=row["bf16"], fp16=False, gradient_checkpointing=row["gc"],
        gradient_checkpointing_kwargs={"use_reentrant": False} if row["gc"] else None,
        dataloader_num_workers=0, log_completions=False,
    )
    peft_config = None
    if row["lora"]:
        peft_config = LoraConfig(r=s["lora_r"], lora_alpha=s["lora_alpha"], lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
    train = Dataset.from_list([{"prompt": p} for p in prompts])
    trainer = GRPOTrainer(model=policy, reward_funcs=load_function(spec["reward_fn"], "length_reward"), args=config,
                          train_dataset=train, processing_class=tokenizer, peft_config=peft_config)
    clock = {"generation": 0.0, "generate_and_score": 0.0}
    timed(trainer, "_generate_single_turn", clock, "generation")
    timed(trainer, "_generate_and_score_completions", clock, "generate_and_score")
    lengths: list[float] = []
    original_reward = trainer.reward_funcs[0]

    steps: list[dict] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.time()
            self.before = dict(clock)

        def on_step_end(self, args, state, control, **kwargs):
            total = time.time() - self.started
            gen = clock["generation"] - self.before["generation"]
            gen_score = clock["generate_and_score"] - self.before["generate_and_score"]
            steps.append({"total": total, "generation": gen, "scoring": gen_score - gen,
                          "training": total - gen_score, "mean_length": lengths[-1] if lengths else None})

    def reward_with_lengths(prompts, completions, completion_ids, **kwargs):
        lengths.append(sum(map(len, completion_ids)) / len(completion_ids))
        return original_reward(prompts, completions, completion_ids=completion_ids, **kwargs)

    reward_with_lengths.__name__ = original_reward.__name__
    trainer.reward_funcs[0] = reward_with_lengths
    trainer.add_callback(StepClock())
    t1 = time.time()
    trainer.train()
    t2 = time.time()
    peak = rss_mib()
    print(json.dumps({"library": "trl", "trl_version": trl.__version__, "peak_rss_mib": peak,
                      "rss_before_models_mib": before, "setup_seconds": t1 - t0, "train_seconds": t2 - t1,
                      "updates": steps, "threads": torch.get_num_threads(),
                      "autotokenizer": f"{type(auto).__name__} ({'same' if auto_same else 'OTHER'} ids)",
                      "mixed_precision": str(trainer.accelerator.mixed_precision),
                      "gradient_checkpointing": bool(getattr(trainer.model, "is_gradient_checkpointing", False)),
                      "last_log": [r for r in trainer.state.log_history if "loss" in r][-1:]}))


if __name__ == "__main__":
    main()
