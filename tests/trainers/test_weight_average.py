"""Weight averaging over the last steps (trainers/weight_average.py)."""

import json

import pytest
import torch
from safetensors.torch import load, save

from rlhflab.checkpoint.state import decode, encode

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


def through_a_checkpoint(state: dict) -> dict:
    """`state` saved and read back the way a checkpoint's progress is (JSON + safetensors, CPU tensors)."""
    tensors = {}
    text = json.dumps(encode(state, tensors))
    return decode(json.loads(text), load(save(tensors)))


def test_the_mean_is_the_arithmetic_mean_of_the_included_steps_and_survives_a_checkpoint():
    model = torch.nn.Linear(2, 3)
    snaps = snapshots_of(5)
    average = WeightAverage(model)
    for values in snaps[:2]:
        set_weights(model, values)
        average.update()
    resumed = WeightAverage(model, through_a_checkpoint(average.state()))
    assert all(t.dtype == torch.float32 and t.device == model.weight.device for t in resumed.mean.values())
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


def test_a_bf16_model_is_averaged_in_float32():
    model = torch.nn.Linear(2, 3).to(torch.bfloat16)
    average = WeightAverage(model)
    steps = 300
    with torch.no_grad():
        for step in range(steps):  # weights 1 + i/1000: their mean is 1.1495, which bf16 steps cannot hold
            model.weight.fill_(1 + step / 1000)
            average.update()
    assert average.mean["weight"].dtype == torch.float32
    exact = sum(float(torch.tensor(1 + s / 1000).to(torch.bfloat16)) for s in range(steps)) / steps
    assert average.mean["weight"][0, 0].item() == pytest.approx(exact, abs=1e-5)
