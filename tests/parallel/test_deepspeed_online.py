"""The online loop under DeepSpeed ZeRO-2 and ZeRO-3 in two processes (torchrun, gloo, DeepSpeed's CPU
accelerator) trains what one process trains: PPO (ZeRO-2: a separate value model, ZeRO-3: LoRA with a value
adapter; one engine over policy and value, the value head at its own learning rate) and GRPO, the same weights
after 3 updates (max abs difference <= 1e-5 in
float32; the figure is printed) and metrics.jsonl; a resume from the engine's checkpoint equal to the
uninterrupted run; a saved model that `from_pretrained` loads; and a step abandoned half-way by a non-finite
loss (nonfinite=skip) dropped with what DeepSpeed had accumulated, as one process drops it.

ZeRO-3 partitions every weight here (RLHFLAB_ZERO3_PERSISTENCE_THRESHOLD=0: DeepSpeed would otherwise keep
the tiny model's small tensors whole), so rollouts sample from the per-rank gathered copy. All 2-process runs
go through one torchrun launch (deepspeed_online_driver.py); the single-process runs happen here.
Skipped where deepspeed is not installed (`pip install 'rlhflab[deepspeed]'`).
"""

import importlib.util
import json
import subprocess
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from parallel.deepspeed_online_driver import poison_minibatch
from parallel.test_online_ranks import (REWARD, THRESHOLD_COUNTS, TORCHRUN, assert_same_metrics, environment,
                                        max_weight_difference, run_args, train_here)
from runcheck import launch_failure
from safetensors.torch import load_file
from tinyhf import save_suite_model

from rlhflab.checkpoint.folder import complete_checkpoints, load_checkpoint
from rlhflab.trainers.online import passes

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="torch.distributed with gloo is not available in this torch build"),
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="deepspeed is not installed (pip install 'rlhflab[deepspeed]')"),
]

DRIVER = Path(__file__).with_name("deepspeed_online_driver.py")
PPO = ["--value_mode", "separate", "--value_head_learning_rate", "3e-3"]
# the step abandoned half-way: 4 micro-batches of one row a minibatch, 2 a process; the 2nd minibatch's last
# (process 1's second) has a NaN loss after process 0 has run both of its own backwards
NAN = ["--nonfinite", "skip", "--gradient_accumulation_steps", "4"]
NAN_AT = 1
# LoRA: the reference is the policy with its adapter off, a forward of the partitioned engine under ZeRO-3
LORA = ["--lora_r", "4", "--value_mode", "lora_adapter"]
# name: (the test_online_ranks run whose arguments it takes, extra flags, ZeRO stage, resumed from step-N (0: not))
RUNS = {
    "ppo-zero2": ("ppo-ddp", PPO, 2, 0),
    "grpo-zero2": ("grpo-ddp", [], 2, 0),
    "ppo-zero3-lora": ("ppo-ddp", LORA, 3, 1),
    "grpo-zero3": ("grpo-ddp", [], 3, 0),
    "ppo-zero2-nan": ("ppo-ddp", [*PPO, *NAN], 2, 0),
}
ONE = {"ppo": ("ppo-ddp", PPO), "ppo-lora": ("ppo-ddp", LORA), "grpo": ("grpo-ddp", []),
       "ppo-nan": ("ppo-ddp", [*PPO, *NAN])}


def arguments(base: str, extra: list[str], setup, out: Path, strategy: str) -> list[str]:
    root, policy_dir, reward = setup
    return [*run_args(base, policy_dir, reward, out, strategy), *extra]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepspeed-online")
    policy_dir = save_suite_model(root / "policy")
    (root / "digits.py").write_text(REWARD)
    return root, policy_dir, f"{root / 'digits.py'}:digits"


@pytest.fixture(scope="module")
def one_process(setup) -> Path:
    """PPO, GRPO and PPO with the NaN micro-batch in this process (the strategy is ignored in one process)."""
    out = setup[0] / "one"
    real = passes.micro_losses
    for name, (base, extra) in ONE.items():
        passes.micro_losses = poison_minibatch(NAN_AT) if name.endswith("nan") else real
        try:
            train_here(arguments(base, extra, setup, out / name, "deepspeed"))
        finally:
            passes.micro_losses = real
    return out


@pytest.fixture(scope="module")
def two_processes(setup) -> tuple[Path, float]:
    """Every RUNS entry by one 2-process launch; the launch's wall seconds."""
    work = setup[0] / "two"
    work.mkdir()
    jobs = [{"args": arguments(base, extra, setup, work / name, "deepspeed"), "zero_stage": stage,
             "resume_at": resume_at, "nan_at": NAN_AT if name.endswith("nan") else None}
            for name, (base, extra, stage, resume_at) in RUNS.items()]
    (setup[0] / "jobs.json").write_text(json.dumps(jobs))
    started = time.time()
    done = subprocess.run([*TORCHRUN, str(DRIVER), str(setup[0] / "jobs.json")], cwd=work, capture_output=True,
                          text=True, timeout=600, env=environment(RLHFLAB_ZERO3_PERSISTENCE_THRESHOLD="0"))
    assert done.returncode == 0, launch_failure(done)
    return work, time.time() - started


def uninterrupted(work: Path, name: str) -> Path:
    """The run as it first finished (a resumed run's folder holds the resumed one's model and metrics)."""
    return work / (f"{name}-uninterrupted" if RUNS[name][3] else name)


@pytest.mark.parametrize("name", list(RUNS))
def test_zero_in_two_processes_trains_what_one_process_trains(one_process, two_processes, name):
    work, wall = two_processes
    one = one_process / name.replace("-zero2", "").replace("-zero3", "")
    difference = max_weight_difference(one, uninterrupted(work, name))
    print(f"\n{name}: max |w1 - w2| = {difference:.2e} over 3 updates (the 2-process launch of all runs: {wall:.0f} s)")
    assert difference <= 1e-5
    # the engine steps AdamW on its flat slices, one process the fused AdamW (other rounding; ZeRO-3 also takes
    # the model's own forward, not the lean one): a ratio or value at a clip threshold may fall either side
    assert_same_metrics(one, uninterrupted(work, name), THRESHOLD_COUNTS)
    summary = json.loads((work / name / "summary.json").read_text())
    assert summary["parallel"]["world_size"] == 2 and summary["parallel"]["strategy"] == "deepspeed"
    assert summary["updates"] == 3 and summary["episodes"] == 24


def test_the_abandoned_step_is_dropped_as_one_process_drops_it(one_process, two_processes):
    """The NaN micro-batch's minibatch is skipped once in both; the weights above show nothing else moved."""
    work, _ = two_processes
    for run in (one_process / "ppo-nan", work / "ppo-zero2-nan"):
        assert json.loads((run / "summary.json").read_text())["nonfinite"] == {"mode": "skip", "skipped_updates": 1}
    dropped = max_weight_difference(one_process / "ppo", one_process / "ppo-nan")
    print(f"\nthe dropped step moves the weights by {dropped:.1e} (one process, with and without it)")
    assert dropped > 1e-5  # it mattered: without the drop both processes' weights would show it


@pytest.mark.parametrize("name", [name for name in RUNS if RUNS[name][3]])
def test_a_resume_from_the_engine_s_checkpoint_equals_the_uninterrupted_run(two_processes, name):
    work, _ = two_processes
    assert max_weight_difference(work / f"{name}-uninterrupted", work / name) <= 1e-6
    assert_same_metrics(work / f"{name}-uninterrupted", work / name)
    assert [r["step"] for r in json.loads((work / name / "summary.json").read_text())["resumes"]] == [RUNS[name][3]]


def test_rank_0_alone_writes_and_checkpoints_hold_every_rank_s_zero_slices(two_processes):
    work, _ = two_processes
    expected = {*RUNS, *(f"{name}-uninterrupted" for name in RUNS if RUNS[name][3])}
    assert {p.name for p in work.iterdir()} == expected  # nothing else, no default runs/ folder
    for name, (_, _, stage, _) in RUNS.items():
        last = complete_checkpoints(work / name / "checkpoints")[-1]
        _, weights, state = load_checkpoint(last)
        assert state["parallel"] == {"strategy": "deepspeed", "world_size": 2, "sharded_state": True}
        assert weights == {}  # weights and AdamW moments are in the engine's files
        slices = sorted(p.name for p in (last / "sharded" / "engine").glob("*optim_states.pt"))
        assert slices == [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)], name
        assert json.loads((last / "sharded" / "zero.json").read_text()) == {"zero_stage": stage}


@pytest.mark.parametrize("name", ["ppo-zero2", "grpo-zero3"])
def test_the_saved_policy_loads_with_from_pretrained_and_holds_the_trained_weights(setup, one_process,
                                                                                     two_processes, name):
    from transformers import AutoModelForCausalLM

    work, _ = two_processes
    loaded = AutoModelForCausalLM.from_pretrained(work / name / "model").state_dict()
    one = load_file(str(one_process / name.split("-")[0] / "model" / "model.safetensors"))
    start = load_file(str(Path(setup[1]) / "model.safetensors"))
    assert one.keys() <= loaded.keys()
    assert max((loaded[k] - one[k]).abs().max().item() for k in one) <= 1e-5
    moved = max((loaded[k] - start[k]).abs().max().item() for k in start)
    print(f"\n{name}: the saved policy moved {moved:.1e} from the start")
    assert moved > 1e-4
