"""core.pass_fail_loss by hand: the mean binary cross-entropy of scores read as pass / fail logits."""

import math

import pytest
import torch

from rlhflab.core import pass_fail_loss


def test_pass_fail_loss_by_hand():
    chosen, rejected = torch.tensor([0.0, 2.0]), torch.tensor([0.0, -1.0])
    # chosen: -log sigmoid(0) = log 2, -log sigmoid(2) = log(1 + e^-2); rejected: -log(1 - sigmoid(r)) = log(1 + e^r)
    expected = 0.5 * ((math.log(2) + math.log1p(math.exp(-2))) / 2 + (math.log(2) + math.log1p(math.exp(-1))) / 2)
    assert pass_fail_loss(chosen, rejected).item() == pytest.approx(expected, rel=1e-6)


def test_it_pulls_chosen_up_and_rejected_down_whatever_their_order():
    chosen = torch.tensor([-3.0, 5.0], requires_grad=True)
    rejected = torch.tensor([-4.0, 4.0], requires_grad=True)  # both pairs ordered right: BT alone is content
    pass_fail_loss(chosen, rejected).backward()
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()  # descent raises chosen, lowers rejected
    assert abs(chosen.grad[0]) > abs(chosen.grad[1])  # most where a chosen score sits below the threshold
