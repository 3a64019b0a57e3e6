"""GRPO on the tiny suite model: advantages and TRL's metrics by hand, the first update's exact ratio 1 and KL 0,
no gradient from padding or post-EOS tokens, gradient accumulation, the k3 KL term, learning an easy reward, and
the CLI's refusals."""

import dataclasses
import math

import pytest
import torch
from critic_free import (GROUPS_WITH_FAILURES, check_accumulation_equivalence, check_masked_garbage_changes_nothing,
                         digit_share, grouped_rollout, hand_batch, spread_score, tiny, update_rows)
from tinyhf import save_suite_model

from rlhflab import models
from rlhflab.cli import main
from rlhflab.config import GRPOConfig
from rlhflab.core import kl_k3
from rlhflab.trainers import grpo
from rlhflab.trainers.online.algorithm import StepShare
from rlhflab.trainers.online.loop import scored_batch, update_passes
from rlhflab.trainers.online.setup import build_roles

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]
VARIANTS = [(level, loss_type) for level in ("token", "sequence") for loss_type in LOSS_TYPES]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_suite_model(tmp_path_factory.mktemp("policy"))


def grpo_cfg(policy_dir, **overrides) -> GRPOConfig:
    return tiny(GRPOConfig, policy_dir, **{"num_generations": 4, "beta": 0.1, **overrides})


def test_advantages_and_trl_group_metrics_by_hand(policy_dir):
    batch = hand_batch(**GROUPS_WITH_FAILURES)
    adv = grpo.GRPO(grpo_cfg(policy_dir, scale_rewards="group")).advantages(batch)
    per_response = torch.tensor([-2.0, -1.0, 0.0, 3.0]) / (math.sqrt(7.0) + 1e-4)  # scored [1, 2, 6]: mean 3
    want = torch.cat([per_response, torch.zeros(4)])  # group 2: one scored sample -> 0
    torch.testing.assert_close(adv.advantages, torch.where(batch.mask, want.unsqueeze(1), torch.zeros(())))
    assert adv.returns is None
    m = adv.metrics
    assert m["reward"] == pytest.approx(3.0)  # mean of the scored 1, 2, 6, 3
    assert m["reward_std"] == pytest.approx(torch.tensor([1.0, 2.0, 6.0, 3.0]).std().item())  # the rollout's (TRL)
    assert m["frac_reward_zero_std"] == 0.5
    assert m["completions/mean_length"] == pytest.approx(sum(GROUPS_WITH_FAILURES["lengths"]) / 8)
    assert m["entropy"] == pytest.approx(2.0)
    # the batch's std and none (Dr. GRPO): centred by the group mean, scaled by the std of the 4 scored, or not
    batch_std = torch.tensor([1.0, 2.0, 6.0, 3.0]).std().item()
    got = grpo.GRPO(grpo_cfg(policy_dir, scale_rewards="batch")).advantages(batch).advantages[:, 0]
    torch.testing.assert_close(got, torch.tensor([-2.0, -1.0, 0.0, 3.0, 0, 0, 0, 0]) / (batch_std + 1e-4))
    got = grpo.GRPO(grpo_cfg(policy_dir, scale_rewards="none")).advantages(batch).advantages[:, 0]
    torch.testing.assert_close(got, torch.tensor([-2.0, -1.0, 0.0, 3.0, 0, 0, 0, 0]))


def test_kl_in_the_reward_subtracts_beta_times_the_sequence_kl(policy_dir):
    batch = hand_batch(**GROUPS_WITH_FAILURES)
    algorithm = grpo.GRPO(grpo_cfg(policy_dir, kl_in_reward=True, beta=0.5, scale_rewards="none"))
    assert algorithm.settings.kl_loss_coef == 0.0  # no k3 loss term then
    adv = algorithm.advantages(batch)
    # rewards 1 - 0.5 * 0, 2 - 0.5 * 2, 6 - 0: [1, 1, 6], mean 8/3; group 2: 3 - 0.5 * 4 alone -> 0
    torch.testing.assert_close(adv.advantages[:, 0], torch.tensor([-5 / 3, -5 / 3, 0.0, 10 / 3, 0, 0, 0, 0]))
    assert adv.metrics["reward"] == pytest.approx((1 + 2 + 6 + 3) / 4)  # the scores, before the KL penalty (TRL)


@pytest.mark.parametrize("level,loss_type,precision",
                         [(*v, "no") for v in VARIANTS] + [("token", "dapo", "bf16"), ("sequence", "grpo", "bf16")])
def test_first_update_has_ratio_exactly_one_and_kl_exactly_zero(policy_dir, tmp_path, level, loss_type, precision):
    # a fresh training forward (not the rollout's own, reused one) must give the rollout's log-probs exactly,
    # under bf16 autocast too (rollout, reference and training forwards in the same autocast)
    cfg = grpo_cfg(policy_dir, importance_sampling_level=level, loss_type=loss_type, reuse_rollout_forward=False,
                   output_dir=str(tmp_path / "run"), missing_eos_penalty=0.0, epsilon_high=0.28,
                   mixed_precision=precision)
    [row] = update_rows(grpo.train(cfg, reward_fn=spread_score).run_dir)
    assert row["policy/ratio_mean"] == row["policy/ratio_min"] == row["policy/ratio_max"] == 1.0
    assert row["objective/kl"] == 0.0 and row["kl"] == 0.0  # policy == reference: k1 and k3 both exactly 0
    assert row["clip_ratio/region_mean"] == 0.0 and row["grad_norm"] > 0


def test_a_second_iteration_moves_the_ratio_off_one(policy_dir, tmp_path):
    """The ratio metrics are not constants: with num_iterations 2 the second pass sees ratios != 1."""
    cfg = grpo_cfg(policy_dir, num_iterations=2, learning_rate=3e-2, output_dir=str(tmp_path / "run"),
                   missing_eos_penalty=0.0)
    [row] = update_rows(grpo.train(cfg, reward_fn=spread_score).run_dir)
    assert row["policy/ratio_min"] < 1.0 < row["policy/ratio_max"] and row["kl"] > 0


@pytest.mark.parametrize("level,loss_type", VARIANTS)
def test_padding_and_post_eos_tokens_get_no_gradient(policy_dir, level, loss_type):
    cfg = grpo_cfg(policy_dir, importance_sampling_level=level, loss_type=loss_type, epsilon_high=0.28)
    check_masked_garbage_changes_nothing(grpo.GRPO, cfg, group=4)


@pytest.mark.parametrize("level,loss_type", [("token", t) for t in LOSS_TYPES] + [("sequence", "grpo")])
def test_gradient_accumulation_gives_the_same_weights(policy_dir, level, loss_type):
    check_accumulation_equivalence(grpo.GRPO, GRPOConfig, policy_dir, group=4, num_generations=4, beta=0.1,
                                   num_iterations=2, importance_sampling_level=level, loss_type=loss_type)


def test_k3_kl_term_gradient_by_hand_and_zero_at_the_reference(policy_dir):
    """beta x k3 per token: its gradient in log pi_t is beta (1 - pi_ref / pi) / tokens (bnpo), 0 where pi == pi_ref."""
    cfg = grpo_cfg(policy_dir, beta=0.5, loss_type="bnpo")
    lengths = [3, 1, 2, 3]
    batch = hand_batch([1.0] * 4, [True] * 4, lengths, [[0.0] * 3] * 4, group=2)  # equal scores: advantages 0
    ref = torch.tensor([[-1.0, -2.0, -0.5], [-1.2, 0.0, 0.0], [-0.3, -2.5, 0.0], [-1.0, -1.0, -1.0]])
    rollout = batch.rollout
    rollout.logprobs, rollout.ref_logprobs = ref.clone(), ref
    algorithm = grpo.GRPO(cfg)
    adv = algorithm.advantages(batch)
    assert (adv.advantages == 0).all()
    idx = torch.arange(4)
    share = StepShare(tokens=9, rows=4, rollout_tokens=9, response_length=3, steps=1, index=idx)
    at_reference = ref.clone().requires_grad_(True)
    loss, stats = algorithm.loss(at_reference, None, batch, adv, idx, share)
    loss.backward()
    assert loss.item() == 0.0 and stats["kl"] == 0.0 and (at_reference.grad == 0).all()
    delta = torch.tensor([[0.3, -0.2, 0.1], [0.5, 0.0, 0.0], [-0.4, 0.2, 0.0], [0.1, 0.1, -0.3]])
    moved = (ref + delta).requires_grad_(True)
    loss, stats = algorithm.loss(moved, None, batch, adv, idx, share)
    loss.backward()
    want = torch.where(batch.mask, 0.5 * (1 - torch.exp(-delta)) / 9, torch.zeros(()))
    torch.testing.assert_close(moved.grad, want)
    torch.testing.assert_close(loss, 0.5 * kl_k3(ref + delta, ref, batch.mask).sum() / 9)
    assert stats["kl"].item() == pytest.approx((kl_k3(ref + delta, ref, batch.mask).sum() / 9).item())


def test_kl_term_on_the_model_no_gradient_at_the_reference_and_a_step_towards_it_after(policy_dir):
    cfg = grpo_cfg(policy_dir, beta=0.5, max_grad_norm=0.0)
    roles, tokenizer = build_roles(cfg, critic=False)
    optimizer = torch.optim.SGD(roles.trainable_parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    algorithm = grpo.GRPO(cfg)
    equal = torch.ones(8)  # every score equal: advantages 0, the loss is beta x k3 alone

    def one_pass():
        rollout = grouped_rollout(cfg, roles, tokenizer, prompts=2, group=4)
        batch = scored_batch(rollout, equal, torch.ones(8, dtype=torch.bool), 4)
        stats = update_passes(algorithm, roles, optimizer, scheduler, batch, algorithm.advantages(batch), cfg,
                              torch.Generator().manual_seed(0))
        return stats, batch

    stats, _ = one_pass()
    assert stats["grad_norm"] == 0.0 and stats["kl"] == 0.0  # policy == reference: k3's gradient is exactly 0
    with torch.no_grad():  # move the policy away from its (resident) reference
        for p in roles.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    stats, batch = one_pass()
    assert stats["grad_norm"] > 0 and stats["kl"] > 0
    # the step went towards the reference: the sequence KL of the same responses fell
    rollout = batch.rollout
    with torch.no_grad():
        logits, _ = roles.logits_and_values(rollout.query_ids, rollout.query_mask, rollout.response_ids,
                                            rollout.response_mask)
        now = models.token_logprobs(logits, rollout.response_ids, cfg.temperature)
    before = kl_k3(rollout.logprobs, rollout.ref_logprobs, rollout.response_mask).sum()
    after = kl_k3(now, rollout.ref_logprobs, rollout.response_mask).sum()
    assert after < 0.9 * before, (before, after)


def test_a_short_run_on_an_easy_reward_clearly_raises_it(policy_dir, tmp_path):
    cfg = grpo_cfg(policy_dir, batch_size=16, total_episodes=16 * 20, learning_rate=3e-2, beta=0.0,
                   missing_eos_penalty=0.0, output_dir=str(tmp_path / "run"))
    scores = [r["objective/scores"] for r in update_rows(grpo.train(cfg, reward_fn=digit_share).run_dir)]
    assert len(scores) == 20
    start, end = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    # measured over seeds 0-5: start 0.03-0.07, end 0.79-0.99 (margin +0.76 to +0.96); this seed (0): +0.94
    assert end > start + 0.5, (start, end)


@pytest.mark.parametrize("flags,named", [(["--num_generations", "1"], "--num_generations"),
                                         (["--batch_size", "6"], "--batch_size")])
def test_cli_refuses_a_group_of_one_and_a_batch_not_made_of_whole_groups(policy_dir, tmp_path, capsys, flags, named):
    code = main(["grpo", "--model", policy_dir, "--output_dir", str(tmp_path / "run"), "--num_generations", "4",
                 *flags, "--progress", "false"])
    assert code == 2
    err = capsys.readouterr().err
    assert named in err and "rlhflab: error" in err
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_logged_loss_is_the_steps_loss_at_any_accumulation(policy_dir, loss_type):
    """The weights do not move (lr 0): the logged loss at 4 micro-batches a step equals the one at 1."""
    cfg = grpo_cfg(policy_dir, loss_type=loss_type, num_mini_batches=2, max_grad_norm=0.0)
    roles, tokenizer = build_roles(cfg, critic=False)
    rollout = grouped_rollout(cfg, roles, tokenizer, prompts=2, group=4)
    lengths = torch.tensor([1, 6, 2, 5, 3, 6, 1, 4])  # unequal: a micro-batch's share of tokens != of rows
    mask = rollout.response_mask & (torch.arange(6).unsqueeze(0) < lengths.unsqueeze(1))
    rollout = dataclasses.replace(rollout, response_mask=mask, policy_forward=None)
    batch = scored_batch(rollout, torch.randn(8, generator=torch.Generator().manual_seed(3)),
                         torch.ones(8, dtype=torch.bool), 4)
    # group-normalised advantages sum to 0 per group, so the per-sequence "grpo" loss at ratio 1 is 0 up to
    # float noise: shifted by 0.5 on real tokens, every aggregation gives a loss well away from 0
    adv = grpo.GRPO(cfg).advantages(batch)
    adv = dataclasses.replace(adv, advantages=adv.advantages + 0.5 * batch.mask)
    logged = []
    for accumulation in (1, 4):
        optimizer = torch.optim.SGD(roles.trainable_parameters(), lr=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        algorithm = grpo.GRPO(dataclasses.replace(cfg, gradient_accumulation_steps=accumulation))
        stats = update_passes(algorithm, roles, optimizer, scheduler, batch, adv,
                              dataclasses.replace(cfg, gradient_accumulation_steps=accumulation),
                              torch.Generator().manual_seed(0))
        logged.append(stats["loss"])
    assert abs(logged[0]) > 0.1
    assert logged[1] == pytest.approx(logged[0], rel=1e-5)
