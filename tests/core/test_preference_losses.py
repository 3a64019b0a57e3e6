import math

import torch

from rlhflab.core.losses import (
    PREFERENCE_LOSSES,
    REFERENCE_FREE,
    bradley_terry_loss,
    dpo_loss,
    ipo_loss,
    reward_centering_penalty,
    simpo_loss,
)


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))  # −log σ(−x)


def test_bradley_terry_equal_scores_give_log_2():
    loss, stats = bradley_terry_loss(torch.zeros(3), torch.zeros(3))
    assert math.isclose(loss.item(), math.log(2.0), rel_tol=1e-6)
    assert stats["accuracy"].item() == 0.0 and stats["margin"].item() == 0.0


def test_bradley_terry_hand_worked_with_and_without_margin():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 1.0])  # diffs [2, −1]
    loss, stats = bradley_terry_loss(chosen, rejected)
    assert math.isclose(loss.item(), (softplus(-2.0) + softplus(1.0)) / 2, rel_tol=1e-6)
    assert stats["accuracy"].item() == 0.5 and stats["margin"].item() == 0.5
    loss_m, _ = bradley_terry_loss(chosen, rejected, margin=torch.tensor([1.0, 0.0]))  # [1, −1]
    assert math.isclose(loss_m.item(), (softplus(-1.0) + softplus(1.0)) / 2, rel_tol=1e-6)


def test_bradley_terry_gradient_pushes_chosen_up_and_rejected_down():
    chosen, rejected = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    loss, _ = bradley_terry_loss(chosen, rejected)
    g_c, g_r = torch.autograd.grad(loss, (chosen, rejected))
    assert (g_c < 0).all() and (g_r > 0).all()


def test_reward_centering_penalty_hand_worked():
    got = reward_centering_penalty(torch.tensor([1.0, 2.0]), torch.tensor([-1.0, 1.0]), coef=0.01)
    assert math.isclose(got.item(), 0.01 * (0.0 + 9.0) / 2, rel_tol=1e-6)


def test_dpo_zero_log_ratios_give_log_2():
    z = torch.zeros(4)
    loss, stats = dpo_loss(z, z, z, z, beta=0.1)
    assert math.isclose(loss.item(), math.log(2.0), rel_tol=1e-6)
    assert all(v.item() == 0.0 for v in stats.values())


def test_dpo_hand_worked_and_label_smoothing():
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-1.0, -3.0, -2.0, -2.0))
    loss, stats = dpo_loss(pc, pr, rc, rr, beta=0.1)
    # chosen reward 0.1·(−1+2) = 0.1, rejected 0.1·(−3+2) = −0.1, h = 0.2
    assert math.isclose(loss.item(), softplus(-0.2), rel_tol=1e-6)
    assert math.isclose(stats["chosen_rewards"].item(), 0.1, rel_tol=1e-6)
    assert math.isclose(stats["rejected_rewards"].item(), -0.1, rel_tol=1e-6)
    assert math.isclose(stats["reward_margin"].item(), 0.2, rel_tol=1e-6)
    assert stats["reward_accuracy"].item() == 1.0
    smoothed, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, label_smoothing=0.1)
    assert math.isclose(smoothed.item(), 0.9 * softplus(-0.2) + 0.1 * softplus(0.2), rel_tol=1e-6)


def test_dpo_gradient_signs():
    pc, pr = torch.full((3,), -5.0, requires_grad=True), torch.full((3,), -5.0, requires_grad=True)
    loss, _ = dpo_loss(pc, pr, torch.full((3,), -4.0), torch.full((3,), -6.0), beta=0.5)
    g_c, g_r = torch.autograd.grad(loss, (pc, pr))
    assert (g_c < 0).all() and (g_r > 0).all()  # descent raises chosen, lowers rejected
    # a policy that prefers the chosen answer more than the reference has a lower loss
    better, _ = dpo_loss(pc + 1, pr - 1, torch.full((3,), -4.0), torch.full((3,), -6.0), beta=0.5)
    assert better.item() < loss.item()


def test_ipo_hand_worked_and_minimum_at_half_inverse_beta():
    z = torch.zeros(2)
    loss, _ = ipo_loss(z, z, z, z, beta=0.1)
    assert math.isclose(loss.item(), (1 / (2 * 0.1)) ** 2, rel_tol=1e-6)  # 25
    # h = (−1 − −2) − (−3 − −2) = 2 = 1/(2·0.25): the loss's minimum
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-1.0, -3.0, -2.0, -2.0))
    at_min, stats = ipo_loss(pc, pr, rc, rr, beta=0.25)
    assert at_min.item() == 0.0
    assert math.isclose(stats["reward_margin"].item(), 0.25 * 2, rel_tol=1e-6)


def test_simpo_hand_worked():
    loss, stats = simpo_loss(torch.tensor([-1.0]), torch.tensor([-2.0]), beta=2.0, gamma=0.5)
    # β·lp_c − β·lp_r − γ = −2 + 4 − 0.5 = 1.5
    assert math.isclose(loss.item(), softplus(-1.5), rel_tol=1e-6)
    assert stats["chosen_rewards"].item() == -2.0 and stats["rejected_rewards"].item() == -4.0
    equal, _ = simpo_loss(torch.zeros(2), torch.zeros(2), beta=2.0, gamma=0.0)
    assert math.isclose(equal.item(), math.log(2.0), rel_tol=1e-6)


def test_preference_table():
    assert PREFERENCE_LOSSES == {"dpo": dpo_loss, "ipo": ipo_loss, "simpo": simpo_loss}
    assert REFERENCE_FREE <= set(PREFERENCE_LOSSES) and REFERENCE_FREE == {"simpo"}
