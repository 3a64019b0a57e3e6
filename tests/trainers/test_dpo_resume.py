"""SIGKILL a real `rlhflab dpo` process mid-run, resume it, and get the uninterrupted run bit for bit
(the reference log-probs are recomputed from the starting weights on resume; the data order is replayed)."""

import json

import pytest
from runcheck import SUITE, assert_same_weights, kill_after, metrics, start_cli
from tinyhf import save_suite_model

from rlhflab.checkpoint import MARKER, complete_checkpoints
from rlhflab.config import DPOConfig, parse_config
from rlhflab.trainers import dpo


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_suite_model(tmp_path_factory.mktemp("policy"))


def dpo_args(policy_dir, out, *extra):
    return ["dpo", "--model", policy_dir, "--output_dir", str(out), "--pairs_per_prompt", "2", "--batch_size", "4",
            "--num_epochs", "2", "--learning_rate", "1e-3", "--log_every", "1", "--save_every", "3",
            "--eval_every", "4", "--eval_prompts", "4", "--max_new_tokens", "6", "--gradient_accumulation_steps", "2",
            *SUITE, *extra]


def train(args):
    return dpo.train(parse_config(DPOConfig, args[1:], prog="rlhflab dpo"))


@pytest.mark.parametrize("extra", [(), ("--loss_type", "ipo", "--lora_r", "4")])
def test_sigkill_mid_run_then_resume_equals_the_uninterrupted_run(policy_dir, tmp_path, extra):
    reference = tmp_path / "reference"
    train(dpo_args(policy_dir, reference, *extra))
    out = tmp_path / "resumed"
    proc = start_cli(*dpo_args(policy_dir, out, *extra))
    code, err = kill_after(out / "checkpoints" / "step-6" / MARKER, proc)
    assert code == -9, err
    assert not (out / "summary.json").exists()  # it really died mid-run
    train([*dpo_args(policy_dir, out, *extra), "--resume", "latest"])
    assert metrics(out) == metrics(reference)
    assert (out / "samples.jsonl").read_text() == (reference / "samples.jsonl").read_text()
    assert_same_weights(reference, out)
    summary = json.loads((out / "summary.json").read_text())
    assert [r["step"] for r in summary["resumes"]] == [6] and summary["resumes"][0]["config_changes"] == {}
    expected = json.loads((reference / "summary.json").read_text())
    for key in ("steps", "pairs_seen", "validation_pass_rate", "validation_accuracy", "final"):
        if key == "final":
            expected[key].pop("elapsed_s"), summary[key].pop("elapsed_s")
        assert summary[key] == expected[key], key
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == ["step-21", "step-22"]
