"""Online DPO in the online loop: pairs from each prompt's best and worst answer, DPO on them."""

import dataclasses
import math

import pytest
import torch
from critic_free import digit_share, grouped_rollout, tiny, update_rows, weights_after_a_pass
from tinyhf import save_suite_model

from rlhflab.config import OnlineDPOConfig
from rlhflab.core import dpo_loss
from rlhflab.errors import UserInputError
from rlhflab.trainers import online_dpo
from rlhflab.trainers.online.algorithm import StepShare
from rlhflab.trainers.online.loop import micro_losses, scored_batch, shuffled_rows
from rlhflab.trainers.online.setup import build_roles
from rlhflab.trainers.online_dpo import CHOSEN, REJECTED, OnlineDPO, best_and_worst


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_suite_model(tmp_path_factory.mktemp("policy"))


def test_best_and_worst_of_each_group_by_hand():
    scores = torch.tensor([0.2, 0.9, 0.1, 0.5,   # best row 1, worst row 2
                           1.0, 1.0, 1.0, 1.0,   # all alike: no pair
                           0.0, 3.0, -5.0, 2.0])  # the -5 row is not valid: worst is row 8
    valid = torch.tensor([True] * 10 + [False, True])
    marks = best_and_worst(scores, valid, 4)
    expected = torch.zeros(12)
    expected[[1, 9]] = CHOSEN
    expected[[2, 8]] = REJECTED
    assert torch.equal(marks, expected)


def test_shuffled_rows_keep_each_group_whole_and_contiguous():
    order = shuffled_rows(12, 4, torch.Generator().manual_seed(0))
    assert sorted(order.tolist()) == list(range(12))
    groups = order.view(3, 4)
    assert torch.equal(groups - groups[:, :1], torch.arange(4).expand(3, 4))  # consecutive rows of one group
    assert torch.equal((groups // 4)[:, 0].unique(), torch.arange(3))


def first_step(policy_dir, group=4, **overrides):
    cfg = tiny(OnlineDPOConfig, policy_dir, num_generations=group, **overrides)
    roles, tokenizer = build_roles(cfg, critic=False)
    rollout = grouped_rollout(cfg, roles, tokenizer, prompts=2, group=group)
    return cfg, roles, rollout


def test_first_step_loss_is_log_2_on_every_pair_and_the_ratio_is_one(policy_dir):
    cfg, roles, rollout = first_step(policy_dir)
    mask = rollout.response_mask
    assert torch.equal(rollout.logprobs[mask], rollout.ref_logprobs[mask])  # policy == reference: KL exactly 0
    scores = torch.tensor([0.0, 1.0, 0.5, 0.2, 2.0, 0.0, 1.0, 1.5])
    batch = scored_batch(rollout, scores, torch.ones(8, dtype=torch.bool), 4)
    algorithm = OnlineDPO(cfg)
    adv = algorithm.advantages(batch)
    assert adv.metrics["pairs"] == 2 and adv.metrics["score/chosen"] == 1.5 and adv.metrics["score/rejected"] == 0.0
    idx = torch.arange(8)
    share = StepShare(tokens=mask.sum().item(), rows=8, rollout_tokens=mask.sum().item(),
                      response_length=cfg.response_length, steps=1, index=idx)
    roles.train(True)
    loss, stats = micro_losses(algorithm, roles, batch, adv, idx, share, cfg.temperature)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)
    assert stats["reward_margin"].item() == pytest.approx(0.0, abs=1e-6)


def test_the_loss_is_dpo_on_the_pairs_and_micro_batches_add_up_to_the_step(policy_dir):
    cfg, roles, rollout = first_step(policy_dir, beta=0.5)
    gen = torch.Generator().manual_seed(3)
    mask = rollout.response_mask
    ref = rollout.ref_logprobs - 0.3 * torch.rand(rollout.logprobs.shape, generator=gen) * mask
    shifted = rollout.__class__(**{**rollout.__dict__, "ref_logprobs": ref})
    scores = torch.tensor([0.0, 1.0, 0.5, 0.2, 2.0, 0.0, 1.0, 1.5])
    batch = scored_batch(shifted, scores, torch.ones(8, dtype=torch.bool), 4)
    algorithm = OnlineDPO(cfg)
    adv = algorithm.advantages(batch)
    logprobs = rollout.logprobs.clone()
    seq = lambda lp, rows: torch.where(mask[rows], lp[rows], torch.zeros(())).sum(dim=1)  # noqa: E731
    chosen, rejected = [1, 4], [0, 5]
    expected, _ = dpo_loss(seq(logprobs, chosen), seq(logprobs, rejected), seq(ref, chosen), seq(ref, rejected), 0.5)
    idx = torch.arange(8)
    share = StepShare(tokens=mask.sum().item(), rows=8, rollout_tokens=mask.sum().item(),
                      response_length=cfg.response_length, steps=1, index=idx)
    whole, _ = algorithm.loss(logprobs, None, batch, adv, idx, share)
    halves = [algorithm.loss(logprobs[rows], None, batch, adv, rows, share)[0]
              for rows in (torch.arange(4), torch.arange(4, 8))]
    assert whole.item() == pytest.approx(expected.item(), rel=1e-6)
    assert sum(h.item() for h in halves) == pytest.approx(expected.item(), rel=1e-6)


def test_gradient_accumulation_over_whole_groups_gives_the_same_weights(policy_dir):
    cfg = tiny(OnlineDPOConfig, policy_dir, num_generations=2, num_mini_batches=2, max_grad_norm=0.0)
    roles, tokenizer = build_roles(cfg, critic=False)
    rollout = grouped_rollout(cfg, roles, tokenizer, prompts=4, group=2)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 2.0, 1.0])  # the third prompt makes no pair
    after = [weights_after_a_pass(OnlineDPO, dataclasses.replace(cfg, gradient_accumulation_steps=g), rollout, scores, 2)
             for g in (1, 2)]
    for one, two in zip(*after):
        assert torch.allclose(one, two, atol=1e-6, rtol=1e-4)


def test_micro_batches_that_would_split_a_group_are_refused(policy_dir):
    with pytest.raises(UserInputError, match="whole groups"):
        OnlineDPO(tiny(OnlineDPOConfig, policy_dir, num_generations=4, gradient_accumulation_steps=4))
    with pytest.raises(UserInputError, match="num_generations must be >= 2"):
        OnlineDPO(tiny(OnlineDPOConfig, policy_dir, num_generations=1))


def test_a_short_run_on_an_easy_reward_raises_it(policy_dir, tmp_path):
    cfg = tiny(OnlineDPOConfig, policy_dir, num_generations=4, batch_size=16, total_episodes=16 * 20,
               learning_rate=3e-2, beta=0.1, missing_eos_penalty=0.0, output_dir=str(tmp_path / "run"))
    result = online_dpo.train(cfg, reward_fn=digit_share)
    rows = update_rows(result.run_dir)
    scores = [r["objective/scores"] for r in rows]
    start, end = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    assert rows[0]["objective/kl"] == 0.0 and rows[0]["pairs"] > 0
    assert end > start + 0.3, (start, end)  # checked with seeds 0-2
    assert result.summary["stage"] == "online-dpo" and result.summary["samples_per_prompt"] == 4
