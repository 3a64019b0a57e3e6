"""--gradient_checkpointing in every stage: SFT, the reward model and DPO train the weights they train without it
(<= 1e-6 after a short run, float32), and GRPO's and PPO's update passes (policy, LoRA, a separate value model) leave
the same weights. Each also shows the layers were recomputed: the run with the flag makes more attention calls (the
backward's replays; tests/models/test_gradient_checkpointing.py counts them per layer), the one without none extra."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from critic_free import grouped_rollout, tiny
from safetensors.torch import load_file
from tinyhf import save_suite_model

from rlhflab import models, tasks
from rlhflab.config import DPOConfig, GRPOConfig, PPOConfig, RMConfig, SFTConfig
from rlhflab.trainers import dpo, grpo, ppo, reward, sft
from rlhflab.trainers.online.loop import scored_batch, update_passes
from rlhflab.trainers.online.setup import build_roles

SUITE = dict(num_train_prompts=22, num_validation_prompts=11, num_test_prompts=11, progress=False, threads=1)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_suite_model(tmp_path_factory.mktemp("policy"))


class AttentionCalls:
    def __init__(self, monkeypatch):
        self.count = 0
        original = F.scaled_dot_product_attention

        def counted(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)


def weights(model_dir) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def runs_with_and_without(train, cfg, monkeypatch) -> tuple[float, int]:
    """Train `cfg` with the flag off and on (fresh output folders): max |w_off - w_on| of the saved weights, and
    how many more attention calls the run with the flag made."""
    saved, calls = {}, {}
    for flag in (False, True):
        counter = AttentionCalls(monkeypatch)
        result = train(dataclasses.replace(cfg, gradient_checkpointing=flag, output_dir=f"{cfg.output_dir}-{flag}"))
        saved[flag], calls[flag] = weights(result.model_dir), counter.count
        summary = json.loads((result.run_dir / "summary.json").read_text())
        assert summary["stage"] and saved[flag]
    assert saved[False].keys() == saved[True].keys()
    difference = max((saved[False][k] - saved[True][k]).abs().max().item() for k in saved[False])
    return difference, calls[True] - calls[False]


def write_demonstrations(path, n: int):
    items = tasks.sample_items("train", n, seed=3)
    path.write_text("".join(json.dumps({"prompt": i.prompt, "completion": i.reference}) + "\n" for i in items))


@pytest.mark.parametrize("packing", [True, False], ids=["packed-lean", "padded-hf"])
def test_sft_trains_the_same_weights_and_recomputes(policy_dir, tmp_path, packing, monkeypatch):
    write_demonstrations(tmp_path / "train.jsonl", 8)
    cfg = SFTConfig(model=policy_dir, train_file=str(tmp_path / "train.jsonl"),
                    validation_file=str(tmp_path / "train.jsonl"), output_dir=str(tmp_path / "sft"), max_steps=2,
                    batch_size=4, gradient_accumulation_steps=2, packing=packing, learning_rate=1e-2,
                    warmup_steps=0, eval_every=0, progress=False, threads=1)
    difference, recomputed = runs_with_and_without(sft.train, cfg, monkeypatch)
    assert difference <= 1e-6
    assert recomputed == 2 * 2 * 2  # 2 layers x 2 micro-batches x 2 steps


@pytest.mark.parametrize("shared_prefix", [True, False], ids=["grouped-lean", "hf"])
def test_the_reward_model_trains_the_same_weights_and_recomputes(policy_dir, tmp_path, shared_prefix, monkeypatch):
    cfg = RMConfig(model=policy_dir, output_dir=str(tmp_path / "rm"), pair_kinds="wrong_case", pairs_per_prompt=1,
                   num_epochs=1, batch_size=8, learning_rate=3e-3, shared_prefix=shared_prefix, **SUITE)
    difference, recomputed = runs_with_and_without(reward.train, cfg, monkeypatch)
    assert difference <= 1e-6 and recomputed > 0


def test_dpo_trains_the_same_weights_and_recomputes(policy_dir, tmp_path, monkeypatch):
    cfg = DPOConfig(model=policy_dir, output_dir=str(tmp_path / "dpo"), pairs_per_prompt=1, batch_size=8,
                    max_pairs=16, eval_prompts=2, max_new_tokens=4, learning_rate=1e-3, warmup_steps=0, eval_every=0,
                    **SUITE)
    difference, recomputed = runs_with_and_without(dpo.train, cfg, monkeypatch)
    assert difference <= 1e-6 and recomputed > 0


def weights_after_passes(algorithm, cfg, rollout, scores, group: int, critic: bool, monkeypatch):
    """Fresh roles (checkpointing as `cfg` says), one update's passes over `rollout` with SGD: the trainable weights
    after, and the attention calls the passes made."""
    torch.manual_seed(0)  # LoRA's A matrices start random
    roles, _ = build_roles(cfg, critic=critic)
    # as after the loop's rollout (eval mode); a fresh PeftModel says training=True over a base in eval mode,
    # which the passes' roles.train(True) would then leave as it is
    roles.train(False)
    for model in (roles.policy, roles.value_model):
        assert model is None or models.checkpointing_on(model) == cfg.gradient_checkpointing
    optimizer = torch.optim.SGD(roles.trainable_parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    batch = scored_batch(rollout, scores, torch.ones(rollout.batch_size, dtype=torch.bool), group)
    adv = algorithm.advantages(batch)
    counter = AttentionCalls(monkeypatch)
    stats = update_passes(algorithm, roles, optimizer, scheduler, batch, adv, cfg, torch.Generator().manual_seed(0))
    assert stats["skipped"] == 0 and stats["grad_norm"] > 0
    return [p.detach().clone() for p in roles.trainable_parameters()], counter.count


def check_online(algorithm_class, cfg, group: int, critic: bool, monkeypatch) -> None:
    roles, tokenizer = build_roles(cfg, critic=critic)
    rollout = grouped_rollout(cfg, roles, tokenizer, prompts=8 // group, group=group)
    scores = torch.randn(rollout.batch_size, generator=torch.Generator().manual_seed(2))
    start = [p.detach().clone() for p in roles.trainable_parameters()]
    (off, calls_off), (on, calls_on) = (
        weights_after_passes(algorithm_class(c), c, rollout, scores, group, critic, monkeypatch)
        for c in (cfg, dataclasses.replace(cfg, gradient_checkpointing=True)))
    assert all(not torch.equal(a, s) for a, s in zip(off, start))  # every trainable tensor moved
    assert max((a - b).abs().max().item() for a, b in zip(off, on)) <= 1e-6
    assert calls_on > calls_off


@pytest.mark.parametrize("lora_r", [0, 4], ids=["full", "lora"])
def test_grpo_update_passes_give_the_same_weights_and_recompute(policy_dir, lora_r, monkeypatch):
    cfg = tiny(GRPOConfig, policy_dir, num_generations=4, beta=0.1, num_mini_batches=2, max_grad_norm=0.0,
               lora_r=lora_r)
    check_online(grpo.GRPO, cfg, group=4, critic=False, monkeypatch=monkeypatch)


def test_ppo_update_passes_give_the_same_policy_and_value_model_and_recompute(policy_dir, monkeypatch):
    cfg = tiny(PPOConfig, policy_dir, value_mode="separate", num_mini_batches=2, num_ppo_epochs=2,
               max_grad_norm=0.0, value_warmup_rollouts=0)
    check_online(ppo.PPO, cfg, group=1, critic=True, monkeypatch=monkeypatch)
