"""Exact resume of the critic-free methods: GRPO killed with SIGKILL mid-run through the CLI and resumed with
`--resume latest` equals the uninterrupted run bit for bit (as tests/checkpoint/test_resume.py does for PPO);
every online method (PPO, GRPO, RLOO, REINFORCE, online DPO) killed twice (during a rollout just after a
checkpoint, and an update past it) ends with the uninterrupted run's weights, optimiser, schedule, algorithm state, RNGs and metrics;
REINFORCE's moving baseline is in its checkpoint and a resume carries it on."""

import json
import shutil

import pytest
from runcheck import SUITE, WALL_CLOCK, assert_same_weights, kill_after, metrics, start_cli
from tinyhf import save_suite_model

from rlhflab.checkpoint import MARKER, complete_checkpoints
from rlhflab.checkpoint.folder import load_checkpoint
from rlhflab.config import STAGES, parse_config
from rlhflab.eval import RunMonitor
from rlhflab.trainers import grpo, reinforce

REWARD = """def digits(prompts, completions, **columns):
    return [sum(c.isdigit() for c in t) / max(len(t), 1) for t in completions]
"""


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_suite_model(tmp_path_factory.mktemp("policy"))


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "digits.py"
    path.write_text(REWARD)
    return f"{path}:digits"  # a reward that moves the tiny policy (the suite's checker scores it 0 throughout)


def online_args(stage, policy_dir, reward_file, out, *extra):
    return [stage, "--model", policy_dir, "--output_dir", str(out), "--reward_fn", reward_file, "--batch_size", "8",
            "--response_length", "6", "--max_new_tokens", "6", "--total_episodes", "48", "--eval_every", "3",
            "--eval_prompts", "4", "--sample_prompts", "2", "--learning_rate", "1e-2", "--missing_eos_penalty", "0",
            "--stop_on_alarms", "", *extra, *SUITE]


def grpo_args(policy_dir, reward_file, out):
    return online_args("grpo", policy_dir, reward_file, out, "--num_generations", "4", "--num_mini_batches", "2",
                       "--num_iterations", "2", "--beta", "0.04", "--epsilon_high", "0.28", "--save_every", "2")


def train(args: list[str]):
    """What `rlhflab <stage> ARGS` does, in-process and without the HTML report."""
    cfg = parse_config(STAGES[args[0]], args[1:], prog=f"rlhflab {args[0]}")
    return {"grpo": grpo, "reinforce": reinforce}[args[0]].train(cfg, monitor=RunMonitor.from_config(cfg))


def test_grpo_sigkill_mid_run_then_resume_latest_equals_the_uninterrupted_run(policy_dir, reward_file, tmp_path):
    reference, out = tmp_path / "reference", tmp_path / "resumed"
    train(grpo_args(policy_dir, reward_file, reference))
    proc = start_cli(*grpo_args(policy_dir, reward_file, out))
    code, err = kill_after(out / "checkpoints" / "step-4" / MARKER, proc)
    assert code == -9, err
    assert not (out / "summary.json").exists()  # it really died mid-run
    train([*grpo_args(policy_dir, reward_file, out), "--resume", "latest"])
    assert metrics(out) == metrics(reference)
    assert_same_weights(reference, out)
    summary = json.loads((out / "summary.json").read_text())
    assert [r["step"] for r in summary["resumes"]] == [4] and summary["resumes"][0]["config_changes"] == {}
    rows = [r for r in metrics(reference) if "objective/scores" in r]
    assert len(rows) == 6 and rows[-1]["kl"] > 0  # it trained: the policy left its reference


def test_reinforce_moving_baseline_is_checkpointed_and_carried_on_by_a_resume(policy_dir, reward_file, tmp_path):
    def args(out):
        return online_args("reinforce", policy_dir, reward_file, out, "--baseline", "moving_average",
                           "--baseline_decay", "0.5", "--save_every", "1", "--keep_last_n", "0")

    reference = tmp_path / "reference"
    train(args(reference))
    baselines = [r["baseline"] for r in metrics(reference) if "baseline" in r]
    assert len(baselines) == 6 and baselines[0] == 0.0 and len(set(baselines)) == 6
    step3 = complete_checkpoints(reference / "checkpoints")[2]
    _, _, state = load_checkpoint(step3)
    saved = state["algorithm"]["moving_baseline"]
    # it is update 4's baseline (logged as a float32)
    assert saved["initialised"] and saved["value"] == pytest.approx(baselines[3], rel=1e-6)
    resumed = tmp_path / "resumed"
    shutil.copytree(reference, resumed)
    train([*args(resumed), "--resume", str(resumed / "checkpoints" / step3.name)])
    assert metrics(resumed) == metrics(reference)  # update 4 onwards read the restored baseline, not 0
    assert_same_weights(reference, resumed)


# --- SIGKILL at two points of an update, for every online method ----------------------------------------

KILLING_REWARD = """import os
import signal

UPDATES_SEEN = set()


def digits(prompts, completions, trainer_state, **columns):
    if len(completions) >= 8:  # a training batch (the headroom probe is off, evaluations read the checker)
        UPDATES_SEEN.add(trainer_state.global_step)  # one per update, whatever its refill rounds
        if str(len(UPDATES_SEEN)) == os.environ.get("KILL_AT_CALL"):
            os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or a lost node would: no clean-up at all
    return [sum(c.isdigit() for c in t) / max(len(t), 1) for t in completions]
"""
KILLED = {"rloo": ["--num_generations", "4"], "reinforce": ["--baseline", "moving_average"],
          "online-dpo": ["--num_generations", "4"], "grpo": ["--num_generations", "4", "--num_iterations", "2"],
          "ppo": ["--num_mini_batches", "2", "--adaptive_kl", "true"],
          # refill rounds draw from the prompt order and sample with (seed, update, round)
          "grpo+dynamic": ["--num_generations", "4", "--dynamic_sampling", "true", "--max_refill_rounds", "2"]}


def killed_args(name, policy_dir, reward, out):
    stage = name.partition("+")[0]
    return online_args(stage, policy_dir, reward, out, *KILLED[name], "--save_every", "2", "--headroom_samples", "0")


def killed_at(call: int, args: list[str]) -> None:
    """Run `rlhflab ARGS` in a process that SIGKILLs itself at its `call`-th training reward call."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "rlhflab", *args],
                          env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "KILL_AT_CALL": str(call)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == -9, done.stderr[-3000:]


def final_state(run) -> dict:
    """The end-of-run checkpoint's state, less what differs between any two runs (clocks, the resumes' record)."""
    _, weights, state = load_checkpoint(complete_checkpoints(run / "checkpoints")[-1])
    progress = state["progress"]
    progress.pop("walls")
    for row in ("first", "last_eval", "last"):  # the logged rows, as `metrics` compares them
        progress[row] = {k: v for k, v in progress[row].items() if k not in WALL_CLOCK and not k.startswith("time/")}
    return {"weights": weights, **{k: v for k, v in state.items() if k not in ("histories", "watch")}}


def assert_same_state(a: dict, b: dict, where: str = "") -> None:
    """Equal nested dicts / lists of tensors and plain values, tensors bit for bit."""
    import numpy
    import torch

    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_same_state(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, numpy.ndarray):  # numpy's RNG state
        assert isinstance(b, numpy.ndarray) and numpy.array_equal(a, b), where
    else:
        assert a == b or (a != a and b != b), where  # NaN == NaN here


@pytest.mark.parametrize("name", sorted(KILLED))
def test_sigkill_during_a_rollout_and_after_an_update_then_resume_ends_where_the_uninterrupted_run_ends(
        name, policy_dir, tmp_path):
    """Killed twice: in update 3's scoring (nothing past checkpoint step-2 written), then, resumed, in update 4's
    (update 3 logged past the checkpoint: trimmed again). The second resume ends with the uninterrupted run's
    weights, AdamW moments, LR schedule, algorithm state, RNGs and metrics, bit for bit."""
    (tmp_path / "digits.py").write_text(KILLING_REWARD)
    reward = f"{tmp_path / 'digits.py'}:digits"
    reference, out = tmp_path / "reference", tmp_path / "killed"
    stage = name.partition("+")[0]
    module = stage.replace("-", "_")
    cfg = parse_config(STAGES[stage], killed_args(name, policy_dir, reward, reference)[1:], prog=stage)
    import importlib

    trainer = importlib.import_module(f"rlhflab.trainers.{module}")
    trainer.train(cfg, monitor=RunMonitor.from_config(cfg))
    killed_at(3, killed_args(name, policy_dir, reward, out))
    assert [r["step"] for r in metrics(out) if "objective/scores" in r] == [1, 2]
    killed_at(2, [*killed_args(name, policy_dir, reward, out), "--resume", "latest"])
    assert [r["step"] for r in metrics(out) if "objective/scores" in r] == [1, 2, 3]  # past the checkpoint
    cfg = parse_config(STAGES[stage], [*killed_args(name, policy_dir, reward, out)[1:], "--resume", "latest"],
                       prog=stage)
    trainer.train(cfg, monitor=RunMonitor.from_config(cfg))
    assert metrics(out) == metrics(reference)
    assert_same_weights(reference, out)
    assert_same_state(final_state(reference), final_state(out))
    summary = json.loads((out / "summary.json").read_text())
    assert [r["step"] for r in summary["resumes"]] == [2, 2]
    if name.endswith("+dynamic"):  # the resumed updates refilled too (from the restored prompt order)
        assert any(r.get("dynamic/refill_rounds", 0) > 0 for r in metrics(reference) if r["step"] > 2)


def test_the_console_samples_table_leaves_pythons_global_rng_where_it_was():
    """rich's first import draws from Python's global RNG; in a resumed run that first import comes after the
    RNGs were restored, so a reward function reading `random` would see another stream (found by the test above:
    the checkpoints' Python RNG states differed when rich had been imported before the uninterrupted run)."""
    import subprocess
    import sys

    code = ("import random; random.seed(1); before = random.getstate(); "
            "from rlhflab.trainers.online.evaluate import samples_table; "
            "samples_table([{'prompt': 'p', 'answer': 'a', 'passed': True}], 'title'); "
            "assert random.getstate() == before, 'moved'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
