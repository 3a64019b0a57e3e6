"""parallel_strategy deepspeed without processes (no deepspeed import needed): the launch settings read from
accelerate's environment, their refusals, the ZeRO-3 test hook, how a step abandoned half-way is handed to the
engine, and how an engine's own step is turned into clip_and_step's outcome (kept / dropped / stopped). The
trainings themselves: test_deepspeed.py and test_deepspeed_online.py."""

import math
from types import SimpleNamespace

import pytest
import torch

from rlhflab import parallel
from rlhflab.errors import UserInputError
from rlhflab.parallel import deepspeed_engine
from rlhflab.trainers.nonfinite import clip_and_step

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


def test_zero3_keeps_small_tensors_whole_unless_the_test_hook_sets_the_threshold(monkeypatch):
    two = parallel.World(rank=0, world_size=2)
    assert deepspeed_engine.engine_config(two, 3, 1.0)["zero_optimization"] == {"stage": 3}  # DeepSpeed's default
    monkeypatch.setenv(deepspeed_engine.PERSISTENCE_VARIABLE, "0")
    assert deepspeed_engine.engine_config(two, 3, 1.0)["zero_optimization"] == {
        "stage": 3, "stage3_param_persistence_threshold": 0}
    assert deepspeed_engine.engine_config(two, 2, 1.0)["zero_optimization"] == {"stage": 2}  # ZeRO-3 only


class BackwardEngine:
    """What `Wrapped.drop_step` asks of a DeepSpeed engine: the boundary flag and one backward."""

    def __init__(self):
        self.boundary, self.losses = False, []

    def set_gradient_accumulation_boundary(self, flag: bool) -> None:
        self.boundary = flag

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        self.losses.append((loss.item(), scale_wrt_gas))


def test_a_step_abandoned_half_way_is_handed_to_deepspeed_as_its_last_non_finite_backward():
    engine = BackwardEngine()
    wrapped = parallel.Wrapped(torch.nn.Linear(1, 1), engine, parallel.Layout("deepspeed", parallel.World(0, 2)),
                               zero_stage=2)
    wrapped.drop_step(torch.tensor(0.5, requires_grad=True))
    assert engine.boundary and len(engine.losses) == 1 and math.isnan(engine.losses[0][0])  # its step drops it
    ddp = parallel.Wrapped(torch.nn.Linear(1, 1), None, parallel.Layout("ddp", parallel.World(0, 2)))
    ddp.drop_step(torch.tensor(float("nan")))  # nothing to clear in the engine: the trainer zeroes .grad


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
