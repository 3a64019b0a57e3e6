"""One TRL 1.12 PPO run, in its own process and its own virtualenv (driven by ppo_vs_trl.py).

    benchmarks/.venv-trl/bin/python benchmarks/trl_child.py --spec SPEC.json

Imports neither rlhflab nor anything outside the TRL virtualenv: the models are
ordinary HF folders and the prompts are token ids in a JSON file. The spec holds
the settings shared with the rlhflab side (see `ppo_vs_trl.shared_settings`).
Prints one JSON line: wall time of `trainer.train()`, response tokens, peak RSS.
With `"no_gc": true` every `gc.collect()` in this process is a no-op (TRL's PPO
loop calls it twice per update; FACTS.md: about half its wall time).

Probes (`"trl_probes"` in the spec, issue 16 item 6): TRL's own loop with one piece done
rlhflab's way, to find which piece changes learning per episode (`PROBES` below). The
`sampler` probe and the checker reward import `rlhflab` (the one on PYTHONPATH, else this
repository's `src/`: pure torch / transformers code; the TRL virtualenv has the same versions).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported (FACTS.md)

import argparse  # noqa: E402
import gc  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from peak_rss import rss_mib  # noqa: E402

REPO_SRC = Path(__file__).resolve().parent.parent / "src"


def rlhflab_importable() -> None:
    """For the probes that run rlhflab code: the one on PYTHONPATH (e.g. a frozen copy of a commit's src/,
    the rlhflab side's), else this repository's src/."""
    import importlib.util

    if importlib.util.find_spec("rlhflab") is None:
        sys.path.insert(0, str(REPO_SRC))




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


# --- probes: TRL's loop with one piece done rlhflab's way -------------------------------------


def edit_train(edits: list[tuple[str, str]]) -> None:
    """Replace `PPOTrainer.train` by its own source with `edits` applied (old -> new, each found exactly once)."""
    from trl.experimental.ppo import ppo_trainer

    source = textwrap.dedent(inspect.getsource(ppo_trainer.PPOTrainer.train))
    for old, new in edits:
        if source.count(old) != 1:
            raise RuntimeError(f"PPOTrainer.train holds {source.count(old)} copies of {old!r} (written for trl 1.12.0)")
        source = source.replace(old, new)
    defined: dict = {}
    exec(compile(source, "<PPOTrainer.train, probed>", "exec"), ppo_trainer.__dict__, defined)
    ppo_trainer.PPOTrainer.train = defined["train"]


# rlhflab puts the score on the last real token (EOS) and trains / bootstraps values up to it;
# TRL puts it one position later (a padding position, or the last one when the response was cut)
# and trains values there too
SCORE_AT_EOS = [("padding_mask_p1 = response_idxs > (sequence_lengths_p1.unsqueeze(1))", "padding_mask_p1 = padding_mask"),
                ("actual_end = torch.where(sequence_lengths_p1 < rewards.size(1), sequence_lengths_p1, sequence_lengths)",
                 "actual_end = sequence_lengths")]
# the reward call goes through `score_rows` (set by install_scoring) instead of `get_reward`
SCORE_HOOK = [("_, score, _ = get_reward(", "score = score_rows(query, postprocessed_response, processing_class, ")]


def response_texts(tokenizer, responses) -> list[str]:
    """Each response's text without its EOS and what follows (rlhflab's decode_responses)."""
    eos = tokenizer.eos_token_id
    texts = []
    for ids in responses.tolist():
        kept = ids[: ids.index(eos)] if eos in ids else ids
        texts.append(tokenizer.decode([t for t in kept if t != tokenizer.pad_token_id], skip_special_tokens=True))
    return texts


def rescored(query, response, tokenizer, reward_model, query_response, pad_id, context_length):
    """rlhflab's reward-model scoring: the response decoded to text, re-tokenised, EOS appended (also
    to a response the length cap cut), score read at that EOS."""
    import torch
    from trl.experimental.utils import get_reward

    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            for t in response_texts(tokenizer, response)]
    width = max(map(len, rows))
    ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], dtype=query.dtype)
    return get_reward(reward_model, torch.cat([query, ids], dim=1), pad_id, context_length)[1]


def checker_scoring(spec: dict):
    """The suite's checker as the reward (1 pass, 0 fail) on each response's text, as rlhflab's
    `--reward checker`; prompts are known by their token ids (the spec's `prompt_items`)."""
    rlhflab_importable()
    from rlhflab.tasks import TaskItem, check

    import torch

    prompts = json.loads(Path(spec["prompts"]).read_text())
    items = [TaskItem(i["family"], i["prompt"], i["reference"], tuple(i["content"]))
             for i in json.loads(Path(spec["prompt_items"]).read_text())]
    by_ids = {tuple(ids): item for ids, item in zip(prompts, items)}

    def score(query, response, tokenizer, reward_model, query_response, pad_id, context_length):
        keys = [tuple(t for t in q if t != pad_id) for q in query.tolist()]
        texts = response_texts(tokenizer, response)
        return torch.tensor([float(check(by_ids[k], t).passed) for k, t in zip(keys, texts)])

    return score


def rlhflab_sampler(seed: int, eos_id: int, temperature: float, response_length: int):
    """`batch_generation` replaced by rlhflab's rollout sampling: its KV decoder and exponential-race sampler
    on a torch.Generator of its own (seed ^ 0x5EED5EED; TRL samples from the global RNG), then the old
    log-probs' logits from one forward over the finished sequences (TRL takes them from generate()'s scores)."""
    rlhflab_importable()
    import torch
    from rlhflab.rollout.generate import GenerationSettings, generate
    from trl.experimental.ppo.ppo_trainer import forward

    generator = torch.Generator().manual_seed(seed ^ 0x5EED5EED)
    settings = GenerationSettings(response_length, True, temperature, top_k=0, top_p=1.0)

    @torch.no_grad()
    def batch_generation(model, queries, local_rollout_forward_batch_size, pad_token_id, generation_config):
        prompts = [[t for t in q if t != pad_token_id] for q in queries.tolist()]
        out = generate(model, prompts, pad_id=pad_token_id, eos_id=eos_id, settings=settings, generator=generator)
        assert torch.equal(out.query_ids, queries), "rlhflab's left padding differs from TRL's collator"
        query_responses = torch.cat([queries, out.response_ids], dim=1)
        context = queries.shape[1]
        logits = forward(model, query_responses, pad_token_id).logits[:, context - 1 : -1]
        return query_responses, logits / (temperature + 1e-7)

    return batch_generation


def install_probes(spec: dict) -> None:
    """What the spec's `trl_probes` and `reward` ask of TRL's module (before the trainer is built);
    `shared_trunk` is applied in build_trainer."""
    from trl.experimental.ppo import ppo_trainer

    probes, s = set(spec.get("trl_probes", [])), spec["settings"]
    unknown = probes - set(PROBES)
    if unknown:
        raise SystemExit(f"unknown TRL probes {sorted(unknown)}; known: {sorted(PROBES)}")
    edits = SCORE_AT_EOS if "score_at_eos" in probes else []
    checker = spec.get("reward", "model") == "checker"
    if checker or "rescore" in probes:
        ppo_trainer.score_rows = checker_scoring(spec) if checker else rescored
        edits = edits + SCORE_HOOK
    if edits:
        edit_train(edits)
    if "sampler" in probes:
        from transformers import AutoTokenizer

        eos = AutoTokenizer.from_pretrained(spec["sft"]).eos_token_id
        ppo_trainer.batch_generation = rlhflab_sampler(spec["seed"], eos, s["temperature"], s["response_length"])


def zero_value_head(value):
    """The value model's own `score` layer (bias-free, normal(0, 0.02) in TRL's asset) zeroed in place: V = 0 at
    the start, as rlhflab's fresh heads; nothing else changes."""
    import torch

    torch.nn.init.zeros_(value.score.weight)
    return value


def value_head_on_trunk(value, policy):
    """rlhflab's `value_mode=shared`: the value reads the policy's own trunk through rlhflab's fresh head, a
    zero linear layer with a bias (models/value.py ValueHead); TRL's wrapper then trains the trunk with both
    losses."""
    import torch

    value.model = policy.model
    value.score = torch.nn.Linear(policy.config.hidden_size, 1)
    torch.nn.init.zeros_(value.score.weight)
    torch.nn.init.zeros_(value.score.bias)
    return value


PROBES = {
    "score_at_eos": "score on the EOS token, values trained and bootstrapped up to it (not one position later)",
    "shared_trunk": "value head on the policy's trunk, zero-initialised (rlhflab's value_mode=shared)",
    "zero_value_head": "the value model's own bias-free score layer zeroed in place (V = 0 at the start)",
    "sampler": "rlhflab's sampler: its KV decoder and own generator; old log-probs from a forward",
    "rescore": "rlhflab's RM scoring: decoded text re-tokenised, EOS appended",
}


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
    if "shared_trunk" in spec.get("trl_probes", []):
        value = value_head_on_trunk(value, policy)
    elif "zero_value_head" in spec.get("trl_probes", []):
        value = zero_value_head(value)
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
    install_probes(spec)
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
