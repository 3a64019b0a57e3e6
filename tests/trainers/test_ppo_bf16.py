"""PPO with a bf16 model in every memory mode (CPU): exact ratio / KL at the start, every trainable
tensor float32 and moved by one update, value alignment, and configs/ppo_lora.yaml end to end."""

import dataclasses
import json
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from online_steps import run_passes
import yaml

from rlhflab import data, models, tasks
from rlhflab.config import PPOConfig, parse_config
from rlhflab.core import kl_k1
from rlhflab.rollout import GenerationSettings
from rlhflab.rollout.rollout import collect_rollout
from rlhflab.trainers import ppo
from rlhflab.trainers.online.setup import build_roles

MODES = {
    "full": dict(),
    "full-reload": dict(reference_mode="reload"),
    "full-separate-value": dict(value_mode="separate"),
    "lora": dict(lora_r=4),
    "lora-separate-value": dict(lora_r=4, value_mode="separate"),
    "lora-value-adapter": dict(lora_r=4, value_mode="lora_adapter"),
    "lora-merged-generation": dict(lora_r=4, lora_merge_generation=True),
    "lora-value-adapter-merged-generation": dict(lora_r=4, value_mode="lora_adapter", lora_merge_generation=True),
}
CONFIG_FILE = Path(__file__).resolve().parents[2] / "configs" / "ppo_lora.yaml"


def save_model(folder, arch: str = "llama", dtype=torch.bfloat16) -> str:
    """A tiny model with the suite's tokenizer, saved in `dtype` (as hub checkpoints are saved in bf16)."""
    tokenizer = models.build_tokenizer(tasks.template_corpus(), vocab_size=256)
    model = models.build_tiny_model(tokenizer, arch=arch, hidden_size=32, num_layers=2, num_heads=4,
                                    intermediate_size=64, seed=0)
    models.save_model_folder(folder, model.to(dtype), tokenizer)
    return str(folder)


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("bf16-policy"))


@pytest.fixture(scope="module")
def fp32_dir(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("fp32-policy"), dtype=torch.float32)


def tiny_cfg(policy_dir, **overrides) -> PPOConfig:
    base = dict(model=policy_dir, dtype="bfloat16", batch_size=8, num_mini_batches=2, num_ppo_epochs=2,
                response_length=6, total_episodes=16, eval_every=0, eval_prompts=4, sample_prompts=2,
                max_new_tokens=6, num_train_prompts=22, num_validation_prompts=11, num_test_prompts=11,
                progress=False, threads=1, learning_rate=1e-3, temperature=0.9,
                value_warmup_rollouts=0)  # one update must move the policy too
    return PPOConfig(**{**base, **overrides})


def rollout_for(cfg, roles, tokenizer, n=8):
    items = tasks.build_splits(0, 22, 11, 11)["train"][:n]
    prompts = data.encode_prompts(tokenizer, [i.prompt for i in items])
    return collect_rollout(roles, prompts, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                           settings=GenerationSettings(cfg.response_length, True, cfg.temperature),
                           generator=torch.Generator().manual_seed(0))


def named_parameters(roles):
    return [(f"{i}.{n}", p) for i, m in enumerate(roles.modules()) for n, p in m.named_parameters()]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_bf16_first_step_is_exact_and_one_update_moves_every_float32_trainable_tensor(bf16_dir, mode):
    cfg = tiny_cfg(bf16_dir, **MODES[mode])
    roles, tokenizer = build_roles(cfg)
    named = named_parameters(roles)
    trainable = {id(p) for p in roles.trainable_parameters()}
    # DESIGN.md: no half-precision weight is updated in place; a LoRA base stays bf16, frozen
    assert {p.dtype for p in roles.trainable_parameters()} == {torch.float32}
    frozen = {p.dtype for _, p in named if id(p) not in trainable}
    assert frozen == ({torch.bfloat16} if cfg.lora_r else set())
    if roles.reference is not None:  # full fine-tuning: the reference is cast like its policy
        assert {p.dtype for p in roles.reference.parameters()} == {torch.float32}

    rollout = rollout_for(cfg, roles, tokenizer)
    mask = rollout.response_mask
    assert mask.sum() > 8
    assert torch.equal(kl_k1(rollout.logprobs, rollout.ref_logprobs, mask), torch.zeros_like(rollout.logprobs))
    roles.train(True)
    logits, _ = roles.logits_and_values(rollout.query_ids, rollout.query_mask, rollout.response_ids, mask)
    ratio = torch.exp(models.token_logprobs(logits, rollout.response_ids, cfg.temperature) - rollout.logprobs)[mask]
    assert torch.equal(ratio, torch.ones_like(ratio))

    before = {name: p.detach().clone() for name, p in named}
    optimizer = torch.optim.AdamW(roles.trainable_parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    gen = torch.Generator().manual_seed(1)
    advantages = torch.randn(mask.shape, generator=gen).masked_fill(~mask, 0)
    returns = torch.randn(mask.shape, generator=gen).masked_fill(~mask, 0)
    run_passes(ppo.PPO(cfg), roles, optimizer, scheduler, rollout, advantages, returns, cfg,
               torch.Generator().manual_seed(0))
    unchanged = [n for n, p in named if id(p) in trainable and torch.equal(p, before[n])]
    moved_frozen = [n for n, p in named if id(p) not in trainable and not torch.equal(p, before[n])]
    assert not unchanged, unchanged
    assert not moved_frozen, moved_frozen


def prefix_value(roles, ids: torch.Tensor) -> float:
    """V of a prefix scored alone (no padding, no response after it): the value at its last position."""
    mask = torch.ones_like(ids)
    positions = torch.arange(ids.shape[1])[None]
    if roles.value_mode == "separate":
        return roles.value_model(ids, mask, positions)[0, -1].item()
    adapter = models.use_adapter(roles.policy, "value") if roles.value_mode == "lora_adapter" else nullcontext()
    with adapter:
        hidden = models.last_hidden_state(roles.policy, ids, mask, positions)
    return roles.value_head(hidden)[0, -1].item()


@pytest.mark.parametrize("mode", ["full", "full-separate-value", "lora-value-adapter"])
def test_values_t_are_the_value_of_the_prompt_and_the_first_t_response_tokens(fp32_dir, mode):
    """values[:, t] = V(prompt + response[:t]): read at the position whose input is the last token
    before response token t (the state in which a_t is chosen), whatever the row's padding."""
    cfg = tiny_cfg(fp32_dir, dtype="float32", **MODES[mode])
    roles, tokenizer = build_roles(cfg)
    head = roles.value_head if roles.value_head is not None else roles.value_model.value_head
    torch.nn.init.normal_(head.summary.weight, std=1.0)  # a fresh head is zero: V would be its bias everywhere
    rollout = rollout_for(cfg, roles, tokenizer, n=4)
    with torch.no_grad():
        for row in range(rollout.batch_size):
            prompt = rollout.query_ids[row, rollout.query_mask[row]]
            response = rollout.response_ids[row]
            for t in range(int(rollout.response_mask[row].sum())):
                expected = prefix_value(roles, torch.cat([prompt, response[:t]])[None])
                assert rollout.values[row, t].item() == pytest.approx(expected, abs=1e-5), (row, t)
    assert rollout.values[rollout.response_mask].std() > 1e-3  # the values do vary with t


def test_separate_value_model_of_a_bf16_lora_policy_trains_float32_weights(bf16_dir):
    roles, _ = build_roles(tiny_cfg(bf16_dir, lora_r=4, value_mode="separate"))
    assert {p.dtype for p in roles.value_model.parameters()} == {torch.float32}
    assert {p.dtype for p in roles.policy.parameters() if not p.requires_grad} == {torch.bfloat16}


def test_dtype_auto_on_a_bf16_checkpoint_keeps_small_sft_updates(bf16_dir, tmp_path):
    """dtype=auto loads a bf16 checkpoint in bf16; whole-weight SFT then trains float32 weights: a step
    of lr 1e-5 (far below one bf16 step of a weight) moves every tensor and is saved."""
    from safetensors.torch import load_file

    from rlhflab.config import SFTConfig
    from rlhflab.trainers import sft

    items = tasks.sample_items("train", 4, seed=3)
    lines = "".join(json.dumps({"prompt": i.prompt, "completion": i.reference}) + "\n" for i in items)
    (tmp_path / "train.jsonl").write_text(lines)
    cfg = SFTConfig(model=bf16_dir, dtype="auto", train_file=str(tmp_path / "train.jsonl"),
                    validation_file=str(tmp_path / "train.jsonl"), output_dir=str(tmp_path / "run"), max_steps=1,
                    batch_size=4, learning_rate=1e-5, warmup_steps=0, lr_schedule="constant", eval_every=0,
                    progress=False, threads=1)
    result = sft.train(cfg)
    start = load_file(str(Path(bf16_dir) / "model.safetensors"))
    trained = load_file(str(result.model_dir / "model.safetensors"))
    assert {t.dtype for t in start.values()} == {torch.bfloat16}
    assert {t.dtype for t in trained.values()} == {torch.float32}
    unchanged = [k for k in start if torch.equal(trained[k], start[k].float())]
    assert not unchanged, unchanged


def test_a_bf16_reward_model_trains_float32_weights(bf16_dir, tmp_path):
    from safetensors.torch import load_file

    from rlhflab.config import RMConfig
    from rlhflab.trainers import reward

    cfg = RMConfig(model=bf16_dir, dtype="bfloat16", output_dir=str(tmp_path / "rm"), num_train_prompts=16,
                   num_validation_prompts=8, num_test_prompts=8, pair_kinds="wrong_case", pairs_per_prompt=1,
                   num_epochs=1, batch_size=8, learning_rate=1e-5, progress=False, threads=1)
    result = reward.train(cfg)
    trained = load_file(str(result.model_dir / "model.safetensors"))
    assert {t.dtype for t in trained.values()} == {torch.float32}


def test_shipped_ppo_lora_config_runs_in_bf16_on_a_tiny_qwen2(tmp_path):
    """configs/ppo_lora.yaml as shipped (bf16, LoRA, value adapter, reward model), with a local tiny Qwen2
    in place of its hub model, a tiny reward model, and few episodes."""
    policy = save_model(tmp_path / "qwen2", arch="qwen2")
    tokenizer = models.load_tokenizer(policy)
    rm = models.build_random_reward_model(tokenizer, arch="qwen2", hidden_size=32, num_layers=1, num_heads=4,
                                          intermediate_size=64)
    models.save_model_folder(tmp_path / "rm", rm.to(torch.bfloat16), tokenizer)
    shipped = yaml.safe_load(CONFIG_FILE.read_text())
    overrides = dict(model=policy, reward_model=str(tmp_path / "rm"), total_episodes=16, output_dir=str(tmp_path / "run"),
                     num_train_prompts=22, num_validation_prompts=11, num_test_prompts=11, eval_prompts=4,
                     sample_prompts=2, console_samples=0, calibration_prompts=8, progress=False, threads=1)
    assert not set(overrides) & (set(shipped) - {"total_episodes"})  # every other field as shipped
    cfg = dataclasses.replace(parse_config(PPOConfig, ["--config", str(CONFIG_FILE)], prog="rlhflab ppo"),
                              **overrides)
    assert cfg.dtype == "bfloat16" and cfg.lora_r > 0 and cfg.value_mode == "lora_adapter"
    result = ppo.train(cfg)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in rows if "val/ratio" in r]
    assert len(updates) == 16 // shipped["batch_size"]
    # one minibatch, one epoch: each update's only step sees the rollout's own weights
    assert all(r["val/ratio"] == 1.0 and r["policy/ratio_max"] == 1.0 == r["policy/ratio_min"] for r in updates)
    assert updates[0]["objective/kl"] == 0.0  # policy == reference at the first rollout
    assert all(map(lambda r: all(v == v for v in r.values() if isinstance(v, float)), updates))  # no NaN
    assert (result.model_dir / "model.safetensors").is_file()


CRITIC_FREE = {"grpo": dict(num_generations=4), "rloo": dict(num_generations=4, num_iterations=1), "reinforce": dict(),
               "online-dpo": dict(num_generations=4)}


@pytest.mark.parametrize("lora", [0, 4], ids=["full", "lora"])
@pytest.mark.parametrize("stage", sorted(CRITIC_FREE))
def test_critic_free_methods_train_a_bf16_model(tmp_path, stage, lora):
    """The other online methods on a bf16 checkpoint, whole weights (float32 for training) or LoRA on the
    bf16 base: KL exactly 0 and ratio exactly 1 at the first update, no NaN, the policy moved."""
    import importlib

    from rlhflab.config import STAGES

    policy = save_model(tmp_path / "qwen2", arch="qwen2")
    cfg = STAGES[stage](model=policy, dtype="bfloat16", lora_r=lora, batch_size=8, response_length=6, total_episodes=16,
                        eval_every=0, eval_prompts=4, sample_prompts=2, max_new_tokens=6, console_samples=0,
                        num_train_prompts=22, num_validation_prompts=11, num_test_prompts=11, progress=False,
                        threads=1, learning_rate=1e-2, temperature=0.9, reuse_rollout_forward=False, save_every=0,
                        missing_eos_penalty=0.0, output_dir=str(tmp_path / "run"), **CRITIC_FREE[stage])
    trainer = importlib.import_module(f"rlhflab.trainers.{stage.replace('-', '_')}")
    result = trainer.train(cfg, reward_fn=lambda p, r, rows: [float(len(x) % 3) for x in r])
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in rows if "objective/kl" in r]
    assert len(updates) == 2 and updates[0]["objective/kl"] == 0.0
    if "policy/ratio_mean" in updates[0]:
        assert updates[0]["policy/ratio_mean"] == 1.0
    assert all(v == v for r in updates for v in r.values() if isinstance(v, float))  # no NaN
    assert updates[1]["objective/kl"] != 0.0  # the first update moved the policy
    assert (result.model_dir / "model.safetensors").is_file() and (result.run_dir / "adapter").is_dir() == bool(lora)
