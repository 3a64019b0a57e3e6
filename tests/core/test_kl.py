import json
import math

import pytest
import torch

from rlhflab.core.kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_k1, kl_k2, kl_k3

LOG2 = math.log(2.0)


def test_estimators_hand_worked():
    # π = 0.5, π_ref = 0.25: log-ratio ln 2, r = π_ref/π = 1/2
    lp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    assert math.isclose(kl_k1(lp, ref).item(), LOG2, rel_tol=1e-6)
    assert math.isclose(kl_k2(lp, ref).item(), 0.5 * LOG2**2, rel_tol=1e-6)
    assert math.isclose(kl_k3(lp, ref).item(), (0.5 - 1.0) + LOG2, rel_tol=1e-5)  # 0.193147
    # swapped: r = 2 -> k3 = 1 - ln 2 = 0.306853, k1 negative
    assert math.isclose(kl_k1(ref, lp).item(), -LOG2, rel_tol=1e-6)
    assert math.isclose(kl_k3(ref, lp).item(), 1.0 - LOG2, rel_tol=1e-5)


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_every_estimator_is_exactly_zero_when_policy_equals_reference(name):
    torch.manual_seed(0)
    lp = torch.log_softmax(torch.randn(4, 6, 9), dim=-1)[..., 0]
    assert (KL_ESTIMATORS[name](lp, lp.clone()) == 0).all()


def test_k2_and_k3_are_nonnegative():
    torch.manual_seed(1)
    lp, ref = torch.randn(8, 50) * 3, torch.randn(8, 50) * 3
    assert (kl_k2(lp, ref) >= 0).all()
    assert (kl_k3(lp, ref) >= 0).all()


def test_k1_and_k3_expectations_under_policy_equal_the_true_kl():
    # Exact expectation over a categorical's full support: Σ_i p_i k(i) == KL(p || q).
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    true_kl = (p * (p / q).log()).sum().item()
    for fn in (kl_k1, kl_k3):
        est = (p * fn(p.log()[None], q.log()[None])[0]).sum().item()
        assert math.isclose(est, true_kl, rel_tol=1e-12)
    assert (p * kl_k2(p.log()[None], q.log()[None])[0]).sum().item() != pytest.approx(true_kl)  # k2 biased


def test_mask_zeroes_padding_even_nan_and_keeps_gradients_finite():
    lp = torch.tensor([[-1.0, float("nan")]], requires_grad=True)
    ref = torch.tensor([[-2.0, float("-inf")]])
    mask = torch.tensor([[True, False]])
    for fn in KL_ESTIMATORS.values():
        out = fn(lp, ref, mask)
        assert out[0, 1].item() == 0.0 and math.isfinite(out[0, 0].item())
        (grad,) = torch.autograd.grad(out.sum(), lp)
        assert torch.isfinite(grad).all() and grad[0, 1].item() == 0.0


def test_fixed_controller_never_moves_and_round_trips():
    ctl = FixedKLController(0.05)
    ctl.update(current_kl=100.0, n_steps=512)
    assert ctl.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(json.loads(json.dumps(ctl.state_dict())))
    assert other.value == 0.05


def test_adaptive_controller_hand_worked_updates():
    ctl = AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=10000)
    ctl.update(current_kl=8.0, n_steps=256)  # 8/6 - 1 = 0.333 -> clipped to +0.2
    assert math.isclose(ctl.value, 0.2 * (1 + 0.2 * 256 / 10000), rel_tol=1e-12)  # 0.201024
    assert math.isclose(ctl.value, 0.201024, rel_tol=1e-12)
    ctl.update(current_kl=5.7, n_steps=100)  # 5.7/6 - 1 = -0.05, inside the clip
    assert math.isclose(ctl.value, 0.201024 * (1 - 0.05 * 100 / 10000), rel_tol=1e-12)
    ctl.update(current_kl=0.0, n_steps=1000)  # -1 -> clipped to -0.2
    assert math.isclose(ctl.value, 0.201024 * 0.9995 * 0.98, rel_tol=1e-12)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_adaptive_controller_ignores_a_non_finite_kl(bad):
    # an update skipped for non-finite advantages (--nonfinite skip) can still report a NaN KL
    ctl = AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=10000)
    ctl.update(current_kl=bad, n_steps=256)
    assert ctl.value == 0.2
    ctl.update(current_kl=8.0, n_steps=256)  # and it keeps steering afterwards
    assert math.isclose(ctl.value, 0.201024, rel_tol=1e-12)


def test_adaptive_controller_state_round_trips_through_json_and_resumes_identically():
    a = AdaptiveKLController(0.1, target=3.0, horizon=500)
    a.update(4.0, 64)
    b = AdaptiveKLController(9.9, target=1.0, horizon=1)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for kl in (2.0, 7.5, 3.1):
        a.update(kl, 64)
        b.update(kl, 64)
        assert a.value == b.value
    with pytest.raises(ValueError, match="adaptive"):
        b.load_state_dict(FixedKLController(0.1).state_dict())
