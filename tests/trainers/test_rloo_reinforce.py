"""RLOO and REINFORCE on the tiny suite model: advantages by hand (leave-one-out with KL in the reward; batch,
moving and leave-one-out baselines on the reward-to-go), the first update's exact ratio 1 and KL 0, no gradient
from padding or post-EOS tokens, gradient accumulation, learning an easy reward, and the CLI's refusal."""

import math

import pytest
import torch
from critic_free import (GROUPS_WITH_FAILURES, check_accumulation_equivalence, check_masked_garbage_changes_nothing,
                         digit_share, hand_batch, spread_score, tiny, update_rows)
from tinyhf import save_suite_model

from rlhflab.cli import main
from rlhflab.config import REINFORCEConfig, RLOOConfig
from rlhflab.trainers import reinforce, rloo


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_suite_model(tmp_path_factory.mktemp("policy"))


def rloo_cfg(policy_dir, **overrides) -> RLOOConfig:
    return tiny(RLOOConfig, policy_dir, **{"num_generations": 4, **overrides})


def reinforce_cfg(policy_dir, **overrides) -> REINFORCEConfig:
    return tiny(REINFORCEConfig, policy_dir, **{"kl_coef": 0.1, **overrides})


# --- RLOO ---------------------------------------------------------------------------------------------------


def test_rloo_advantages_by_hand_with_the_kl_in_the_reward(policy_dir):
    batch = hand_batch(**GROUPS_WITH_FAILURES)
    adv = rloo.RLOO(rloo_cfg(policy_dir, beta=0.5)).advantages(batch)
    # rewards: 1 - 0.5 * 0, 2 - 0.5 * 2, 6 - 0 = [1, 1, 6] (row 2 failed); 3 - 0.5 * 4 = 1 alone in group 2
    # leave-one-out: 1 - (1 + 6)/2 = -2.5 (twice), 6 - (1 + 1)/2 = 5; no scored sibling -> 0
    per_response = torch.tensor([-2.5, -2.5, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv.advantages, torch.where(batch.mask, per_response.unsqueeze(1), torch.zeros(())))
    assert adv.metrics["kl"] == pytest.approx((2 + 4) / 8)  # TRL's RLOO kl: per real token of the scored rows
    assert adv.metrics["reward"] == pytest.approx((1 + 2 + 6 + 3) / 4)  # the scores, before the KL penalty (TRL)
    assert adv.metrics["frac_reward_zero_std"] == 0.5
    whitened = rloo.RLOO(rloo_cfg(policy_dir, beta=0.5, normalize_advantages=True)).advantages(batch).advantages
    kept_std = math.sqrt((2.5**2 * 2 + 5**2) / 3)  # of the scored rows' [-2.5, -2.5, 5, 0], mean 0
    torch.testing.assert_close(whitened[:, 0], per_response / (kept_std + 1e-4))


def test_rloo_first_update_has_ratio_exactly_one_and_kl_exactly_zero(policy_dir, tmp_path):
    cfg = rloo_cfg(policy_dir, num_iterations=1, reuse_rollout_forward=False, output_dir=str(tmp_path / "run"),
                   missing_eos_penalty=0.0)
    [row] = update_rows(rloo.train(cfg, reward_fn=spread_score).run_dir)
    assert row["policy/ratio_mean"] == row["policy/ratio_min"] == row["policy/ratio_max"] == 1.0
    assert row["objective/kl"] == 0.0 and row["kl"] == 0.0 and row["grad_norm"] > 0


def test_rloo_padding_and_post_eos_tokens_get_no_gradient(policy_dir):
    check_masked_garbage_changes_nothing(rloo.RLOO, rloo_cfg(policy_dir, beta=0.1), group=4)


def test_rloo_gradient_accumulation_gives_the_same_weights(policy_dir):
    check_accumulation_equivalence(rloo.RLOO, RLOOConfig, policy_dir, group=4, num_generations=4, num_iterations=2,
                                   beta=0.05)


def test_rloo_short_run_on_an_easy_reward_clearly_raises_it(policy_dir, tmp_path):
    cfg = rloo_cfg(policy_dir, batch_size=16, total_episodes=16 * 16, learning_rate=3e-2, beta=0.0,
                   missing_eos_penalty=0.0, output_dir=str(tmp_path / "run"))
    scores = [r["objective/scores"] for r in update_rows(rloo.train(cfg, reward_fn=digit_share).run_dir)]
    assert len(scores) == 16
    start, end = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    assert end > start + 0.5, (start, end)  # measured over seeds 0-5: start 0.03-0.07, margin +0.90 to +0.96


# --- REINFORCE ----------------------------------------------------------------------------------------------

# two responses of 3 and 1 tokens, k1 KL per token, kl_coef 0.5: rewards -0.5 KL_t, the score on the last token
TWO = dict(lengths=[3, 1], kl_rows=[[0.1, 0.2, 0.3], [0.5, 0.0, 0.0]], group=1)


def test_reinforce_batch_mean_baseline_on_the_reward_to_go_by_hand(policy_dir):
    batch = hand_batch([1.0, 2.0], [True, True], **TWO)
    adv = reinforce.REINFORCE(reinforce_cfg(policy_dir, kl_coef=0.5)).advantages(batch)
    # row 1: rewards [-0.05, -0.1, -0.15 + 1], to-go [0.7, 0.75, 0.85]; row 2: [-0.25 + 2] = [1.75]
    # baseline: the mean return (0.7 + 1.75) / 2 = 1.225
    torch.testing.assert_close(adv.advantages, torch.tensor([[-0.525, -0.475, -0.375], [0.525, 0.0, 0.0]]))
    assert adv.returns is None
    assert adv.metrics["objective/rlhf_reward"] == adv.metrics["baseline"] == pytest.approx(1.225)  # the returns'
    # reward, reward_std: the scores 1 and 2 before the KL penalty, as TRL's GRPO / RLOO log them (Bessel's std)
    assert adv.metrics["reward"] == pytest.approx(1.5) and adv.metrics["reward_std"] == pytest.approx(math.sqrt(0.5))


def test_reinforce_moving_average_baseline_uses_earlier_batches_only(policy_dir):
    algorithm = reinforce.REINFORCE(reinforce_cfg(policy_dir, kl_coef=0.5, baseline="moving_average",
                                                  baseline_decay=0.9))
    first = algorithm.advantages(hand_batch([1.0, 2.0], [True, True], **TWO))
    torch.testing.assert_close(first.advantages, torch.tensor([[0.7, 0.75, 0.85], [1.75, 0.0, 0.0]]))  # baseline 0
    assert algorithm.state_dict()["moving_baseline"]["value"] == pytest.approx(1.225)  # the first batch's mean
    second = algorithm.advantages(hand_batch([3.0, 2.0], [True, True], **TWO))  # returns 2.7, 1.75
    torch.testing.assert_close(second.advantages, torch.tensor([[1.475, 1.525, 1.625], [0.525, 0.0, 0.0]]))
    assert second.metrics["baseline"] == pytest.approx(1.225)
    assert algorithm.state_dict()["moving_baseline"]["value"] == pytest.approx(0.9 * 1.225 + 0.1 * 2.225)


def test_reinforce_leave_one_out_baseline_by_hand(policy_dir):
    # groups (rows 0, 1) and (2, 3); the reward failed on row 3, so row 2 has no scored sibling
    batch = hand_batch([1.0, 3.0, 2.0, 0.0], [True, True, True, False], [3, 1, 2, 1], [[0.0] * 3] * 4, group=2)
    adv = reinforce.REINFORCE(reinforce_cfg(policy_dir, baseline="leave_one_out", num_generations=2)).advantages(batch)
    # kl 0: every token's reward-to-go is the score; baselines 3 and 1 (the sibling's), row 2 its own return
    torch.testing.assert_close(adv.advantages, torch.tensor([[-2.0, -2.0, -2.0], [2.0, 0, 0], [0, 0, 0], [0, 0, 0]]))
    assert adv.metrics["baseline"] == pytest.approx((3 + 1 + 2) / 3)


@pytest.mark.parametrize("baseline", ["batch_mean", "moving_average"])
def test_reinforce_first_update_has_ratio_exactly_one_and_kl_exactly_zero(policy_dir, tmp_path, baseline):
    cfg = reinforce_cfg(policy_dir, baseline=baseline, reuse_rollout_forward=False, output_dir=str(tmp_path / "run"),
                        missing_eos_penalty=0.0)
    [row] = update_rows(reinforce.train(cfg, reward_fn=spread_score).run_dir)
    assert row["policy/ratio_mean"] == 1.0 and row["objective/kl"] == 0.0 and row["grad_norm"] > 0


@pytest.mark.parametrize("baseline,group", [("batch_mean", 1), ("leave_one_out", 2)])
def test_reinforce_padding_and_post_eos_tokens_get_no_gradient(policy_dir, baseline, group):
    cfg = reinforce_cfg(policy_dir, baseline=baseline, num_generations=group)
    check_masked_garbage_changes_nothing(reinforce.REINFORCE, cfg, group=group)


def test_reinforce_gradient_accumulation_gives_the_same_weights(policy_dir):
    check_accumulation_equivalence(reinforce.REINFORCE, REINFORCEConfig, policy_dir, group=1, kl_coef=0.1)


def test_reinforce_short_run_on_an_easy_reward_clearly_raises_it(policy_dir, tmp_path):
    cfg = reinforce_cfg(policy_dir, baseline="moving_average", batch_size=16, total_episodes=16 * 20,
                        learning_rate=3e-2, kl_coef=0.0, missing_eos_penalty=0.0, output_dir=str(tmp_path / "run"))
    rows = update_rows(reinforce.train(cfg, reward_fn=digit_share).run_dir)
    scores = [r["objective/scores"] for r in rows]
    assert len(scores) == 20
    start, end = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    assert end > start + 0.5, (start, end)  # measured over seeds 0-5: start 0.02-0.07, margin +0.72 to +0.95
    assert rows[0]["baseline"] == 0.0 and rows[-1]["baseline"] > start  # the moving baseline followed the reward


def test_cli_refuses_leave_one_out_without_a_group(policy_dir, tmp_path, capsys):
    code = main(["reinforce", "--model", policy_dir, "--output_dir", str(tmp_path / "run"), "--baseline",
                 "leave_one_out", "--progress", "false"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--num_generations" in err and "leave_one_out" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("decay", [1.0, -0.1])
def test_cli_refuses_a_baseline_decay_outside_0_1(policy_dir, tmp_path, capsys, decay):
    code = main(["reinforce", "--model", policy_dir, "--output_dir", str(tmp_path / "run"), "--baseline_decay",
                 str(decay), "--progress", "false"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--baseline_decay" in err and "rlhflab: error" in err
    assert not (tmp_path / "run").exists()
