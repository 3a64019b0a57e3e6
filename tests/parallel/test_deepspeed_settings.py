"""parallel_strategy deepspeed without processes (no deepspeed import needed): the launch settings read from
accelerate's environment, their refusals, the online methods' refusal, and how an engine's own step is turned
into clip_and_step's outcome (kept / dropped / stopped). The trainings themselves: test_deepspeed.py."""

import math
from types import SimpleNamespace

import pytest
import torch

from rlhflab import parallel
from rlhflab.errors import UserInputError
from rlhflab.parallel import deepspeed_engine
from rlhflab.trainers.nonfinite import clip_and_step
from rlhflab.trainers.online.ranks import wrap_roles

SETTINGS = ("ACCELERATE_DEEPSPEED_ZERO_STAGE", "ACCELERATE_DEEPSPEED_CONFIG_FILE",
            "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE")


@pytest.fixture(autouse=True)
def no_launch_settings(monkeypatch):
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)


def test_the_zero_stage_comes_from_accelerate_s_variable_default_2(monkeypatch):
    assert deepspeed_engine.zero_stage() == 2  # accelerate's DeepSpeedPlugin default
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    assert deepspeed_engine.zero_stage() == 3
    config = deepspeed_engine.engine_config(parallel.World(rank=0, world_size=4), 3, max_grad_norm=0.5)
    assert config["zero_optimization"] == {"stage": 3} and config["gradient_clipping"] == 0.5
    assert config["train_batch_size"] == 4 and config["gradient_accumulation_steps"] == 1
    assert deepspeed_engine.engine_config(parallel.World(rank=0, world_size=2), 2, 0.0)["gradient_clipping"] == 0.0


@pytest.mark.parametrize("setting, value, named", [
    ("ACCELERATE_DEEPSPEED_ZERO_STAGE", "1", "ZeRO stage '1' is not wired"),
    ("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "cpu", "offload of the optimiser state to cpu"),
    ("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "nvme", "offload of the weights to nvme"),
    ("ACCELERATE_DEEPSPEED_CONFIG_FILE", "ds.json", "deepspeed_config_file is not read"),
])
def test_settings_rlhflab_would_ignore_are_refused_with_the_fix(monkeypatch, setting, value, named):
    monkeypatch.setenv(setting, value)
    with pytest.raises(UserInputError) as err:
        deepspeed_engine.check_launch_settings()
        deepspeed_engine.zero_stage()
    assert named in str(err.value) and err.value.fix


def test_a_checkpoint_of_the_other_zero_stage_is_refused_before_the_engine_reads_it(tmp_path):
    (tmp_path / "zero.json").write_text('{"zero_stage": 2}')
    with pytest.raises(UserInputError) as err:
        deepspeed_engine.load_state(None, tmp_path, stage=3)  # no engine: refused before DeepSpeed is asked
    assert "holds ZeRO-2 slices; this run is ZeRO-3" in str(err.value)
    assert "ACCELERATE_DEEPSPEED_ZERO_STAGE=2" in err.value.fix


def test_the_online_methods_refuse_deepspeed_and_name_fsdp2(monkeypatch):
    two = parallel.World(rank=0, world_size=2)
    with pytest.raises(UserInputError) as err:
        wrap_roles(None, SimpleNamespace(parallel_strategy="deepspeed"), two)
    assert "not for the online methods" in str(err.value) and "fsdp2" in err.value.fix
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # accelerate launch --config_file zero3.yaml
    with pytest.raises(UserInputError):
        wrap_roles(None, SimpleNamespace(parallel_strategy="auto"), two)


class SteppingEngine:
    """A Wrapped whose engine steps AdamW itself and reports `norm` (DeepSpeed: inf for a step it dropped)."""

    steps_itself = True

    def __init__(self, norm: float):
        self.norm, self.steps = norm, 0
        self.optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)

    def step(self) -> torch.Tensor:
        self.steps += 1
        if math.isfinite(self.norm):
            self.optimizer.step()
        return torch.tensor(self.norm)


def step_through(engine: SteppingEngine, loss: float, mode: str):
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: 1.0 / (step + 1))
    return clip_and_step(engine.optimizer, scheduler, [], 1.0, loss, mode, "SFT", engine=engine), scheduler


def test_an_engine_step_counts_in_the_schedule_and_returns_its_norm():
    norm, scheduler = step_through(SteppingEngine(2.5), 1.0, "stop")
    assert norm.item() == 2.5 and scheduler.last_epoch == 1 and scheduler.get_last_lr() == [5e-4]


def test_a_step_the_engine_dropped_is_a_skip_or_a_stop():
    engine = SteppingEngine(math.inf)
    norm, scheduler = step_through(engine, math.nan, "skip")
    assert norm is None and engine.steps == 1 and scheduler.last_epoch == 0  # the schedule counts applied steps
    with pytest.raises(FloatingPointError, match="non-finite SFT gradient norm"):
        step_through(SteppingEngine(math.inf), 1.0, "stop")


def test_a_non_finite_loss_stops_before_the_engine_steps_or_when_it_applied_the_update():
    engine = SteppingEngine(1.0)
    with pytest.raises(FloatingPointError, match="non-finite SFT loss nan"):
        step_through(engine, math.nan, "stop")
    assert engine.steps == 0
    with pytest.raises(FloatingPointError, match="engine applied the update"):
        step_through(SteppingEngine(1.0), math.inf, "skip")
