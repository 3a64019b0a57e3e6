"""PPO's value_step=after_policy (the policy's step, then the value model's, one model's gradients held at a time)
and reward_model_mode=reload (the reward model read from disk for each rollout's scores)."""

import json
import weakref

import pytest
from online_steps import run_passes
from tinyhf import save_suite_model
import torch

from rlhflab import data, models, rewards, tasks
from rlhflab.config import PPOConfig
from rlhflab.errors import UserInputError
from rlhflab.rollout import GenerationSettings
from rlhflab.rollout.rollout import collect_rollout
from rlhflab.trainers import ppo
from rlhflab.trainers.setup import make_optimizer, make_scheduler


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_suite_model(tmp_path_factory.mktemp("policy"))


def tiny_cfg(policy_dir, **overrides) -> PPOConfig:
    base = dict(model=policy_dir, value_mode="separate", batch_size=8, num_mini_batches=2, num_ppo_epochs=2,
                gradient_accumulation_steps=2, response_length=6, total_episodes=8, eval_every=0, eval_prompts=4,
                sample_prompts=2, max_new_tokens=6, num_train_prompts=22, num_validation_prompts=11,
                num_test_prompts=11, progress=False, threads=1, learning_rate=1e-3, temperature=0.9,
                value_warmup_rollouts=0)
    return PPOConfig(**{**base, **overrides})


def roles_and_rollout(cfg, keep_graph=False):
    from rlhflab.trainers.online.setup import build_roles

    torch.manual_seed(0)  # the value model's fresh head: the same in every build
    roles, tokenizer = build_roles(cfg)
    items = tasks.build_splits(0, 22, 11, 11)["train"][:8]
    prompts = data.encode_prompts(tokenizer, [i.prompt for i in items])
    rollout = collect_rollout(roles, prompts, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                              settings=GenerationSettings(cfg.response_length, True, cfg.temperature),
                              generator=torch.Generator().manual_seed(0), keep_graph=keep_graph)
    return roles, rollout


def passes(cfg, optimizer_of=None, keep_graph=False):
    """One PPO update's passes on a fixed rollout with fixed advantages and returns: (roles, stats, trained
    parameters before, after). `keep_graph`: the rollout keeps its policy forward for the first step."""
    algorithm = ppo.PPO(cfg)
    roles, rollout = roles_and_rollout(cfg, keep_graph)
    optimizer = optimizer_of(roles) if optimizer_of else make_optimizer(algorithm.param_groups(roles), cfg, fused=True)
    scheduler = make_scheduler(optimizer, cfg, 100)
    gen = torch.Generator().manual_seed(1)
    shape, mask = rollout.response_ids.shape, rollout.response_mask
    advantages = torch.randn(shape, generator=gen).masked_fill(~mask, 0)
    returns = torch.randn(shape, generator=gen).masked_fill(~mask, 0)
    before = {n: p.detach().clone() for n, p in trained_named(roles)}
    stats = run_passes(algorithm, roles, optimizer, scheduler, rollout, advantages, returns, cfg,
                       torch.Generator().manual_seed(0))
    return roles, stats, before, dict(trained_named(roles))


def trained_named(roles):
    return [(f"policy.{n}", p) for n, p in roles.policy.named_parameters()] + \
        [(f"value.{n}", p) for n, p in roles.value_model.named_parameters()]


@pytest.mark.parametrize("reuse", [False, True])
def test_without_clipping_after_policy_is_the_joint_update(policy_dir, reuse):
    """AdamW is per tensor and the two models share none: stepping them one after the other is the same update.
    `reuse`: one minibatch of one micro-batch, whose first step reads the rollout's own forward (its log-probs
    for the policy's part, its values for the value model's)."""
    shape = dict(num_mini_batches=1, gradient_accumulation_steps=1) if reuse else {}
    joint = passes(tiny_cfg(policy_dir, max_grad_norm=0.0, **shape), keep_graph=reuse)
    after = passes(tiny_cfg(policy_dir, max_grad_norm=0.0, value_step="after_policy", **shape), keep_graph=reuse)
    moved = [n for n, p in joint[3].items() if not torch.equal(p, joint[2][n])]
    assert any(n.startswith("policy.") for n in moved) and any(n.startswith("value.") for n in moved)
    for name, p in joint[3].items():
        assert torch.allclose(after[3][name], p, atol=1e-6, rtol=0), name
    assert "value_grad_norm" in after[1] and "value_grad_norm" not in joint[1]
    for key in ("loss/policy", "loss/value", "policy/clipfrac", "val/clipfrac"):
        assert after[1][key] == pytest.approx(joint[1][key], abs=1e-6), key
    assert after[1]["skipped"] == joint[1]["skipped"] == 0


@pytest.mark.parametrize("value_step", ["joint", "after_policy"])
def test_gradients_are_clipped_jointly_or_per_model(policy_dir, value_step):
    """SGD at lr 1, one step: each weight moves by minus its clipped gradient. after_policy: each model's step is
    max_grad_norm long; joint: the two together are."""
    clip = 1e-3
    cfg = tiny_cfg(policy_dir, max_grad_norm=clip, num_mini_batches=1, num_ppo_epochs=1, value_step=value_step)
    _, stats, before, after = passes(cfg, optimizer_of=lambda roles: torch.optim.SGD(roles.trainable_parameters(),
                                                                                       lr=1.0))

    def step_norm(prefix):
        return torch.stack([(after[n] - before[n]).norm() for n in before if n.startswith(prefix)]).norm().item()

    policy, value = step_norm("policy."), step_norm("value.")
    if value_step == "after_policy":
        assert policy == pytest.approx(clip, rel=1e-3) and value == pytest.approx(clip, rel=1e-3)
        assert stats["grad_norm"] > clip and stats["value_grad_norm"] > clip  # norms before clipping
    else:
        assert (policy**2 + value**2) ** 0.5 == pytest.approx(clip, rel=1e-3)


def test_the_value_backward_holds_no_policy_gradient(policy_dir):
    """What after_policy saves: when the value model's gradients are formed, the policy's are already freed."""
    cfg = tiny_cfg(policy_dir, value_step="after_policy")
    algorithm = ppo.PPO(cfg)
    roles, rollout = roles_and_rollout(cfg)
    seen = []
    head = next(p for p in roles.value_model.parameters() if p.requires_grad)
    head.register_hook(lambda g: seen.append(sum(p.grad is not None for p in roles.policy.parameters())))
    optimizer = make_optimizer(algorithm.param_groups(roles), cfg)
    mask = rollout.response_mask
    advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)).masked_fill(~mask, 0)
    run_passes(algorithm, roles, optimizer, make_scheduler(optimizer, cfg, 100), rollout, advantages,
               advantages.clone(), cfg, torch.Generator().manual_seed(0))
    assert len(seen) == cfg.num_ppo_epochs * cfg.num_mini_batches * cfg.gradient_accumulation_steps
    assert seen == [0] * len(seen)


def test_a_dropped_policy_step_leaves_the_value_step_and_the_schedule_running(policy_dir, monkeypatch):
    """nonfinite=skip: a non-finite policy loss drops the policy's step only; the value model still steps, each
    dropped part counts as a skipped step, and the LR schedule steps once per minibatch whose value step applied."""
    from rlhflab.trainers.online import passes as online_passes

    real = online_passes.micro_losses

    def poisoned(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        return (loss * float("nan"), stats) if args[-1] == "policy" else (loss, stats)

    monkeypatch.setattr(online_passes, "micro_losses", poisoned)
    cfg = tiny_cfg(policy_dir, value_step="after_policy", nonfinite="skip")
    algorithm = ppo.PPO(cfg)
    roles, rollout = roles_and_rollout(cfg)
    optimizer = make_optimizer(algorithm.param_groups(roles), cfg)
    scheduler = make_scheduler(optimizer, cfg, 100)
    before = {n: p.detach().clone() for n, p in trained_named(roles)}
    mask = rollout.response_mask
    advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)).masked_fill(~mask, 0)
    stats = run_passes(algorithm, roles, optimizer, scheduler, rollout, advantages, advantages.clone(), cfg,
                       torch.Generator().manual_seed(0))
    steps = cfg.num_ppo_epochs * cfg.num_mini_batches
    assert stats["skipped"] == steps and scheduler.last_epoch == steps
    after = dict(trained_named(roles))
    assert all(torch.equal(after[n], before[n]) for n in before if n.startswith("policy."))
    assert any(not torch.equal(after[n], before[n]) for n in before if n.startswith("value."))
    assert "loss/value" in stats and "loss/policy" not in stats


def test_a_critic_warm_up_rollout_steps_the_value_model_only(policy_dir):
    cfg = tiny_cfg(policy_dir, value_step="after_policy", value_warmup_rollouts=1)
    algorithm = ppo.PPO(cfg)
    assert algorithm.step_parts() == ("value",)
    _, _, before, after = passes(cfg)
    assert all(torch.equal(after[n], before[n]) for n in before if n.startswith("policy."))
    assert any(not torch.equal(after[n], before[n]) for n in before if n.startswith("value."))
    algorithm.updates = 1
    assert algorithm.step_parts() == ("policy", "value")
    assert ppo.PPO(tiny_cfg(policy_dir)).step_parts() == ("all",)


def test_after_policy_needs_a_separate_value_model_and_one_process(policy_dir, monkeypatch):
    with pytest.raises(UserInputError, match="value_mode=shared") as err:
        ppo.check_config(tiny_cfg(policy_dir, value_mode="shared", value_step="after_policy"))
    assert "--value_step" in str(err.value) and "--value_mode separate" in str(err.value)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserInputError, match="one process; this run has 2"):
        ppo.check_config(tiny_cfg(policy_dir, value_step="after_policy"))


@pytest.fixture(scope="module")
def reward_dir(policy_dir, tmp_path_factory):
    tokenizer = models.load_tokenizer(policy_dir)
    rm = models.build_random_reward_model(tokenizer, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64)
    folder = tmp_path_factory.mktemp("rm")
    models.save_model_folder(folder, rm, tokenizer)
    return str(folder)


def test_a_reloaded_reward_model_scores_as_the_resident_one_and_is_freed_after(reward_dir):
    tokenizer = models.load_tokenizer(reward_dir)
    built = []

    def load():
        model = models.load_reward_model(reward_dir, tokenizer=tokenizer)
        built.append(weakref.ref(model))
        return model

    items = tasks.build_splits(0, 22, 11, 11)["train"][:6]
    prompts, answers = [i.prompt for i in items], [i.prompt[::-1] for i in items]
    resident = rewards.ModelReward(load(), tokenizer, shift=0.5, scale=2.0)(prompts, answers, items).scores
    reloaded = rewards.ReloadedModelReward(load, tokenizer, shift=0.5, scale=2.0)
    for _ in range(2):
        assert torch.equal(reloaded(prompts, answers, items).scores, resident)
    assert len(built) == 3
    assert built[1]() is None and built[2]() is None  # gone as soon as the call returns, no collection needed


def test_a_reloaded_reward_model_keeps_the_calibration_of_the_resident_one(policy_dir, reward_dir):
    from rlhflab.trainers.online.setup import build_reward, build_roles

    items = tasks.build_splits(0, 22, 11, 11)["train"][:8]
    prompts, answers = [i.prompt for i in items], [i.prompt[::-1] for i in items]
    sources = {}
    for mode in ("resident", "reload"):
        cfg = tiny_cfg(policy_dir, reward="model", reward_model=reward_dir, reward_model_mode=mode,
                       normalize_reward=True)
        roles, tokenizer = build_roles(cfg)
        sources[mode], norms = build_reward(cfg, tokenizer, roles.policy, items)
        assert norms["calibration_answers"] == 8 and norms["shift"] != 0.0
    assert isinstance(sources["reload"], rewards.ReloadedModelReward)
    assert isinstance(sources["resident"], rewards.ModelReward)
    resident = sources["resident"](prompts, answers, items).scores
    assert torch.equal(sources["reload"](prompts, answers, items).scores, resident)


def test_a_ppo_run_with_both_reloads_and_after_policy_steps(policy_dir, reward_dir, tmp_path):
    cfg = tiny_cfg(policy_dir, reward="model", reward_model=reward_dir, reward_model_mode="reload",
                   normalize_reward=True, calibration_prompts=8, reference_mode="reload", value_step="after_policy",
                   total_episodes=16, output_dir=str(tmp_path / "run"), save_every=0)
    result = ppo.train(cfg)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in rows if "val/grad_norm" in r]
    assert len(updates) == 2 and all(r["grad_norm"] > 0 and r["val/grad_norm"] > 0 for r in updates)
    assert all(r["val/ratio"] == pytest.approx(1.0, abs=0.1) for r in updates)
