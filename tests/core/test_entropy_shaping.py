"""Issue 37's pure math: DAPO's overlong penalty and how it adds to the missing-EOS penalty, the top-entropy token
mask (TRL's top_entropy_quantile), the entropy bonus's gradient, and the adaptive entropy coefficient."""

import json
import math

import pytest
import torch

from rlhflab.core import (AdaptiveEntropyController, entropy_bonus, length_shaped_scores, overlong_penalty,
                          top_entropy_mask)
from rlhflab.core.logprobs import chunked_head_logprobs, entropy_from_logits


# --- overlong shaping ---------------------------------------------------------------------------------------


def test_overlong_penalty_at_hand_worked_lengths():
    # cap 20, buffer 4, factor 1: free up to 16 tokens, then (length - 16) / 4
    lengths = torch.tensor([1, 15, 16, 17, 18, 19, 20])
    torch.testing.assert_close(overlong_penalty(lengths, 20, 4, 1.0),
                               torch.tensor([0.0, 0.0, 0.0, 0.25, 0.5, 0.75, 1.0]))
    # TRL's docstring example: cap 100, cache 20, a 90-token completion -> -0.5; factor 0.5 halves it
    assert overlong_penalty(torch.tensor([90]), 100, 20, 1.0).item() == pytest.approx(0.5)
    assert overlong_penalty(torch.tensor([90]), 100, 20, 0.5).item() == pytest.approx(0.25)
    # the buffer is the whole cap: linear from the first token
    torch.testing.assert_close(overlong_penalty(torch.tensor([0, 3, 6]), 6, 6, 2.0), torch.tensor([0.0, 1.0, 2.0]))
    # off: buffer 0 or factor 0
    assert (overlong_penalty(lengths, 20, 0, 1.0) == 0).all() and (overlong_penalty(lengths, 20, 4, 0.0) == 0).all()


def test_overlong_penalty_with_a_one_token_buffer_and_past_the_cap():
    """A buffer of 1 is on (only the last token pays, all of it); a length past the cap (a caller's own limit)
    pays the whole factor, never more."""
    assert overlong_penalty(torch.tensor([5, 6]), 6, 1, 1.0).tolist() == [0.0, 1.0]
    assert overlong_penalty(torch.tensor([10, 12]), 10, 4, 0.5).tolist() == [0.5, 0.5]


def test_overlong_and_missing_eos_penalties_add_up():
    """cap 10, buffer 4, factor 1, missing_eos_penalty 1, every reward 1: a short answer keeps 1; one that ends
    with EOS in the buffer pays its share; one cut at the cap without EOS pays both, 1 + 1."""
    scores = torch.ones(5)
    lengths = torch.tensor([3, 7, 8, 10, 10])
    eos = torch.tensor([True, True, True, True, False])
    got = length_shaped_scores(scores, lengths, eos, 1.0, 10, 4, 1.0)
    torch.testing.assert_close(got, torch.tensor([1.0, 0.75, 0.5, 0.0, -1.0]))
    # without the overlong penalty: the missing-EOS penalty alone (the loop's old formula)
    torch.testing.assert_close(length_shaped_scores(scores, lengths, eos, 1.0, 10),
                               torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0]))
    # and with no missing-EOS penalty the cut answer pays exactly the full overlong factor
    assert length_shaped_scores(scores, lengths, eos, 0.0, 10, 4, 0.5)[4].item() == pytest.approx(0.5)


# --- the top-entropy mask ------------------------------------------------------------------------------------


ENTROPY = torch.tensor([[0.1, 0.9, 0.5, 7.0],
                        [0.3, 0.7, 0.2, 9.0],
                        [0.8, 0.4, 0.6, 0.0]])
MASK = torch.tensor([[True, True, True, False],  # 7.0 and 9.0 sit on padding: never kept, never counted
                     [True, True, True, False],
                     [True, True, True, True]])


def test_top_entropy_mask_keeps_exactly_the_highest_share():
    # the 10 masked entropies sorted: 0.0 0.1 0.2 0.3 0.4 0.5 0.6 0.7 0.8 0.9
    # rho 0.2: the 0.8 quantile (linear) = 0.7 + 0.2 * (0.8 - 0.7) = 0.72 -> 0.8 and 0.9 kept
    want = torch.tensor([[False, True, False, False], [False, False, False, False], [True, False, False, False]])
    assert torch.equal(top_entropy_mask(ENTROPY, MASK, 0.2), want)
    # rho 0.5: the median 0.45 -> the top five 0.5 ... 0.9
    want = torch.tensor([[False, True, True, False], [False, True, False, False], [True, False, True, False]])
    assert torch.equal(top_entropy_mask(ENTROPY, MASK, 0.5), want)
    # rho 1: every masked token (the minimum is the 0 quantile); rho 0: the highest one only
    assert torch.equal(top_entropy_mask(ENTROPY, MASK, 1.0), MASK)
    assert top_entropy_mask(ENTROPY, MASK, 0.0).nonzero().tolist() == [[0, 1]]
    # ties at the threshold are all kept, as TRL's `>=`
    tied = torch.tensor([[1.0, 2.0, 2.0, 0.5]])
    assert top_entropy_mask(tied, torch.ones(1, 4, dtype=torch.bool), 0.0).tolist() == [[False, True, True, False]]
    # no token: nothing kept
    assert not top_entropy_mask(ENTROPY, torch.zeros_like(MASK), 0.2).any()
    with pytest.raises(ValueError):
        top_entropy_mask(ENTROPY, MASK, 1.5)


# --- the entropy bonus -----------------------------------------------------------------------------------------


def test_entropy_bonus_gradient_by_hand_and_by_finite_differences():
    """-coef x sum_mask H / tokens: dH/dz = -p (log p + H) / temperature, so d(bonus)/dz = coef / tokens x
    p (log p + H) / temperature on the masked positions and 0 elsewhere: autograd through entropy_from_logits (float32
    inside) gives it, and central differences of the bonus in float64 agree with the hand-worked value."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    coef, tokens, temperature = 0.3, 4.0, 0.7  # `tokens`: the step's (this micro-batch holds 3 of its 4)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    p = logp.exp()
    h = -(p * logp).sum(-1, keepdim=True)
    by_hand = coef / tokens * p * (logp + h) / temperature * mask.unsqueeze(-1)

    z = logits.clone().requires_grad_(True)
    value = entropy_bonus(entropy_from_logits(z, temperature), mask, coef, tokens)
    value.backward()
    torch.testing.assert_close(z.grad, by_hand, atol=1e-6, rtol=1e-5)
    assert (z.grad[~mask] == 0).all()
    assert value.item() == pytest.approx(-coef * h.squeeze(-1)[mask].sum().item() / tokens, rel=1e-6)

    def bonus64(x):  # the same bonus, float64 throughout
        lp = torch.log_softmax(x / temperature, dim=-1)
        return entropy_bonus(-(lp.exp() * lp).sum(-1), mask, coef, tokens)

    eps = 1e-6
    numeric = torch.zeros_like(logits)
    for i in range(logits.numel()):
        step = torch.zeros(logits.numel(), dtype=torch.float64)
        step[i] = eps
        step = step.view_as(logits)
        numeric.view(-1)[i] = (bonus64(logits + step) - bonus64(logits - step)) / (2 * eps)
    torch.testing.assert_close(numeric, by_hand, atol=1e-9, rtol=1e-6)


def test_entropy_bonus_gradient_through_the_chunked_head_equals_the_full_logits():
    """The training forward's entropy comes from the vocabulary-chunked head (models/token_head.py): the bonus's
    gradient in the hidden states and the head's weight equals the one through whole logits."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 4, generator=gen).requires_grad_(True)
    weight = torch.randn(11, 4, generator=gen).requires_grad_(True)
    tokens = torch.randint(0, 11, (6,), generator=gen)
    mask = torch.tensor([True, True, False, True, True, True])
    _, entropy = chunked_head_logprobs(hidden, weight, tokens, chunk=2, temperature=0.9, entropy_grad=True)
    entropy_bonus(entropy, mask, 0.1, 5).backward()
    chunked = hidden.grad.clone(), weight.grad.clone()
    hidden.grad, weight.grad = None, None
    entropy_bonus(entropy_from_logits(hidden @ weight.T, 0.9), mask, 0.1, 5).backward()
    torch.testing.assert_close(chunked[0], hidden.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(chunked[1], weight.grad, atol=1e-6, rtol=1e-5)


# --- the adaptive coefficient ----------------------------------------------------------------------------------


def test_adaptive_entropy_coefficient_moves_the_right_way_within_its_bounds():
    ctl = AdaptiveEntropyController(0.01, target=0.5, delta=0.005, low=0.0, high=0.02)
    assert ctl.applied == 0.0  # no measurement yet: no bonus
    ctl.update(0.3)  # below the target: up, and applied
    assert ctl.value == pytest.approx(0.015) and ctl.applied == pytest.approx(0.015)
    ctl.update(0.5)  # at the target counts as below (TRL's <=)
    assert ctl.value == pytest.approx(0.02) and ctl.applied == pytest.approx(0.02)
    ctl.update(0.1)  # clamped at high
    assert ctl.value == pytest.approx(0.02)
    ctl.update(0.8)  # above: down, and not applied
    assert ctl.value == pytest.approx(0.015) and ctl.applied == 0.0
    for _ in range(5):
        ctl.update(2.0)
    assert ctl.value == 0.0  # clamped at low
    ctl.update(float("nan"))  # a measurement over no token: nothing moves
    assert ctl.value == 0.0 and ctl.entropy == 2.0


def test_adaptive_entropy_coefficient_resumes_exactly():
    measured = [0.9, 0.2, 0.3, 0.7, 0.1, 0.05, 0.6, 0.4]
    straight = AdaptiveEntropyController(0.0, 0.5, 0.01, 0.0, 1.0)
    path = []
    for h in measured:
        straight.update(h)
        path.append((straight.value, straight.applied))
    first = AdaptiveEntropyController(0.0, 0.5, 0.01, 0.0, 1.0)
    for h in measured[:3]:
        first.update(h)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint's state.json holds it
    resumed = AdaptiveEntropyController(0.3, 9.0, 0.5, 0.2, 0.4)  # other settings: the state wins
    resumed.load_state_dict(state)
    resumed_path = path[:3]
    for h in measured[3:]:
        resumed.update(h)
        resumed_path.append((resumed.value, resumed.applied))
    assert resumed_path == path
    fresh = AdaptiveEntropyController(0.0, 0.5, 0.01, 0.0, 1.0)
    fresh.load_state_dict(json.loads(json.dumps(fresh.state_dict())))  # no measurement yet round-trips too
    assert math.isinf(fresh.entropy) and fresh.applied == 0.0
    with pytest.raises(ValueError):
        fresh.load_state_dict({"kind": "adaptive", "value": 0.1})  # a KL controller's state


def test_entropy_bonus_of_a_one_token_step_and_the_controllers_bounds():
    # one token: -coef x its entropy, divided by 1, not by a floor above it
    assert entropy_bonus(torch.tensor([[2.0, 5.0]]), torch.tensor([[True, False]]), 1.0, 1).item() == -2.0
    AdaptiveEntropyController(0.1, 0.5, 0.0, 0.0, 1.0)  # delta 0: a constant coefficient, allowed
    fixed = AdaptiveEntropyController(0.3, 0.5, 0.01, 0.1, 0.1)  # low == high: pinned there
    assert fixed.value == 0.1
    for bad in ((-0.01, 0.0, 1.0), (0.01, -0.1, 1.0), (0.01, 0.5, 0.2)):  # delta < 0, low < 0, high < low
        with pytest.raises(ValueError, match="adaptive entropy needs"):
            AdaptiveEntropyController(0.1, 0.5, *bad)


def test_a_resumed_controller_applies_its_coefficient_before_its_next_measurement():
    """The last measured entropy travels with the state: right after a resume the bonus is the one the
    uninterrupted run applies (on, below the target; off, above it)."""
    for last, applied in ((0.3, True), (0.7, False)):
        first = AdaptiveEntropyController(0.2, 0.5, 0.01, 0.0, 1.0)
        first.update(last)
        state = json.loads(json.dumps(first.state_dict()))
        assert state["entropy"] == last
        resumed = AdaptiveEntropyController(0.0, 0.5, 0.01, 0.0, 1.0)
        resumed.load_state_dict(state)
        assert resumed.entropy == last and resumed.applied == (first.value if applied else 0.0)
    fresh = AdaptiveEntropyController(0.2, 0.5, 0.01, 0.0, 1.0).state_dict()
    assert fresh["entropy"] is None  # no measurement yet (JSON has no inf)
    with pytest.raises(ValueError, match="expected 'adaptive_entropy'"):
        AdaptiveEntropyController(0.2, 0.5, 0.01, 0.0, 1.0).load_state_dict({**fresh, "kind": "other"})
