import math

import torch

from rlhflab.core.masked import mask_from_lengths, masked_mean, masked_var, whiten


def test_masked_mean_ignores_masked_values_even_nan():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    mask = torch.tensor([[True, True, False], [True, False, True]])
    assert masked_mean(x, mask).item() == (1 + 2 + 4 + 6) / 4
    assert masked_mean(x, mask, dim=1).tolist() == [1.5, 5.0]


def test_masked_var_matches_unbiased_variance_of_real_entries():
    x = torch.tensor([[1.0, 5.0, 100.0], [3.0, 7.0, -100.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    real = torch.tensor([1.0, 5.0, 3.0, 7.0])
    assert math.isclose(masked_var(x, mask).item(), real.var(unbiased=True).item(), rel_tol=1e-6)
    assert math.isclose(masked_var(x, mask, unbiased=False).item(), real.var(unbiased=False).item(), rel_tol=1e-6)


def test_whiten_gives_zero_mean_unit_variance_on_real_entries_and_zero_elsewhere():
    torch.manual_seed(0)
    x = torch.randn(4, 7) * 3 + 2
    mask = mask_from_lengths(torch.tensor([7, 3, 5, 1]), 7)
    w = whiten(x, mask)
    assert abs(masked_mean(w, mask).item()) < 1e-6
    assert abs(masked_var(w, mask).item() - 1.0) < 1e-4
    assert (w[~mask] == 0).all()


def test_whiten_without_mean_shift_keeps_the_mean():
    x = torch.tensor([[1.0, 3.0, 5.0]])
    mask = torch.ones_like(x, dtype=torch.bool)
    w = whiten(x, mask, shift_mean=False)
    # std of [1, 3, 5] (unbiased) is 2: (x - 3) / 2 + 3
    assert torch.allclose(w, torch.tensor([[2.0, 3.0, 4.0]]), atol=1e-6)


def test_mask_from_lengths():
    assert mask_from_lengths(torch.tensor([0, 2, 3]), 3).tolist() == [
        [False, False, False], [True, True, False], [True, True, True]
    ]
