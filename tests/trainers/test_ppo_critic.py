"""PPO's critic options do what they say: the value head's own learning rate, the critic warm-up."""

import pytest
from online_steps import run_passes
from tinyhf import save_suite_model
import torch

from rlhflab import data, tasks
from rlhflab.config import PPOConfig
from rlhflab.core import masked_mean
from rlhflab.rollout import GenerationSettings
from rlhflab.rollout.rollout import collect_rollout
from rlhflab.trainers import ppo
from rlhflab.trainers.online.setup import build_roles
from rlhflab.trainers.setup import make_optimizer, make_scheduler

MODES = {"shared": dict(), "separate": dict(value_mode="separate"),
         "lora_adapter": dict(lora_r=4, value_mode="lora_adapter")}


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_suite_model(tmp_path_factory.mktemp("policy"))


def tiny_cfg(policy_dir, **overrides) -> PPOConfig:
    base = dict(model=policy_dir, batch_size=8, num_mini_batches=1, num_ppo_epochs=1, response_length=6,
                total_episodes=16, eval_every=0, eval_prompts=4, sample_prompts=2, max_new_tokens=6,
                num_train_prompts=22, num_validation_prompts=11, num_test_prompts=11, progress=False,
                threads=1, learning_rate=1e-4, temperature=0.9, lr_schedule="constant", warmup_steps=0,
                value_head_learning_rate=0.0, value_warmup_rollouts=0)  # 0 = off; each test sets its own
    return PPOConfig(**{**base, **overrides})


def fixed_rollout(cfg, roles, tokenizer):
    items = tasks.build_splits(0, 22, 11, 11)["train"][:8]
    prompts = data.encode_prompts(tokenizer, [i.prompt for i in items])
    settings = GenerationSettings(cfg.response_length, True, cfg.temperature)
    return collect_rollout(roles, prompts, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                           settings=settings, generator=torch.Generator().manual_seed(0))


def value_mse(roles, rollout, returns) -> float:
    with torch.no_grad():
        _, values = roles.logits_and_values(rollout.query_ids, rollout.query_mask, rollout.response_ids,
                                            rollout.response_mask)
    return masked_mean((values.float() - returns) ** 2, rollout.response_mask).item()


def train_value(cfg, passes: int) -> tuple[float, float]:
    """Value MSE to fixed returns (1 on every token) before and after `passes` updates on one fixed rollout,
    with the optimiser groups the online loop builds."""
    torch.manual_seed(0)
    roles, tokenizer = build_roles(cfg)
    rollout = fixed_rollout(cfg, roles, tokenizer)
    algorithm = ppo.PPO(cfg)
    optimizer = make_optimizer(algorithm.param_groups(roles), cfg, fused=True)
    scheduler = make_scheduler(optimizer, cfg, passes)
    returns = rollout.response_mask.float()
    advantages = torch.zeros_like(returns)
    before = value_mse(roles, rollout, returns)
    for _ in range(passes):
        run_passes(algorithm, roles, optimizer, scheduler, rollout, advantages, returns,
                   cfg, torch.Generator().manual_seed(0))
    return before, value_mse(roles, rollout, returns)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_value_head_learning_rate_reaches_its_own_optimiser_group(policy_dir, mode):
    cfg = tiny_cfg(policy_dir, value_head_learning_rate=3e-3, **MODES[mode])
    roles, _ = build_roles(cfg)
    optimizer = make_optimizer(ppo.PPO(cfg).param_groups(roles), cfg, fused=True)
    policy_group, head_group = optimizer.param_groups
    head = roles.value_head if roles.value_head is not None else roles.value_model.value_head
    assert [id(p) for p in head_group["params"]] == [id(p) for p in head.parameters()]
    assert head_group["lr"] == 3e-3 and policy_group["lr"] == 1e-4
    everything = {id(p) for p in roles.trainable_parameters()}
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == everything
    assert len(policy_group["params"]) + len(head_group["params"]) == len(everything)  # no tensor twice
    same = make_optimizer(ppo.PPO(tiny_cfg(policy_dir, **MODES[mode])).param_groups(roles), cfg)
    assert [g["lr"] for g in same.param_groups] == [1e-4, 1e-4]  # 0 = learning_rate
    assert PPOConfig().value_head_learning_rate == 3e-3 and PPOConfig().value_warmup_rollouts == 2  # the defaults


def test_a_faster_value_head_fits_fixed_returns_sooner(policy_dir):
    wide = dict(cliprange_value=100.0)  # no clip around the rollout's (unchanging) values
    slow_before, slow_after = train_value(tiny_cfg(policy_dir, **wide), passes=4)
    fast_before, fast_after = train_value(tiny_cfg(policy_dir, value_head_learning_rate=3e-2, **wide), passes=4)
    assert slow_before == pytest.approx(1.0) and fast_before == pytest.approx(1.0)  # the zero head: V = 0
    assert slow_after > 0.95  # at the policy's 1e-4 the head barely moves (measured 0.994) ...
    assert fast_after < 0.5  # ... at 3e-2 it closes most of the gap in 4 steps (measured 0.33)


def test_a_warm_up_rollout_trains_the_critic_and_leaves_the_policy_exactly_as_it_was(policy_dir):
    cfg = tiny_cfg(policy_dir, value_mode="separate", value_warmup_rollouts=1, value_head_learning_rate=1e-2)
    torch.manual_seed(0)
    roles, tokenizer = build_roles(cfg)
    rollout = fixed_rollout(cfg, roles, tokenizer)
    algorithm = ppo.PPO(cfg)
    optimizer = make_optimizer(algorithm.param_groups(roles), cfg, fused=True)
    scheduler = make_scheduler(optimizer, cfg, 2)
    policy_before = [p.detach().clone() for p in roles.policy.parameters()]
    returns = rollout.response_mask.float()
    advantages = torch.randn(returns.shape, generator=torch.Generator().manual_seed(1)) * returns
    mse_before = value_mse(roles, rollout, returns)

    def one_update():
        run_passes(algorithm, roles, optimizer, scheduler, rollout, advantages, returns, cfg,
                   torch.Generator().manual_seed(0))
        algorithm.updates += 1  # what after_update counts

    one_update()  # the warm-up rollout
    assert all(torch.equal(p, q) for p, q in zip(roles.policy.parameters(), policy_before))
    assert value_mse(roles, rollout, returns) < mse_before - 0.01
    one_update()  # past the warm-up the policy trains
    assert sum(not torch.equal(p, q) for p, q in zip(roles.policy.parameters(), policy_before)) > 10
    assert algorithm.state_dict()["updates"] == 2


def test_warm_up_count_survives_a_checkpoint(policy_dir):
    algorithm = ppo.PPO(tiny_cfg(policy_dir, value_warmup_rollouts=3))
    algorithm.updates = 2
    resumed = ppo.PPO(tiny_cfg(policy_dir, value_warmup_rollouts=3))
    resumed.load_state_dict(algorithm.state_dict())
    assert resumed.updates == 2
    old = {k: v for k, v in algorithm.state_dict().items() if k != "updates"}  # a checkpoint from before the field
    resumed.load_state_dict(old)
    assert resumed.updates == 0


def test_a_fresh_value_head_starts_at_zero_and_a_reward_models_score_is_kept(policy_dir, tmp_path):
    """value_mode=separate from a causal LM: its fresh head is zeroed (V = 0 at the start, as the shared head);
    from a reward model: the head is the RM's trained score layer, untouched."""
    roles, _ = build_roles(tiny_cfg(policy_dir, value_mode="separate"))
    head = roles.value_model.value_head.summary
    assert torch.count_nonzero(head.weight) == 0 and torch.count_nonzero(head.bias) == 0

    from rlhflab import models
    tokenizer = models.load_tokenizer(policy_dir)
    reward_model = models.build_reward_model_from_causal(policy_dir, tokenizer)
    with torch.no_grad():
        reward_model.score.weight.fill_(0.25)
    models.save_model_folder(tmp_path / "rm", reward_model, tokenizer)
    roles, _ = build_roles(tiny_cfg(policy_dir, value_mode="separate", value_model=str(tmp_path / "rm")))
    assert torch.equal(roles.value_model.value_head.summary.weight, torch.full_like(reward_model.score.weight, 0.25))
