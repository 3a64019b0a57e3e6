"""Exact resume of the critic-free methods: GRPO killed with SIGKILL mid-run through the CLI and resumed with
`--resume latest` equals the uninterrupted run bit for bit (as tests/checkpoint/test_resume.py does for PPO);
REINFORCE's moving baseline is in its checkpoint and a resume carries it on."""

import json
import shutil

import pytest
from runcheck import SUITE, assert_same_weights, kill_after, metrics, start_cli
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
