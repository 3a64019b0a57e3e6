"""Two processes (torchrun, gloo on CPU) train what one process trains: SFT, reward model and DPO, DDP and FSDP2.

One torchrun launch runs all six 2-process trainings and a resume of each from a mid-run checkpoint
(launch_runs.py); the single-process runs happen here, in-process. Then, per stage and strategy: the same
weights (max abs difference <= 1e-5 in float32; the figure is printed), the same metrics.jsonl apart from
wall-clock fields (same rows and keys, numbers to float rounding), and a resume equal to the uninterrupted
run bit for bit. Three more launches through `-m rlhflab`: SIGKILL after a checkpoint + `--resume latest`,
a deliberate exception on rank 1 (RLHFLAB_FAIL_AT), and nothing written by rank 1 anywhere.
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from runcheck import WALL_CLOCK, launch_failure, wait_for
from safetensors.torch import load_file
from tinyhf import save_suite_model

from rlhflab.checkpoint import MARKER, complete_checkpoints
from rlhflab.cli import main
from rlhflab.config import STAGES, parse_config
from rlhflab.trainers import dpo, reward, sft

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available in this torch build")

HERE = Path(__file__).parent
SUITE = ["--num_train_prompts", "22", "--num_validation_prompts", "11", "--num_test_prompts", "11",
         "--progress", "false", "--threads", "1", "--seed", "3", "--log_every", "1", "--keep_last_n", "0"]
LAUNCH = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def sft_args(out, policy_dir=None):
    return ["sft", "--output_dir", str(out), "--hidden_size", "32", "--num_layers", "1", "--intermediate_size", "64",
            "--sft_examples", "48", "--batch_size", "8", "--gradient_accumulation_steps", "2", "--max_steps", "6",
            "--eval_every", "3", "--eval_prompts", "2", "--max_new_tokens", "4", "--save_every", "2", *SUITE]


def rm_args(out, policy_dir):  # 21 pairs in batches of 4: the last step has 1 pair, rank 1 only padding
    return ["rm", "--model", policy_dir, "--output_dir", str(out), "--pairs_per_prompt", "1", "--batch_size", "4",
            "--num_epochs", "1", "--save_every", "2", *SUITE, "--num_train_prompts", "21"]


def dpo_args(out, policy_dir):  # 21 pairs in steps of 6: the last one has 3 (2 on rank 0, 1 on rank 1)
    return ["dpo", "--model", policy_dir, "--output_dir", str(out), "--pairs_per_prompt", "1", "--batch_size", "6",
            "--max_pairs", "21", "--gradient_accumulation_steps", "2", "--learning_rate", "2e-4", "--warmup_steps",
            "0", "--eval_every", "2", "--eval_prompts", "2", "--max_new_tokens", "4", "--save_every", "2", *SUITE]


# name: (arguments, extra flags, checkpoint the resume starts from)
RUNS = {
    "sft-ddp": (sft_args, ["--parallel_strategy", "ddp"], 2),
    "sft-fsdp2": (sft_args, ["--parallel_strategy", "fsdp2"], 2),
    "rm-ddp": (rm_args, ["--parallel_strategy", "ddp"], 2),
    "rm-fsdp2": (rm_args, ["--parallel_strategy", "fsdp2"], 4),
    # the policy's answers sampled batch by batch, every other batch on each rank (trainers/reward.py
    # sample_policy_answers; 21 x 7 answers = 3 batches): the same answers, pairs and calibration rows as one process
    "rm-ddp-sampled": (rm_args, ["--parallel_strategy", "ddp", "--hard_negatives", "7", "--calibration_coef", "1"], 2),
    "dpo-ddp": (dpo_args, ["--parallel_strategy", "ddp"], 2),
    # DPO's hard negatives sampled as the reward model's are: the same pairs as one process
    "dpo-ddp-sampled": (dpo_args, ["--parallel_strategy", "ddp", "--hard_negatives", "7"], 2),
    "dpo-ddp-lora": (dpo_args, ["--parallel_strategy", "ddp", "--lora_r", "4"], 2),
    "dpo-fsdp2-lora": (dpo_args, ["--parallel_strategy", "fsdp2", "--lora_r", "4"], 2),
    # bf16 autocast inside the engines' forwards (models/precision.py), against a 1-process bf16 run
    "sft-ddp-bf16": (sft_args, ["--parallel_strategy", "ddp", "--bf16"], 2),
    "sft-fsdp2-bf16": (sft_args, ["--parallel_strategy", "fsdp2", "--bf16"], 2),
}
# bf16 rounds each rank's activations, whose matmuls see other batch shapes than one process's: measured max weight
# difference after 6 steps 1.0e-4 (DDP) / 1.3e-4 (FSDP2), grad_norm 1.4e-4 relative; float32 stays under 1e-5
TOLERANCE = {"float32": (1e-5, 1e-4), "bf16": (1e-3, 1e-3)}  # (max weight difference, metrics' relative tolerance)
TRAINERS = {"sft": sft.train, "rm": reward.train, "dpo": dpo.train}
# 2-process runs (same launch, no resume) of a RUNS entry plus flags that must not change what it trains: compared
# with that entry's single-process run, made without them
TWO_WITH_FLAGS = {
    # gradient checkpointing (models/checkpointing.py): the lean forward under DDP, HF's layers under FSDP2, LoRA
    "sft-ddp-checkpointing": ("sft-ddp", ["--gradient_checkpointing", "true"]),
    "sft-fsdp2-checkpointing": ("sft-fsdp2", ["--gradient_checkpointing", "true"]),
    "dpo-ddp-lora-checkpointing": ("dpo-ddp-lora", ["--gradient_checkpointing", "true"]),
}


def train_here(args: list[str]) -> float:
    """`rlhflab <args>` in this process (no report); its wall seconds."""
    started = time.time()
    TRAINERS[args[0]](parse_config(STAGES[args[0]], args[1:], prog="rlhflab"))
    return time.time() - started


def launch(args: list[str], cwd: Path, timeout: float = 600, **env) -> subprocess.CompletedProcess:
    done = subprocess.run([*LAUNCH, *args], cwd=cwd, env={**ENV, **env}, capture_output=True, text=True,
                          timeout=timeout)
    return done


def metric_rows(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK} for r in rows]


def max_weight_difference(a: Path, b: Path) -> float:
    left, right = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert left.keys() == right.keys()
    return max((left[k].float() - right[k].float()).abs().max().item() for k in left)


def assert_same_metrics(one: list[dict], two: list[dict], rel_tol: float = 1e-4) -> None:
    """The same rows and keys; numbers equal up to the float rounding of sums taken in another order.

    Except DPO's share of pairs with chosen reward > rejected while the policy is still the reference (step
    1): every implicit reward there is rounding noise (|margin| ~1e-6), so which pairs "win" is noise too."""
    assert [r["step"] for r in one] == [r["step"] for r in two]
    for a, b in zip(one, two):
        assert a.keys() == b.keys(), (a["step"], a.keys() ^ b.keys())
        for key in a:
            if key.endswith("rewards/accuracies") and abs(a[key.replace("accuracies", "margins")]) < 1e-5:
                continue
            same = a[key] == b[key] or (isinstance(a[key], float) and math.isclose(a[key], b[key], rel_tol=rel_tol,
                                                                                   abs_tol=1e-5))
            assert same, f"step {a['step']} {key}: {a[key]} (1 process) vs {b[key]} (2 processes)"


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> str:
    return save_suite_model(tmp_path_factory.mktemp("policy"))


@pytest.fixture(scope="module")
def runs(policy_dir, tmp_path_factory) -> dict:
    """Every RUNS entry in 1 process (here) and in 2 (one torchrun launch, then resumed there from a checkpoint)."""
    root = tmp_path_factory.mktemp("parallel")
    cwd = root / "cwd"  # the launch's working directory: a rank writing where it should not shows up here
    cwd.mkdir()
    out, jobs = {}, []
    for name, (args, flags, resume_at) in RUNS.items():
        one, two = root / name / "one", root / name / "two"
        out[name] = {"one": one, "two": two, "wall_one": train_here([*args(one, policy_dir), *flags])}
        jobs.append({"args": [*args(two, policy_dir), *flags], "resume_at": resume_at})
    for name, (like, extra) in TWO_WITH_FLAGS.items():
        args, flags, _ = RUNS[like]
        out[name] = {"one": out[like]["one"], "two": root / name / "two"}
        jobs.append({"args": [*args(out[name]["two"], policy_dir), *flags, *extra]})
    (root / "jobs.json").write_text(json.dumps(jobs))
    done = launch([str(HERE / "launch_runs.py"), str(root / "jobs.json")], cwd)
    assert done.returncode == 0, launch_failure(done)
    for name in RUNS:
        walls = json.loads((out[name]["two"] / "wall.json").read_text())
        out[name].update(wall_two=walls["run"], cwd=cwd)
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_two_processes_train_the_weights_and_metrics_of_one(runs, name):
    run = runs[name]
    difference = max_weight_difference(run["one"] / "model", run["two"] / "model-uninterrupted")
    print(f"\n{name}: max |w_1 - w_2| = {difference:.2e}; wall {run['wall_one']:.1f} s (1 process), "
          f"{run['wall_two']:.1f} s (2 processes)")
    weights, metrics = TOLERANCE["bf16" if name.endswith("bf16") else "float32"]
    assert difference <= weights
    assert_same_metrics(metric_rows(run["one"] / "metrics.jsonl"), metric_rows(run["two"] / "metrics-uninterrupted.jsonl"),
                        metrics)
    summary = json.loads((run["two"] / "summary.json").read_text())
    assert summary["parallel"]["world_size"] == 2 and summary["parallel"]["strategy"] == name.split("-")[1]


@pytest.mark.parametrize("name", list(RUNS))
def test_a_resume_at_two_processes_equals_the_uninterrupted_run(runs, name):
    two = runs[name]["two"]
    assert_same_weights_in(two / "model", two / "model-uninterrupted")
    assert metric_rows(two / "metrics.jsonl") == metric_rows(two / "metrics-uninterrupted.jsonl")
    assert [r["step"] for r in json.loads((two / "summary.json").read_text())["resumes"]] == [RUNS[name][2]]


@pytest.mark.parametrize("name", list(TWO_WITH_FLAGS))
def test_two_processes_with_the_flags_train_the_weights_and_metrics_of_one_without(runs, name):
    run = runs[name]
    difference = max_weight_difference(run["one"] / "model", run["two"] / "model")
    print(f"\n{name}: max |w_1 - w_2| = {difference:.2e}")
    assert difference <= 1e-5
    assert_same_metrics(metric_rows(run["one"] / "metrics.jsonl"), metric_rows(run["two"] / "metrics.jsonl"))


def assert_same_weights_in(a: Path, b: Path) -> None:
    left, right = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert left.keys() == right.keys() and all(left[k].equal(right[k]) for k in left)


def test_only_rank_0_writes_and_fsdp2_checkpoints_hold_every_rank_s_shards(runs):
    assert list(runs["sft-ddp"]["cwd"].iterdir()) == []  # no default runs/ folder from a rank that missed the path
    for name in RUNS:
        two = runs[name]["two"]
        assert sorted(p.name for p in two.parent.iterdir()) == ["one", "two"]
        last = complete_checkpoints(two / "checkpoints")[-1]
        marker = json.loads((last / MARKER).read_text())
        shards = sorted(f for f in marker["files"] if f.startswith("sharded/"))
        if "fsdp2" in name:  # DCP: one file per rank and its metadata, covered by the marker
            assert shards == ["sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp"]
            assert load_file(str(last / "model.safetensors")) == {}
        else:
            assert shards == [] and load_file(str(last / "model.safetensors"))


def test_a_sharded_checkpoint_is_refused_at_another_world_size_and_a_ddp_one_continues(runs, policy_dir, tmp_path,
                                                                                           capsys):
    two = runs["sft-fsdp2"]["two"]
    before = (two / "metrics.jsonl").read_bytes()
    args = [*sft_args(two), "--parallel_strategy", "fsdp2", "--resume", str(two / "checkpoints" / "step-2")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "written by 2 process(es) with parallel_strategy fsdp2; this run has 1" in err
    assert "torchrun --nproc_per_node 2" in err
    assert (two / "metrics.jsonl").read_bytes() == before  # refused before touching anything
    # a DDP checkpoint holds the whole model: one process continues it, to the 2-process weights up to rounding
    copy = tmp_path / "rm-ddp"
    shutil.copytree(runs["rm-ddp"]["two"], copy)
    train_here([*rm_args(copy, policy_dir), "--parallel_strategy", "ddp", "--resume", str(copy / "checkpoints" / "step-2")])
    assert max_weight_difference(copy / "model", runs["rm-ddp"]["two"] / "model-uninterrupted") <= 1e-5


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (torchrun starts each rank in a session of its own, so a process
    group signal would miss them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(children.get(tree[-1], []))
    return tree


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the ranks through /proc (Linux)")
def test_sigkill_after_a_checkpoint_then_resume_latest_equals_the_uninterrupted_run(runs, policy_dir, tmp_path):
    out, cwd = tmp_path / "killed", tmp_path / "cwd"
    cwd.mkdir()
    args = ["-m", "rlhflab", *sft_args(out), "--parallel_strategy", "fsdp2"]
    job = subprocess.Popen([*LAUNCH, *args], cwd=cwd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True)
    wait_for(out / "checkpoints" / "step-2" / MARKER, job)
    for pid in process_tree(job.pid):  # the whole job at once: torchrun and both ranks
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    job.communicate(timeout=60)
    assert not (out / "summary.json").exists()  # it died mid-run
    done = launch([*args, "--resume", "latest"], cwd)
    assert done.returncode == 0, launch_failure(done)
    uninterrupted = runs["sft-fsdp2"]["two"]
    assert_same_weights_in(out / "model", uninterrupted / "model-uninterrupted")
    assert metric_rows(out / "metrics.jsonl") == metric_rows(uninterrupted / "metrics-uninterrupted.jsonl")
    assert list(cwd.iterdir()) == []


def test_an_exception_on_rank_1_ends_rank_0_within_seconds_with_its_message(policy_dir, tmp_path):
    out, cwd = tmp_path / "failed", tmp_path / "cwd"
    cwd.mkdir()
    job = subprocess.Popen([*LAUNCH, "-m", "rlhflab", *rm_args(out, policy_dir), "--parallel_strategy", "ddp"],
                           cwd=cwd, env={**ENV, "RLHFLAB_FAIL_AT": "1:3"}, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    err, failed_at = [], None
    for line in job.stderr:  # torchrun passes every rank's stderr through
        err.append(line)
        if failed_at is None and "deliberate failure on rank 1 after step 3" in line:
            failed_at = time.time()
    job.wait(timeout=120)
    assert failed_at is not None, "".join(err[-60:])
    ended_in = time.time() - failed_at
    assert job.returncode != 0
    assert ended_in < 20, f"the launch ended {ended_in:.1f} s after rank 1 failed"
    assert any("rank      : 1" in line for line in err)  # torchrun names rank 1 as the first failure
    # one run folder; rank 0 wrote no checkpoint past the failure (the step-2 one is complete)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd", "failed"] and list(cwd.iterdir()) == []
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == ["step-2"]
    assert not (out / "summary.json").exists()


def stop_lines(err: str, what: str) -> dict[int, str]:
    """rank -> the line in which that rank's CLI says `what` ('interrupted', 'stopped')."""
    found = {}
    for line in err.splitlines():
        for rank in (0, 1):
            if line.startswith(f"rlhflab[rank {rank}]: {what}: "):
                found[rank] = line
    return found


@pytest.fixture(scope="module")
def preempted(runs, policy_dir, tmp_path_factory):
    """Two launches stopped mid-run, then one launch resuming both (`--resume latest`):
    DPO (DDP) given SIGTERM through torchrun after its first step (torchrun forwards it to both ranks), and SFT
    (FSDP2) whose rank 1 is SIGKILLed while it writes its shards of checkpoint step-4 (kill_in_save_driver.py)."""
    root = tmp_path_factory.mktemp("preempted")
    cwd = root / "cwd"
    cwd.mkdir()
    dpo_run, sft_run = root / "dpo", root / "sft"
    dpo_job = [*dpo_args(dpo_run, policy_dir), "--parallel_strategy", "ddp"]
    sft_job = [*sft_args(sft_run), "--parallel_strategy", "fsdp2"]
    out = {"dpo": dpo_run, "sft": sft_run, "cwd": cwd}

    job = subprocess.Popen([*LAUNCH, "-m", "rlhflab", *dpo_job], cwd=cwd, env=ENV, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    rows = dpo_run / "metrics.jsonl"
    while not (rows.exists() and '"step": 1' in rows.read_text()):
        assert job.poll() is None, job.communicate()[1][-3000:]
        time.sleep(0.01)
    job.send_signal(signal.SIGTERM)  # `kill -TERM <torchrun>`: torchrun forwards it to every worker
    out["dpo_err"] = job.communicate(timeout=120)[1]

    job = subprocess.Popen([*LAUNCH, str(HERE / "kill_in_save_driver.py"), "4", *sft_job], cwd=cwd, env=ENV,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    shard = sft_run / "checkpoints" / ".tmp-step-4" / "sharded" / "__1_0.distcp"
    while not shard.exists():  # rank 1 dies as soon as its shard is written
        assert job.poll() is None, job.communicate()[1][-3000:]
        time.sleep(0.005)
    killed_at = time.time()
    out["sft_err"] = job.communicate(timeout=120)[1]
    out["sft_code"], out["sft_ended_in"] = job.returncode, time.time() - killed_at
    out["complete_before_resume"] = {name: [p.name for p in complete_checkpoints(run / "checkpoints")]
                                     for name, run in (("dpo", dpo_run), ("sft", sft_run))}
    out["leftovers"] = sorted(p.name for p in (sft_run / "checkpoints").iterdir())

    jobs = [{"args": [*dpo_job, "--resume", "latest"]}, {"args": [*sft_job, "--resume", "latest"]}]
    (root / "jobs.json").write_text(json.dumps(jobs))
    done = launch([str(HERE / "launch_runs.py"), str(root / "jobs.json")], cwd)
    assert done.returncode == 0, launch_failure(done)
    return out


def test_sigterm_to_torchrun_stops_both_dpo_ranks_at_one_step_and_resume_latest_equals_the_uninterrupted_run(
        runs, preempted):
    err = preempted["dpo_err"]
    lines = stop_lines(err, "interrupted")
    assert sorted(lines) == [0, 1], err[-3000:]  # both ranks finished the step and said so (exit code 143 each)
    steps = {int(line.split("SIGTERM after step ")[1].split(":")[0]) for line in lines.values()}
    assert len(steps) == 1, lines  # the same step on both ranks (Checkpointer.step_done: the max of their signals)
    stopped_at = steps.pop()
    print(f"\nDPO, 2 processes: SIGTERM to torchrun after step 1; both ranks stopped after step {stopped_at}")
    assert 1 <= stopped_at < 4 and preempted["complete_before_resume"]["dpo"][-1] == f"step-{stopped_at}"
    assert "second SIGTERM" not in err and not any(row.startswith(("[rank0]:", "[rank1]:")) for row in err.splitlines())
    run, uninterrupted = preempted["dpo"], runs["dpo-ddp"]["two"]
    assert_same_weights_in(run / "model", uninterrupted / "model-uninterrupted")
    assert metric_rows(run / "metrics.jsonl") == metric_rows(uninterrupted / "metrics-uninterrupted.jsonl")
    assert [r["step"] for r in json.loads((run / "summary.json").read_text())["resumes"]] == [stopped_at]


def test_a_rank_killed_in_a_sharded_save_ends_the_job_with_one_line_and_resume_takes_the_checkpoint_before(
        runs, preempted):
    err, run = preempted["sft_err"], preempted["sft"]
    print(f"\nSFT FSDP2, rank 1 SIGKILLed while writing its shards of step-4: the job ended "
          f"{preempted['sft_ended_in']:.1f} s later")
    assert preempted["sft_code"] != 0 and preempted["sft_ended_in"] < 15
    lines = stop_lines(err, "stopped")
    assert 0 in lines, err[-4000:]
    line = lines[0]  # rank 0's one line: who died, how, where it waited, how to resume
    assert f"rank 1 of 2 (pid " in line and "SIGKILL" in line and "write_shards" in line, line
    assert f"last complete checkpoint {run / 'checkpoints' / 'step-2'}" in line and "--resume latest" in line
    assert not any(row.startswith("[rank0]:") for row in err.splitlines())  # no transport traceback on rank 0
    assert "exitcode  : 6" in err and "Signal 9 (SIGKILL)" in err  # torchrun's summary: rank 0's code, rank 1's signal
    # no step-4 marked complete, and the partial folder removed by rank 0 on its way out
    assert preempted["complete_before_resume"]["sft"] == ["step-2"] and preempted["leftovers"] == ["step-2"]
    uninterrupted = runs["sft-fsdp2"]["two"]
    assert_same_weights_in(run / "model", uninterrupted / "model-uninterrupted")
    assert metric_rows(run / "metrics.jsonl") == metric_rows(uninterrupted / "metrics-uninterrupted.jsonl")
    assert [r["step"] for r in json.loads((run / "summary.json").read_text())["resumes"]] == [2]
    assert list(preempted["cwd"].iterdir()) == []
