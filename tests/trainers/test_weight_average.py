"""Weight averaging over the last steps (trainers/weight_average.py)."""

import pytest
import torch

from rlhflab.trainers.weight_average import WeightAverage, first_averaged_step


@pytest.mark.parametrize("total, fraction, first", [(10, 0.4, 7), (10, 0.0, 11), (10, 1.0, 1), (10, 0.01, 10),
                                                    (3, 0.5, 2)])
def test_first_averaged_step_counts_the_last_fraction(total, fraction, first):
    assert first_averaged_step(total, fraction) == first


@pytest.mark.parametrize("fraction", [-0.1, 1.5])
def test_a_fraction_outside_0_1_is_refused(fraction):
    with pytest.raises(ValueError):
        first_averaged_step(10, fraction)


def snapshots_of(steps: int, seed: int = 0):
    torch.manual_seed(seed)
    return [[torch.randn(3, 2), torch.randn(3)] for _ in range(steps)]


def set_weights(model, values):
    with torch.no_grad():
        model.weight.copy_(values[0])
        model.bias.copy_(values[1])


def test_the_mean_is_the_arithmetic_mean_of_the_included_steps_and_survives_a_restart():
    model = torch.nn.Linear(2, 3)
    model.weight.requires_grad_(True)
    snaps = snapshots_of(5)
    average = WeightAverage(model)
    for values in snaps[:2]:
        set_weights(model, values)
        average.update()
    resumed = WeightAverage(model, average.state())  # as a checkpoint hands it back
    for values in snaps[2:]:
        set_weights(model, values)
        resumed.update()
    assert resumed.apply()
    expected_w = torch.stack([s[0] for s in snaps]).mean(0)
    expected_b = torch.stack([s[1] for s in snaps]).mean(0)
    assert torch.allclose(model.weight, expected_w, atol=1e-6) and torch.allclose(model.bias, expected_b, atol=1e-6)
    assert resumed.count == 5


def test_frozen_parameters_are_left_alone_and_no_steps_means_no_change():
    model = torch.nn.Linear(2, 3)
    model.bias.requires_grad_(False)
    bias = model.bias.detach().clone()
    average = WeightAverage(model)
    assert not average.apply()  # nothing averaged yet: the model is untouched
    set_weights(model, snapshots_of(1)[0])
    average.update()
    assert set(average.mean) == {"weight"}
    assert not torch.equal(model.bias, bias)  # set_weights moved it; apply must not move it back
    changed = model.bias.detach().clone()
    average.apply()
    assert torch.equal(model.bias, changed)
