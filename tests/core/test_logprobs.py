import math

import torch

from rlhflab.core.logprobs import entropy_from_logits, selective_log_softmax, shifted_token_logprobs


def test_selective_log_softmax_hand_worked():
    # logits [0, ln 3] -> probs [1/4, 3/4]
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    got = selective_log_softmax(logits, torch.tensor([[1]]))
    assert math.isclose(got.item(), math.log(0.75), rel_tol=1e-6)


def test_selective_log_softmax_applies_temperature():
    logits = torch.tensor([[[0.0, 2.0 * math.log(3.0)]]])  # / T=2 -> [0, ln 3]
    got = selective_log_softmax(logits, torch.tensor([[0]]), temperature=2.0)
    assert math.isclose(got.item(), math.log(0.25), rel_tol=1e-6)


def test_selective_log_softmax_matches_naive_loop():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    tokens = torch.randint(0, 11, (3, 5))
    got = selective_log_softmax(logits, tokens, temperature=0.7)
    for b in range(3):
        for t in range(5):
            ref = torch.log_softmax(logits[b, t] / 0.7, dim=-1)[tokens[b, t]]
            assert math.isclose(got[b, t].item(), ref.item(), rel_tol=1e-5, abs_tol=1e-6)


def test_shifted_logprobs_use_previous_position_logits():
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 2] = 10.0  # position 0 predicts token at position 1
    ids = torch.tensor([[0, 2, 1]])
    got = shifted_token_logprobs(logits, ids)
    assert got.shape == (1, 2)
    assert got[0, 0].item() > -1e-3  # token 2 was near-certain
    assert math.isclose(got[0, 1].item(), math.log(0.25), rel_tol=1e-6)  # uniform at position 1


def test_entropy_uniform_and_peaked():
    uniform = torch.zeros(1, 1, 8)
    assert math.isclose(entropy_from_logits(uniform).item(), math.log(8), rel_tol=1e-6)
    peaked = torch.tensor([[[100.0, 0.0, 0.0]]])
    assert entropy_from_logits(peaked).item() < 1e-6


def test_shifted_logprobs_apply_temperature():
    logits = torch.zeros(1, 2, 2)
    logits[0, 0, 1] = 2.0 * math.log(3.0)  # / T=2 -> [0, ln 3] -> [1/4, 3/4]
    got = shifted_token_logprobs(logits, torch.tensor([[0, 1]]), temperature=2.0)
    assert math.isclose(got.item(), math.log(0.75), rel_tol=1e-6)


def test_entropy_hand_worked_and_at_a_temperature():
    # logits [0, ln 3] -> probs [1/4, 3/4]; at T=2 the same logits doubled give them again
    quarter = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert math.isclose(entropy_from_logits(torch.tensor([[[0.0, math.log(3.0)]]])).item(), quarter, rel_tol=1e-6)
    doubled = torch.tensor([[[0.0, 2.0 * math.log(3.0)]]])
    assert math.isclose(entropy_from_logits(doubled, temperature=2.0).item(), quarter, rel_tol=1e-6)
