import math

import torch

from rlhflab.core.losses import clipped_surrogate, clipped_value_loss, explained_variance, ppo_policy_loss
from rlhflab.core.masked import masked_mean

RATIOS = [0.5, 0.8, 1.0, 1.2, 1.5]


def test_clipped_surrogate_seed_numbers():
    ratio = torch.tensor(RATIOS)
    pos = clipped_surrogate(ratio, torch.ones(5), cliprange=0.2)
    neg = clipped_surrogate(ratio, -torch.ones(5), cliprange=0.2)
    torch.testing.assert_close(pos, torch.tensor([0.5, 0.8, 1.0, 1.2, 1.2]))
    torch.testing.assert_close(neg, torch.tensor([-0.8, -0.8, -1.0, -1.2, -1.5]))


def test_ratio_from_logprobs_hand_worked():
    lp, old = torch.tensor([[math.log(0.26)]]), torch.tensor([[math.log(0.20)]])
    loss, stats = ppo_policy_loss(lp, old, torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool), cliprange=0.2)
    assert math.isclose(stats["ratio_mean"].item(), 1.3, rel_tol=1e-6)
    assert math.isclose(loss.item(), -1.2, rel_tol=1e-6)  # clipped at 1 + ε
    assert stats["clipfrac"].item() == 1.0
    assert math.isclose(stats["approxkl"].item(), 0.5 * math.log(1.3) ** 2, rel_tol=1e-5)


def test_policy_loss_hand_worked_and_clipfrac():
    ratios = torch.tensor([[0.5, 0.9, 1.0, 1.1, 1.5]], dtype=torch.float64)
    mask = torch.ones_like(ratios, dtype=torch.bool)
    for sign, objective in ((1.0, [0.5, 0.9, 1.0, 1.1, 1.2]), (-1.0, [-0.8, -0.9, -1.0, -1.1, -1.5])):
        adv = torch.full_like(ratios, sign)
        loss, stats = ppo_policy_loss(ratios.log(), torch.zeros_like(ratios), adv, mask, cliprange=0.2)
        assert math.isclose(loss.item(), -sum(objective) / 5, rel_tol=1e-12)
        assert stats["clipfrac"].item() == 0.2  # one token of five clipped, on either side
        assert math.isclose(stats["ratio_min"].item(), 0.5, rel_tol=1e-12)
        assert math.isclose(stats["ratio_max"].item(), 1.5, rel_tol=1e-12)
        assert math.isclose(stats["ratio_mean"].item(), 1.0, rel_tol=1e-12)


def test_ratio_is_exactly_one_when_logprobs_equal_old_logprobs():
    torch.manual_seed(0)
    lp = torch.log_softmax(torch.randn(3, 7, 11), dim=-1)[..., 2]
    adv = torch.randn(3, 7)
    mask = torch.rand(3, 7) > 0.3
    loss, stats = ppo_policy_loss(lp, lp.clone(), adv, mask, cliprange=0.2)
    assert stats["ratio_min"].item() == 1.0 and stats["ratio_max"].item() == 1.0
    assert stats["clipfrac"].item() == 0.0 and stats["approxkl"].item() == 0.0
    assert loss.item() == -masked_mean(adv, mask).item()  # ρ = 1: the objective is A itself


def test_policy_gradient_is_zero_for_clipped_tokens():
    ratios = torch.tensor([[0.5, 1.0, 1.5]], dtype=torch.float64)
    mask = torch.ones_like(ratios, dtype=torch.bool)
    # A > 0: ratio 1.5 clipped -> 0; others −ρA/n.  A < 0: ratio 0.5 clipped -> 0; others −ρA/n.
    for sign, want in ((1.0, [-0.5 / 3, -1.0 / 3, 0.0]), (-1.0, [0.0, 1.0 / 3, 1.5 / 3])):
        lp = ratios.log().requires_grad_()
        loss, _ = ppo_policy_loss(lp, torch.zeros_like(ratios), torch.full_like(ratios, sign), mask, 0.2)
        (grad,) = torch.autograd.grad(loss, lp)
        torch.testing.assert_close(grad, torch.tensor([want], dtype=torch.float64))


def test_masked_tokens_do_not_affect_policy_loss_even_nan():
    torch.manual_seed(1)
    lp, old, adv = (torch.randn(2, 3, dtype=torch.float64) for _ in range(3))
    mask = torch.tensor([[True, True, True], [True, True, True]])
    clean_loss, clean_stats = ppo_policy_loss(lp, old, adv, mask, 0.2)
    pad = lambda x, v: torch.cat([x, torch.full((2, 2), v, dtype=x.dtype)], dim=1)  # noqa: E731
    lp_pad = pad(lp, float("nan")).requires_grad_()
    padded_mask = pad(mask, False)
    loss, stats = ppo_policy_loss(lp_pad, pad(old, float("inf")), pad(adv, float("nan")), padded_mask, 0.2)
    torch.testing.assert_close(loss, clean_loss, rtol=1e-12, atol=0)  # only summation order differs
    torch.testing.assert_close(stats, clean_stats, rtol=1e-12, atol=0)
    (grad,) = torch.autograd.grad(loss, lp_pad)
    assert torch.isfinite(grad).all() and (grad[:, 3:] == 0).all()


def test_value_loss_hand_worked_with_clipping_active():
    nan = float("nan")
    values = torch.tensor([[1.0, 0.9, nan]], requires_grad=True)
    old_values = torch.tensor([[0.5, 0.5, nan]])
    returns = torch.tensor([[0.0, 1.0, nan]])
    mask = torch.tensor([[True, True, False]])
    loss, stats = clipped_value_loss(values, old_values, returns, mask, cliprange_value=0.2)
    # token 0: unclipped (1.0−0)² = 1 beats clipped (0.7−0)² = 0.49
    # token 1: clipped (0.7−1)² = 0.09 beats unclipped (0.9−1)² = 0.01 -> clipping active
    assert math.isclose(loss.item(), 0.5 * (1.0 + 0.09) / 2, rel_tol=1e-6)  # 0.2725
    assert stats["clipfrac"].item() == 0.5
    assert math.isclose(stats["mean_abs_error"].item(), (1.0 + 0.1) / 2, rel_tol=1e-6)
    (grad,) = torch.autograd.grad(loss, values)
    # d/dV of ½·mean: token 0 -> ½·2·(1−0)/2 = 0.5; token 1 clipped -> 0; padding -> 0
    torch.testing.assert_close(grad, torch.tensor([[0.5, 0.0, 0.0]]))


def test_explained_variance():
    nan = float("nan")
    returns = torch.tensor([[1.0, 2.0, 3.0], [6.0, nan, nan]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert explained_variance(returns, returns, mask).item() == 1.0
    constant = torch.full_like(returns, 3.0)  # the mean of the real returns
    assert abs(explained_variance(constant, returns, mask).item()) < 1e-6
    off_by_one = torch.tensor([[1.0, 2.0, 3.0], [5.0, nan, nan]])
    # Var(R − V) = Var([0, 0, 0, 1]) = 0.25; Var(R) = 14/3
    assert math.isclose(explained_variance(off_by_one, returns, mask).item(), 1 - 0.25 / (14 / 3), rel_tol=1e-6)
    assert math.isnan(explained_variance(returns, torch.ones_like(returns), mask).item())
