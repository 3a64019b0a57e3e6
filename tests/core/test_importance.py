"""core.sampler_correction_weights against hand-worked numbers."""

import math

import pytest
import torch

from rlhflab.core import sampler_correction_weights

TRAINER = torch.tensor([[-1.0, -2.0, -7.0]])
SAMPLER = torch.tensor([[-1.5, -1.0, -3.0]])
MASK = torch.tensor([[True, True, False]])


@pytest.mark.parametrize("mode, low, high, expected", [
    ("token_truncate", 0.5, 1.2, [1.2, 0.5, 0.0]),  # ratios e^0.5 = 1.649 and e^-1 = 0.368, clamped
    ("token_mask", 0.5, 2.0, [math.exp(0.5), 0.0, 0.0]),  # e^-1 < 0.5: that token drops out
    ("sequence_truncate", 0.7, 3.0, [0.7, 0.7, 0.0]),  # the response's ratio e^(0.5 - 1) = 0.607, clamped
    ("sequence_mask", 0.5, 3.0, [math.exp(-0.5), math.exp(-0.5), 0.0]),
    ("sequence_mask", 0.7, 3.0, [0.0, 0.0, 0.0]),  # the whole response drops out
])
def test_weights_hand_worked(mode, low, high, expected):
    weights = sampler_correction_weights(TRAINER, SAMPLER, MASK, mode, low, high)
    assert weights[0].tolist() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_equal_log_probs_give_weights_of_exactly_one(mode):
    weights = sampler_correction_weights(TRAINER, TRAINER.clone(), MASK, mode, 0.0, 3.0)
    assert weights[0].tolist() == [1.0, 1.0, 0.0]


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unknown sampler correction"):
        sampler_correction_weights(TRAINER, SAMPLER, MASK, "none", 0.0, 3.0)
