"""--sampler_correction in the online losses: weights of exactly 1 leave every update as it was, a weight scales
its token's policy-gradient term, weights of 0 silence it; the config refuses what cannot work."""

import dataclasses

import pytest
import torch
from tinyhf import save_suite_model

from rlhflab import data, tasks
from rlhflab.config import GRPOConfig, OnlineDPOConfig, PPOConfig, REINFORCEConfig
from rlhflab.errors import UserInputError
from rlhflab.rollout import GenerationSettings
from rlhflab.rollout.rollout import collect_rollout
from rlhflab.trainers import grpo, online_dpo, ppo, reinforce
from rlhflab.trainers.online.algorithm import Advantages
from rlhflab.trainers.online.loop import sampler_weight_metrics, scored_batch, update_passes, with_sampler_weights
from rlhflab.trainers.online.setup import build_roles

STAGES = {"ppo": (PPOConfig, ppo.PPO), "grpo": (GRPOConfig, grpo.GRPO), "reinforce": (REINFORCEConfig, reinforce.REINFORCE)}


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_suite_model(tmp_path_factory.mktemp("policy"))


def one_update(policy_dir, stage, sampler_shift=None, scores=None, ref_shift=0.0, **overrides):
    """One update's passes with SGD on a fixed rollout; the sampler's log-probs are the trainer's minus
    `sampler_shift` (None: the sampler reports none), the reference's minus `ref_shift` (a KL to pull back).
    Returns the trained parameters (policy, then any value head) before and after, and the batch."""
    config_class, algorithm_class = STAGES[stage]
    base = dict(model=policy_dir, batch_size=8, num_mini_batches=1, response_length=6, total_episodes=8, threads=1,
                temperature=0.9, max_grad_norm=0.0)
    extra = {"ppo": dict(num_ppo_epochs=1, value_warmup_rollouts=0, vf_coef=0.0), "grpo": dict(num_generations=4, beta=0.0),
             "reinforce": {}}[stage]
    cfg = config_class(**{**base, **extra, **overrides})
    algorithm = algorithm_class(cfg)
    torch.manual_seed(0)
    roles, tokenizer = build_roles(cfg, critic=algorithm.critic)
    items = tasks.build_splits(0, 22, 11, 11)["train"][:2] * 4 if stage == "grpo" else tasks.build_splits(0, 22, 11, 11)["train"][:8]
    prompts = data.encode_prompts(tokenizer, [i.prompt for i in items])
    rollout = collect_rollout(roles, prompts, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                              settings=GenerationSettings(cfg.response_length, True, cfg.temperature),
                              generator=torch.Generator().manual_seed(0))
    sampler = None if sampler_shift is None else rollout.logprobs - sampler_shift * rollout.response_mask
    rollout = dataclasses.replace(rollout, sampler_logprobs=sampler,
                                  ref_logprobs=rollout.ref_logprobs - ref_shift * rollout.response_mask)
    scores = torch.arange(8, dtype=torch.float32) % 3 if scores is None else scores
    batch = with_sampler_weights(scored_batch(rollout, scores, torch.ones(8, dtype=torch.bool), algorithm.samples_per_prompt
                                              if stage == "grpo" else 1), cfg)
    adv = algorithm.advantages(batch)
    optimizer = torch.optim.SGD(roles.trainable_parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    before = [p.detach().clone() for p in roles.trainable_parameters()]
    update_passes(algorithm, roles, optimizer, scheduler, batch, adv, cfg, torch.Generator().manual_seed(0))
    return before, [p.detach().clone() for p in roles.trainable_parameters()], batch


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_weights_of_exactly_one_leave_the_update_as_it_was(policy_dir, stage):
    _, plain, _ = one_update(policy_dir, stage)
    _, corrected, batch = one_update(policy_dir, stage, sampler_shift=0.0, sampler_correction="token_truncate")
    assert batch.sampler_weights is not None and bool((batch.sampler_weights[batch.mask] == 1.0).all())
    assert all(torch.equal(a, b) for a, b in zip(plain, corrected))


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_a_weight_scales_the_policy_gradient_and_zero_silences_it(policy_dir, stage):
    before, plain, _ = one_update(policy_dir, stage)
    # the sampler found every token half as likely as the trainer does: token weights exactly 2
    _, doubled, batch = one_update(policy_dir, stage, sampler_shift=torch.log(torch.tensor(2.0)).item(),
                                   sampler_correction="token_truncate")
    assert torch.allclose(batch.sampler_weights[batch.mask], torch.tensor(2.0))
    assert sampler_weight_metrics(batch, 0.5, 2.0)["sampler/is_truncated_share"] == 1.0  # all at the cap
    assert sampler_weight_metrics(batch, 0.5, 3.0)["sampler/is_truncated_share"] == 0.0
    moved = [(p1 - p0, p2 - p0) for p0, p1, p2 in zip(before, plain, doubled) if not torch.equal(p1, p0)]
    assert moved
    for one, two in moved:  # SGD: the step is the gradient, twice as large
        assert torch.allclose(two, 2 * one, atol=1e-6, rtol=1e-4)
    # every response's ratio far outside the bounds: sequence_mask drops them all, nothing trains
    _, silenced, batch = one_update(policy_dir, stage, sampler_shift=5.0, sampler_correction="sequence_mask")
    assert sampler_weight_metrics(batch, 0.5, 2.0)["sampler/is_dropped_share"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, silenced))


def test_the_kl_term_and_the_value_loss_are_not_weighted(policy_dir):
    """Every response dropped (sequence_mask far out of bounds): GRPO still takes its k3 KL term's step, the one it
    takes when no answer has an advantage; PPO's value head still learns."""
    pulled = dict(ref_shift=0.5, beta=0.1)
    start, kl_only, _ = one_update(policy_dir, "grpo", scores=torch.zeros(8), **pulled)
    assert any(not torch.equal(a, b) for a, b in zip(start, kl_only))  # the KL term alone moves the policy
    _, dropped, batch = one_update(policy_dir, "grpo", sampler_shift=5.0, sampler_correction="sequence_mask", **pulled)
    assert bool((batch.sampler_weights == 0).all())
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(kl_only, dropped))
    before, after, _ = one_update(policy_dir, "ppo", sampler_shift=5.0, sampler_correction="sequence_mask", vf_coef=0.5)
    assert any(not torch.equal(a, b) for a, b in zip(before, after))


def test_auto_means_vllm_only_and_what_cannot_work_is_refused(policy_dir):
    from rlhflab.trainers.online.setup import sampler_correction_mode

    assert sampler_correction_mode(PPOConfig(model=policy_dir, generation_backend="vllm")) == "token_truncate"
    assert sampler_correction_mode(PPOConfig(model=policy_dir)) == "none"  # lean: the trainer's own arithmetic
    assert sampler_correction_mode(PPOConfig(model=policy_dir, sampler_correction="sequence_mask")) == "sequence_mask"
    with pytest.raises(UserInputError, match="must hold 1"):
        ppo.check_config(PPOConfig(model=policy_dir, sampler_correction="token_mask", sampler_correction_max=0.9))
    with pytest.raises(UserInputError, match="pairwise loss"):
        online_dpo.check_config(OnlineDPOConfig(model=policy_dir, sampler_correction="token_truncate"))
