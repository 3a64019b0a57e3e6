"""Mixed precision (models/precision.py): the three fields resolve to one choice, impossible ones are refused
naming the flag and the alternative, and the autocast / scaler object does what it says."""

import pytest
import torch

from rlhflab.errors import UserInputError
from rlhflab.models.precision import MixedPrecision, requested_precision, resolve_precision, skip_overflow

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.fixture
def cuda_bf16(monkeypatch):
    """Pretend to be on a CUDA device; the test sets whether it has bf16."""
    def set_bf16(has: bool):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: has)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100")
    return set_bf16


@pytest.mark.parametrize("fields,want", [
    (("auto", False, False), ("auto", "--mixed_precision auto")),
    (("no", False, False), ("no", "--mixed_precision no")),
    (("auto", True, False), ("bf16", "--bf16")),
    (("bf16", True, False), ("bf16", "--bf16")),  # saying it twice is no contradiction
    (("auto", False, True), ("fp16", "--fp16")),
    (("fp16", False, False), ("fp16", "--mixed_precision fp16")),
])
def test_the_three_fields_make_one_choice_and_name_the_flag(fields, want):
    assert requested_precision(*fields) == want


@pytest.mark.parametrize("fields,named", [
    (("auto", True, True), ["--bf16", "--fp16"]),
    (("fp16", True, False), ["--bf16", "--mixed_precision fp16"]),
    (("no", False, True), ["--fp16", "--mixed_precision no"]),
])
def test_contradicting_fields_are_refused_naming_both_flags(fields, named):
    with pytest.raises(UserInputError) as err:
        requested_precision(*fields)
    assert all(flag in str(err.value) for flag in named), str(err.value)


def test_auto_is_float32_on_a_cpu_and_bf16_on_a_gpu_that_has_it(cuda_bf16):
    assert resolve_precision("auto", False, False, CPU) == "no"
    assert resolve_precision("bf16", False, False, CPU) == "bf16"  # asked for: bf16 autocast runs on a CPU
    cuda_bf16(True)
    assert resolve_precision("auto", False, False, CUDA) == "bf16"
    assert resolve_precision("auto", False, True, CUDA) == "fp16"
    cuda_bf16(False)
    assert resolve_precision("auto", False, False, CUDA) == "no"


@pytest.mark.parametrize("fields,flag", [(("auto", False, True), "--fp16"), (("fp16", False, False),
                                                                          "--mixed_precision fp16")])
def test_fp16_on_a_cpu_is_refused_naming_the_flag_and_the_alternatives(fields, flag):
    with pytest.raises(UserInputError) as err:
        resolve_precision(*fields, CPU)
    message = str(err.value)
    assert message.startswith(flag) and "--bf16" in message and "--mixed_precision no" in message, message


def test_bf16_on_a_gpu_without_it_is_refused_pointing_to_fp16(cuda_bf16):
    cuda_bf16(False)
    with pytest.raises(UserInputError) as err:
        resolve_precision("auto", True, False, CUDA)
    assert str(err.value).startswith("--bf16") and "Tesla V100" in str(err.value) and "--fp16" in str(err.value)


def test_fp16_under_deepspeed_is_refused_bf16_is_not(cuda_bf16):
    cuda_bf16(True)
    with pytest.raises(UserInputError, match="DeepSpeed"):
        resolve_precision("fp16", False, False, CUDA, strategy="deepspeed")
    assert resolve_precision("bf16", False, False, CUDA, strategy="deepspeed") == "bf16"


def test_autocast_computes_matmuls_in_bf16_over_float32_weights_and_float32_without_it():
    layer = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    bf16, none = MixedPrecision("bf16", "cpu"), MixedPrecision("no", "cpu")
    with bf16.autocast():
        out = layer(x)
    assert out.dtype == torch.bfloat16 and layer.weight.dtype == torch.float32
    want = torch.nn.functional.linear(x.bfloat16(), layer.weight.bfloat16(), layer.bias.bfloat16())
    assert torch.equal(out, want)  # the cast-then-multiply of the float32 masters, nothing else
    with none.autocast():
        assert layer(x).dtype == torch.float32
    assert bf16.scaler is None and none.scaler is None and bf16.metrics() == {} == none.metrics()
    assert bf16.scale(out.sum()) is not None and bf16.describe()["autocast_dtype"] == "bfloat16"
    assert none.describe() == {"mixed_precision": "no", "autocast_dtype": None, "device": "cpu",
                               "master_weights": "float32"}


def test_fp16_scaler_scales_the_loss_and_backs_off_by_half_on_overflow():
    precision = MixedPrecision("fp16", "cpu")
    loss = torch.tensor(3.0, requires_grad=True)
    assert precision.scale(loss).item() == 3.0 * 2.0**16  # GradScaler's initial scale
    skip_overflow(precision)
    assert precision.metrics() == {"amp/scale": 2.0**15, "amp/skipped_steps": 1} and precision.overflowed
    state = precision.state_dict()
    again = MixedPrecision("fp16", "cpu")
    again.load_state_dict(state)  # a resumed run continues with the lowered scale and the count
    assert again.metrics() == precision.metrics()
