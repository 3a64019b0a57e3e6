"""DeepSpeed ZeRO-2 / ZeRO-3 in two processes (torchrun, gloo, DeepSpeed's CPU accelerator) train what one
process trains: SFT, reward model and DPO (LoRA too), the same weights (max abs difference <= 1e-5 in float32;
the figure is printed) and metrics.jsonl, a resume from the engine's own checkpoint equal to the uninterrupted
run bit for bit, and a saved model that `from_pretrained` loads (the online methods: test_deepspeed_online.py).

One torchrun launch per ZeRO stage (the stage comes from ACCELERATE_DEEPSPEED_ZERO_STAGE, as `accelerate launch`
sets it) runs that stage's trainings through launch_runs.py; the single-process runs happen here, in-process.
Skipped where deepspeed is not installed (`pip install 'rlhflab[deepspeed]'`).
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from runcheck import launch_failure
from safetensors.torch import load_file
from parallel.test_two_processes import (TOLERANCE, assert_same_metrics, assert_same_weights_in, dpo_args, launch,
                                         max_weight_difference,
                                         metric_rows, rm_args, sft_args, train_here)
from tinyhf import save_suite_model

from rlhflab.checkpoint import MARKER, complete_checkpoints
from rlhflab.cli import main

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="torch.distributed with gloo is not available in this torch build"),
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="deepspeed is not installed (pip install 'rlhflab[deepspeed]')"),
]

HERE = Path(__file__).parent
DEEPSPEED = ["--parallel_strategy", "deepspeed"]
# name: (arguments, extra flags, ZeRO stage, checkpoint the resume starts from, 0: no resume). RM's last step has
# one pair (rank 1 runs padding only) and DPO's three: ZeRO-3 then still needs the same passes on every rank.
RUNS = {
    "sft-zero2": (sft_args, DEEPSPEED, 2, 2),
    "sft-zero3": (sft_args, DEEPSPEED, 3, 2),
    "rm-zero3": (rm_args, DEEPSPEED, 3, 0),
    "dpo-zero3-lora": (dpo_args, [*DEEPSPEED, "--lora_r", "4"], 3, 0),
    # bf16 autocast inside the engine's forward over its float32 weights (fp16 is refused: models/precision.py)
    "sft-zero3-bf16": (sft_args, [*DEEPSPEED, "--bf16"], 3, 0),
    # each decoder layer recomputed in the backward while ZeRO-3 gathers its weights again
    "sft-zero3-checkpointing": (sft_args, [*DEEPSPEED, "--gradient_checkpointing", "true"], 3, 0),
}


def uninterrupted(name: str, runs: dict) -> tuple[Path, str]:
    """The 2-process run's folder and the suffix of its uninterrupted model/ and metrics.jsonl (launch_runs.py
    keeps them apart as model-uninterrupted/ ... when it resumes the run afterwards)."""
    return runs[name]["two"], ("-uninterrupted" if RUNS[name][3] else "")


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> str:
    return save_suite_model(tmp_path_factory.mktemp("policy"))


@pytest.fixture(scope="module")
def runs(policy_dir, tmp_path_factory) -> dict:
    """Every RUNS entry in 1 process (here) and in 2 (one torchrun launch per ZeRO stage; resumed where RUNS says)."""
    root = tmp_path_factory.mktemp("deepspeed")
    cwd = root / "cwd"
    cwd.mkdir()
    out, jobs = {}, {2: [], 3: []}
    for name, (args, flags, stage, resume_at) in RUNS.items():
        one, two = root / name / "one", root / name / "two"
        out[name] = {"one": one, "two": two, "wall_one": train_here([*args(one, policy_dir), *flags])}
        jobs[stage].append({"args": [*args(two, policy_dir), *flags], "resume_at": resume_at})
    for stage, stage_jobs in jobs.items():
        (root / f"jobs-{stage}.json").write_text(json.dumps(stage_jobs))
        # ZeRO-3 partitions every weight (DeepSpeed keeps tensors under 1e5 elements whole by default: all of
        # this tiny model's, which would leave nothing partitioned to test)
        done = launch([str(HERE / "launch_runs.py"), str(root / f"jobs-{stage}.json")], cwd,
                      ACCELERATE_DEEPSPEED_ZERO_STAGE=str(stage), RLHFLAB_ZERO3_PERSISTENCE_THRESHOLD="0")
        assert done.returncode == 0, launch_failure(done)
    for name in RUNS:
        out[name].update(wall_two=json.loads((out[name]["two"] / "wall.json").read_text())["run"], cwd=cwd,
                         policy_dir=policy_dir)
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_zero_in_two_processes_trains_the_weights_and_metrics_of_one(runs, name):
    run = runs[name]
    two, suffix = uninterrupted(name, runs)
    difference = max_weight_difference(run["one"] / "model", two / f"model{suffix}")
    print(f"\n{name}: max |w_1 - w_2| = {difference:.2e}; wall {run['wall_one']:.1f} s (1 process), "
          f"{run['wall_two']:.1f} s (2 processes)")
    weights, metrics = TOLERANCE["bf16" if name.endswith("bf16") else "float32"]
    assert difference <= weights
    assert_same_metrics(metric_rows(run["one"] / "metrics.jsonl"), metric_rows(two / f"metrics{suffix}.jsonl"), metrics)
    summary = json.loads((run["two"] / "summary.json").read_text())
    assert summary["parallel"]["world_size"] == 2 and summary["parallel"]["strategy"] == "deepspeed"
    assert summary["precision"]["mixed_precision"] == ("bf16" if name.endswith("bf16") else "no")


@pytest.mark.parametrize("name", [name for name in RUNS if RUNS[name][3]])
def test_a_resume_from_the_engine_s_checkpoint_equals_the_uninterrupted_run(runs, name):
    two = runs[name]["two"]
    assert_same_weights_in(two / "model", two / "model-uninterrupted")
    assert metric_rows(two / "metrics.jsonl") == metric_rows(two / "metrics-uninterrupted.jsonl")
    assert [r["step"] for r in json.loads((two / "summary.json").read_text())["resumes"]] == [RUNS[name][3]]


def test_checkpoints_hold_every_rank_s_zero_slices_and_only_rank_0_writes(runs):
    assert list(runs["sft-zero2"]["cwd"].iterdir()) == []
    for name in RUNS:
        two = runs[name]["two"]
        assert sorted(p.name for p in two.parent.iterdir()) == ["one", "two"]
        last = complete_checkpoints(two / "checkpoints")[-1]
        files = json.loads((last / MARKER).read_text())["files"]
        slices = sorted(f for f in files if f.startswith("sharded/engine/") and "optim_states" in f)
        assert slices == [f"sharded/engine/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)], files
        assert json.loads((last / "sharded" / "zero.json").read_text()) == {"zero_stage": RUNS[name][2]}
        assert load_file(str(last / "model.safetensors")) == {}  # the weights are in the engine's files


@pytest.mark.parametrize("name", ["sft-zero3", "dpo-zero3-lora"])
def test_the_saved_model_loads_with_from_pretrained_and_holds_the_trained_weights(runs, name):
    """ZeRO-3's folder is gathered from every rank's partitions (LoRA: then merged); it loads as a plain model."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(runs[name]["two"] / "model").state_dict()
    one = load_file(str(runs[name]["one"] / "model" / "model.safetensors"))
    start = load_file(str(Path(runs[name]["policy_dir"]) / "model.safetensors")) if name != "sft-zero3" else None
    assert one.keys() <= loaded.keys()
    assert max((loaded[k] - one[k]).abs().max().item() for k in one) <= 1e-5
    if start is not None:  # it trained: not the model it started from
        print(f"\n{name}: moved {max((loaded[k] - start[k]).abs().max().item() for k in start):.1e} from the start")
        assert max((loaded[k] - start[k]).abs().max().item() for k in start) > 1e-6
