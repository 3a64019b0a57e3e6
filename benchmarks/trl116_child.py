"""One TRL 1.16 GRPO / RLOO / DPO run, in its own process and its own virtualenv (driven by methods_vs_trl.py).

    benchmarks/.venv-trl116/bin/python benchmarks/trl116_child.py --spec SPEC.json

The models are ordinary HF folders and the data is a JSONL file written by the rlhflab side
(prompts with the suite's `family` / `reference` / `content` columns, or preference pairs).
The reward of GRPO and RLOO is the suite's exact checker, `rlhflab.tasks.check`: that package
is pure Python (no torch), so it is imported from the repository's `src/` (the spec's
`rlhflab_src`) and nothing else of rlhflab is. Prints one JSON line: wall and CPU time of
`trainer.train()`, what it produced (completions, completion tokens, pairs), time in
generation, peak RSS.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported (FACTS.md)
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # TRL's trainers ping the hub at __init__ otherwise

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from peak_rss import rss_mib  # noqa: E402


def checker_reward(counter: dict):
    """The suite's checker as a TRL reward function: 1.0 when the completion is the reference, else 0.0.

    Also counts what the run produced (TRL calls it once per generation batch, with every completion)."""
    from rlhflab.tasks import TaskItem, check

    def suite_checker(prompts, completions, completion_ids, family, reference, content, **_):
        counter["completions"] += len(completions)
        counter["completion_tokens"] += sum(len(ids) for ids in completion_ids)
        return [1.0 if check(TaskItem(f, p, r, tuple(c or ())), text).passed else 0.0
                for p, text, f, r, c in zip(prompts, completions, family, reference, content)]

    return suite_checker


def read_jsonl(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def common_args(spec: dict, out: Path) -> dict:
    """TrainingArguments fields every method sets the same way (and the rlhflab side matches)."""
    s = spec["settings"]
    return dict(
        output_dir=str(out / "trl"), report_to="none", save_strategy="no", eval_strategy="no", use_cpu=True,
        disable_tqdm=True, seed=spec["seed"], max_steps=s["max_steps"], per_device_train_batch_size=s["batch_size"],
        gradient_accumulation_steps=1, learning_rate=s["learning_rate"], lr_scheduler_type=s["lr_schedule"],
        warmup_steps=0, weight_decay=0.0, adam_beta1=s["adam_beta1"], adam_beta2=s["adam_beta2"],
        adam_epsilon=s["adam_eps"], max_grad_norm=s["max_grad_norm"], logging_steps=s["log_every"],
        # TRL's base config defaults are gradient checkpointing on and bf16 on; rlhflab trains float32 without
        # checkpointing on CPU, so both are off (which also makes TRL faster, not slower)
        gradient_checkpointing=False, bf16=False, dataloader_num_workers=0,
    )


def online_args(spec: dict, out: Path) -> dict:
    s = spec["settings"]
    return dict(
        **common_args(spec, out), num_generations=s["num_generations"], max_completion_length=s["response_length"],
        temperature=s["temperature"], top_k=0, top_p=1.0, beta=s["beta"], num_iterations=s["num_iterations"],
        epsilon=s["epsilon"], epsilon_high=s["epsilon_high"] or None, mask_truncated_completions=False,
        **spec.get("trl_options", {}),
    )


def build_grpo(spec: dict, out: Path, policy, tokenizer, counter: dict):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    s = spec["settings"]
    config = GRPOConfig(**online_args(spec, out), loss_type=s["loss_type"], scale_rewards=s["scale_rewards"],
                        importance_sampling_level=s["importance_sampling_level"])
    train = Dataset.from_list(read_jsonl(spec["data"]))
    return GRPOTrainer(model=policy, reward_funcs=checker_reward(counter), args=config, train_dataset=train,
                       processing_class=tokenizer)


def build_rloo(spec: dict, out: Path, policy, tokenizer, counter: dict):
    from datasets import Dataset
    from trl import RLOOConfig, RLOOTrainer

    s = spec["settings"]
    config = RLOOConfig(**online_args(spec, out), normalize_advantages=s["normalize_advantages"])
    train = Dataset.from_list(read_jsonl(spec["data"]))
    return RLOOTrainer(model=policy, reward_funcs=checker_reward(counter), args=config, train_dataset=train,
                       processing_class=tokenizer)


def build_dpo(spec: dict, out: Path, policy, tokenizer, counter: dict):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    s = spec["settings"]
    config = DPOConfig(**common_args(spec, out), beta=s["beta"], loss_type=[s["loss_type"]],
                       label_smoothing=s["label_smoothing"], max_length=None, dataset_num_proc=None,
                       **spec.get("trl_options", {}))
    rows = [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in read_jsonl(spec["data"])]
    return DPOTrainer(model=policy, args=config, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)


BUILDERS = {"grpo": build_grpo, "rloo": build_rloo, "dpo": build_dpo}


def time_generation(trainer, counter: dict) -> None:
    """Wrap the trainer's one-turn generation to time it (GRPO and RLOO)."""
    if not hasattr(trainer, "_generate_single_turn"):
        return
    generate = trainer._generate_single_turn

    def timed(*args, **kwargs):
        started = time.time()
        result = generate(*args, **kwargs)
        counter["generation_seconds"] += time.time() - started
        return result

    trainer._generate_single_turn = timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", required=True)
    spec = json.loads(Path(parser.parse_args().spec).read_text())
    sys.path.insert(0, spec["rlhflab_src"])  # only for rlhflab.tasks (pure Python)
    out = Path(spec["out"])
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(spec["threads"])
    before = rss_mib()
    counter = {"completions": 0, "completion_tokens": 0, "generation_seconds": 0.0}
    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(spec["model"], padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    trainer = BUILDERS[spec["method"]](spec, out, policy, tokenizer, counter)
    time_generation(trainer, counter)
    t1, cpu = time.time(), time.process_time()
    trainer.train()
    t2, cpu = time.time(), time.process_time() - cpu
    logs = [row for row in trainer.state.log_history if "loss" in row]
    s = spec["settings"]
    print(json.dumps({"library": "trl", "seconds": t2 - t1, "cpu_seconds": cpu, "setup_seconds": t1 - t0,
                      "optimizer_steps": trainer.state.global_step,
                      # GRPO / RLOO count prompt + completion tokens of every generation batch here
                      "prompt_tokens": trainer.state.num_input_tokens_seen - counter["completion_tokens"],
                      "pairs": trainer.state.global_step * s["batch_size"] if spec["method"] == "dpo" else 0,
                      "peak_rss_mib": rss_mib(), "rss_before_models_mib": before,
                      "threads": torch.get_num_threads(), "last_log": logs[-1] if logs else {},
                      "loadavg_1min_after": os.getloadavg()[0], **counter}))


if __name__ == "__main__":
    main()
