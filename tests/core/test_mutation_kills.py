"""Hand-worked cases that kill the mutants benchmarks/mutation.py found surviving in core/ (issue 36,
docs/mutation.md): each asserts numbers a wrong comparison, bound or normaliser would change."""

import math

import pytest
import torch

from rlhflab.core.advantages import (MovingAverageBaseline, discounted_returns, gae, rloo_advantages,
                                     token_rewards)
from rlhflab.core.importance import sampler_correction_weights
from rlhflab.core.kl import AdaptiveKLController, FixedKLController
from rlhflab.core.losses import (bradley_terry_loss, clipped_ratio_loss, clipped_surrogate, clipped_value_loss,
                                 explained_variance, ipo_loss, sequence_log_ratio)
from rlhflab.core.masked import mask_from_lengths, masked_var, whiten


# --- core/kl.py ------------------------------------------------------------------


@pytest.mark.parametrize("target, horizon", [(0.0, 10.0), (6.0, 0.0), (-1.0, 10.0), (6.0, -1.0)])
def test_adaptive_controller_refuses_a_target_or_horizon_that_is_not_positive(target, horizon):
    # each bound alone: `or` -> `and`, `<= 0` -> `< 0` let one through
    with pytest.raises(ValueError, match=r"needs target > 0 and horizon > 0, got target=.*horizon="):
        AdaptiveKLController(0.1, target, horizon)


def test_a_controller_state_of_the_other_kind_names_both_kinds():
    with pytest.raises(ValueError, match=r"state is for 'fixed', expected 'adaptive'"):
        AdaptiveKLController(0.1, 6.0, 10.0).load_state_dict(FixedKLController(0.1).state_dict())
    with pytest.raises(ValueError, match=r"state is for None, expected 'fixed'"):
        FixedKLController(0.1).load_state_dict({"value": 0.1})


# --- core/losses.py ----------------------------------------------------------------


def test_value_clip_binds_below_the_old_value_too():
    # V = 0 < V_old = 1 - 0.2, R = -1: clip(V) = 0.8, (0.8 + 1)^2 = 3.24 > (0 + 1)^2 = 1, so the clipped term
    # is the loss, 0.5 x 3.24, with no gradient; a one-sided clamp(., None, eps) would leave V at 0: loss 0.5
    values = torch.tensor([[0.0, 2.0]], requires_grad=True)
    old = torch.tensor([[1.0, 1.0]])
    returns = torch.tensor([[-1.0, 3.0]])  # and V = 2 > V_old + 0.2, R = 3: clip(V) = 1.2 -> (1.2 - 3)^2 = 3.24 > 1
    mask = torch.tensor([[True, True]])
    loss, stats = clipped_value_loss(values, old, returns, mask, 0.2)
    assert loss.item() == pytest.approx(0.5 * 3.24)
    assert stats["clipfrac"].item() == 1.0 and stats["mean_abs_error"].item() == pytest.approx(1.0)
    loss.backward()
    assert torch.equal(values.grad, torch.zeros(1, 2))


def test_clipped_ratio_flags_need_a_nonzero_advantage_and_a_strict_bound():
    log_ratio = torch.log(torch.tensor([[0.5, 2.0, 0.8, 1.28, 0.5, 2.0]]))
    advantages = torch.tensor([[0.0, 0.0, -1.0, 1.0, -1.0, 1.0]])
    loss, low, high = clipped_ratio_loss(log_ratio, advantages, 0.2, 0.28)
    # A = 0: no clip is active; ratio exactly at 1 - eps / 1 + eps_high: not past the bound
    assert low.tolist() == [[False, False, False, False, True, False]]
    assert high.tolist() == [[False, False, False, False, False, True]]
    torch.testing.assert_close(loss, torch.tensor([[0.0, 0.0, 0.8, -1.28, 0.8, -1.28]]))


def test_sequence_log_ratio_sum_mean_and_an_unknown_reduce():
    logprobs = torch.tensor([[0.3, 0.6, 9.0], [0.2, 9.0, 9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    zeros = torch.zeros(2, 3)
    torch.testing.assert_close(sequence_log_ratio(logprobs, zeros, mask, "sum"), torch.tensor([[0.9], [0.2]]))
    torch.testing.assert_close(sequence_log_ratio(logprobs, zeros, mask, "mean"), torch.tensor([[0.45], [0.2]]))
    with pytest.raises(ValueError, match="reduce must be mean or sum, got 'max'"):
        sequence_log_ratio(logprobs, zeros, mask, "max")


def test_clipfrac_counts_only_tokens_whose_clipped_value_term_is_larger():
    # the third token moves 0.1 < 0.2: its clipped value is itself, the two terms equal, not counted
    values = torch.tensor([[0.0, 2.0, 1.1]], dtype=torch.float64)
    old, returns = torch.ones(1, 3, dtype=torch.float64), torch.tensor([[-1.0, 3.0, 0.0]], dtype=torch.float64)
    loss, stats = clipped_value_loss(values, old, returns, torch.ones(1, 3, dtype=torch.bool), 0.2)
    assert loss.item() == pytest.approx(0.5 * (3.24 + 3.24 + 1.21) / 3)
    assert stats["clipfrac"].item() == pytest.approx(2 / 3) and stats["clipfrac"].dtype == torch.float64


def test_clipped_surrogate_scales_with_the_advantage():
    ratio = torch.tensor([0.5, 1.0, 1.5])
    torch.testing.assert_close(clipped_surrogate(ratio, torch.full((3,), 2.0), 0.2), torch.tensor([1.0, 2.0, 2.4]))
    torch.testing.assert_close(clipped_surrogate(ratio, torch.full((3,), -0.5), 0.2),
                               torch.tensor([-0.4, -0.5, -0.75]))


def test_explained_variance_of_constant_returns_is_a_nan_of_their_dtype():
    ev = explained_variance(torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64),
                            torch.ones(1, 2, dtype=torch.bool))
    assert math.isnan(ev.item()) and ev.dtype == torch.float64 and ev.shape == ()


def test_reward_accuracy_counts_any_positive_margin_and_ipo_rewards_are_beta_times_the_log_ratios():
    _, stats = bradley_terry_loss(torch.tensor([0.5, 0.0]), torch.tensor([0.0, 0.25]))
    assert stats["accuracy"].item() == 0.5
    _, stats = ipo_loss(torch.tensor([2.0]), torch.tensor([-4.0]), torch.zeros(1), torch.zeros(1), beta=0.5)
    assert stats["chosen_rewards"].item() == 1.0 and stats["rejected_rewards"].item() == -2.0


# --- core/advantages.py ------------------------------------------------------------


def test_token_rewards_put_the_score_on_the_last_real_token_and_minus_beta_kl_everywhere():
    scores = torch.tensor([1.0, 2.0, 5.0])
    kl = torch.tensor([[0.1, 0.2, 0.3, 0.0], [0.4, 0.5, 0.6, 0.0], [1.0, 1.0, 1.0, 1.0]])  # B = 3 != T = 4
    mask = mask_from_lengths(torch.tensor([3, 1, 0]), 4)  # the last row has no real token: nothing at all
    rewards, non_score = token_rewards(scores, kl, mask, 0.5)
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, -0.1, 0.85, 0.0], [1.8, 0.0, 0.0, 0.0], [0.0] * 4]))
    torch.testing.assert_close(non_score, -0.5 * kl)


def test_one_token_responses_gae_and_returns():
    # T = 1: the episode ends at once, A = r - V, returns = r
    rewards, values, mask = torch.tensor([[2.0], [1.0]]), torch.tensor([[0.5], [3.0]]), torch.ones(2, 1, dtype=torch.bool)
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(advantages, torch.tensor([[1.5], [-2.0]]))
    torch.testing.assert_close(returns, rewards)
    torch.testing.assert_close(discounted_returns(rewards, mask, 0.9), rewards)


def test_rloo_with_two_samples_per_prompt_is_the_difference():
    # one sibling each: A = s_i - s_j
    torch.testing.assert_close(rloo_advantages(torch.tensor([1.0, 3.0, 5.0, 4.0]), 2),
                               torch.tensor([-2.0, 2.0, 1.0, -1.0]))


def test_advantage_input_errors_say_what_was_wrong():
    with pytest.raises(TypeError, match="response_mask must be bool, got torch.int64"):
        gae(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.long), 1.0, 1.0)
    with pytest.raises(ValueError, match="must be right-padded: a True prefix per row, then only False"):
        gae(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([[False, True]]), 1.0, 1.0)
    with pytest.raises(ValueError, match=r"scores must be 1-D \(B,\), got shape \(2, 2\)"):
        rloo_advantages(torch.zeros(2, 2), 2)


def test_moving_average_decay_bounds_and_its_fresh_state():
    assert MovingAverageBaseline(0.0).state_dict() == {"decay": 0.0, "value": 0.0, "initialised": False}
    for bad in (1.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=r"decay must be in \[0, 1\), got"):
            MovingAverageBaseline(bad)


# --- core/importance.py, core/masked.py ---------------------------------------------


def test_sequence_weights_are_each_rows_own_and_mask_bounds_are_inclusive():
    trainer = torch.tensor([[0.1, 0.2, 0.0], [0.3, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    weights = sampler_correction_weights(trainer, torch.zeros(2, 3), mask, "sequence_truncate", 0.0, 10.0)
    want = torch.tensor([[math.exp(0.3), math.exp(0.3), 0.0], [math.exp(0.3), 0.0, 0.0]])
    torch.testing.assert_close(weights, want)
    weights = sampler_correction_weights(trainer, torch.zeros(2, 3), mask, "sequence_truncate", 0.0, 1.3)
    torch.testing.assert_close(weights, torch.where(mask, torch.tensor(1.3), torch.zeros(())))
    # ratio exactly 1 with low = high = 1: inside, kept
    ones = sampler_correction_weights(trainer, trainer, mask, "token_mask", 1.0, 1.0)
    torch.testing.assert_close(ones, mask.float())
    with pytest.raises(ValueError, match=r"expected one of \('token_truncate', 'token_mask'"):
        sampler_correction_weights(trainer, trainer, mask, "token", 0.5, 2.0)


def test_masked_var_with_two_one_and_no_real_entries():
    x = torch.tensor([[1.0, 3.0, 100.0]], dtype=torch.float64)
    assert masked_var(x, torch.tensor([[True, True, False]])).item() == 2.0
    one = masked_var(x, torch.tensor([[True, False, False]]))
    assert one.item() == 0.0 and one.shape == () and one.dtype == torch.float64
    assert masked_var(x, torch.tensor([[True, True, False]]), unbiased=False).item() == 1.0


def test_whiten_of_a_constant_is_zero_not_nan():
    out = whiten(torch.full((1, 3), 2.0), torch.tensor([[True, True, False]]))
    assert torch.equal(out, torch.zeros(1, 3))
