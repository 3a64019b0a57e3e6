import math

import pytest
import torch

from rlhflab.core.advantages import (
    ADVANTAGES,
    MovingAverageBaseline,
    batch_mean_baseline,
    discounted_returns,
    gae,
    grpo_advantages,
    rloo_advantages,
)
from rlhflab.core.masked import mask_from_lengths


def naive_gae(rewards, values, lengths, gamma, lam):
    """A_t = Σ_l (γλ)^l δ_{t+l}, δ_t = r_t + γ V_{t+1} − V_t, V = 0 after the last real token."""
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        v = [values[b, t].item() for t in range(n)] + [0.0]
        deltas = [rewards[b, t].item() + gamma * v[t + 1] - v[t] for t in range(n)]
        for t in range(n):
            adv[b, t] = sum((gamma * lam) ** l * deltas[t + l] for l in range(n - t))
    return adv


def ragged(seed, B=6, T=9):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([0, T] + torch.randint(1, T + 1, (B - 2,), generator=g).tolist())
    mask = mask_from_lengths(lengths, T)
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    rewards[~mask] = float("nan")  # padding must never leak in
    values[~mask] = float("inf")
    return rewards, values, mask, lengths


def test_gae_hand_worked():
    rewards, values = torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.8]])
    adv, ret = gae(rewards, values, torch.tensor([[True, True]]), gamma=0.9, lam=0.5)
    # δ1 = 1 − 0.8 = 0.2; δ0 = 0.9·0.8 − 0.5 = 0.22; A0 = 0.22 + 0.45·0.2 = 0.31
    torch.testing.assert_close(adv, torch.tensor([[0.31, 0.2]]))
    torch.testing.assert_close(ret, torch.tensor([[0.81, 1.0]]))


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_equals_naive_sum_on_ragged_masks(gamma, lam, seed):
    rewards, values, mask, lengths = ragged(seed)
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    torch.testing.assert_close(adv, naive_gae(rewards, values, lengths, gamma, lam), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret[mask], (adv + values)[mask], rtol=0, atol=0)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_gae_with_gamma_lam_one_gives_reward_to_go_whatever_the_values():
    rewards, values, mask, _ = ragged(3)
    _, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(ret, discounted_returns(rewards, mask, gamma=1.0), rtol=1e-12, atol=1e-12)


def test_gae_rejects_a_mask_that_is_not_a_true_prefix():
    with pytest.raises(ValueError, match="right-padded"):
        gae(torch.zeros(1, 3), torch.zeros(1, 3), torch.tensor([[True, False, True]]), 1.0, 1.0)


def test_discounted_returns_hand_worked_and_masked():
    rewards = torch.tensor([[1.0, 2.0, 3.0], [5.0, float("nan"), float("nan")]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    got = discounted_returns(rewards, mask, gamma=0.5)
    # G2 = 3, G1 = 2 + 1.5 = 3.5, G0 = 1 + 1.75 = 2.75
    torch.testing.assert_close(got, torch.tensor([[2.75, 3.5, 3.0], [5.0, 0.0, 0.0]]))


def test_rloo_hand_worked_with_two_contiguous_groups():
    scores = torch.tensor([1.0, 2.0, 3.0, 6.0, 10.0, 10.0, 10.0, 10.0])
    got = rloo_advantages(scores, group_size=4)
    # 1 − (2+3+6)/3 = −8/3; 2 − 10/3 = −4/3; 3 − 3 = 0; 6 − 2 = 4; a constant group gets 0
    torch.testing.assert_close(got, torch.tensor([-8 / 3, -4 / 3, 0.0, 4.0, 0.0, 0.0, 0.0, 0.0]))


def test_grpo_hand_worked():
    scores = torch.tensor([1.0, 2.0, 3.0, 6.0, 10.0, 10.0, 10.0, 10.0])
    std = math.sqrt((4 + 1 + 0 + 9) / 3)  # unbiased std of [1, 2, 3, 6] around mean 3
    want = torch.tensor([-2.0, -1.0, 0.0, 3.0]) / (std + 1e-4)
    got = grpo_advantages(scores, group_size=4)
    torch.testing.assert_close(got, torch.cat([want, torch.zeros(4)]))
    unscaled = grpo_advantages(scores, group_size=4, scale="none")
    torch.testing.assert_close(unscaled, torch.tensor([-2.0, -1.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0]))


@pytest.mark.parametrize("name", ["rloo", "grpo"])
def test_group_advantages_reject_bad_group_sizes(name):
    with pytest.raises(ValueError, match="group_size"):
        ADVANTAGES[name](torch.zeros(6), 4)
    with pytest.raises(ValueError, match="group_size"):
        ADVANTAGES[name](torch.zeros(6), 1)


def test_batch_mean_baseline():
    got = batch_mean_baseline(torch.tensor([1.0, 2.0, 3.0, 6.0]))
    torch.testing.assert_close(got, torch.tensor([-2.0, -1.0, 0.0, 3.0]))


def test_moving_average_baseline_hand_worked_and_round_trip():
    base = MovingAverageBaseline(decay=0.9)
    torch.testing.assert_close(base.advantages(torch.tensor([1.0, 3.0])), torch.tensor([1.0, 3.0]))  # baseline 0
    base.update(torch.tensor([1.0, 3.0]))  # first update: the batch mean, 2
    assert base.value == 2.0
    base.update(torch.tensor([4.0, 4.0]))  # 0.9·2 + 0.1·4 = 2.2
    assert math.isclose(base.value, 2.2, rel_tol=1e-12)
    torch.testing.assert_close(base.advantages(torch.tensor([3.0])), torch.tensor([0.8]))
    other = MovingAverageBaseline(decay=0.5)
    other.load_state_dict(base.state_dict())
    base.update(torch.tensor([0.0]))
    other.update(torch.tensor([0.0]))
    assert other.value == base.value
