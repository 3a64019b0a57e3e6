"""Whole `rlhflab dpo` runs on tiny models: it learns the suite's preference, a user's conversational
implicit-prompt file trains (pass rate only with --verifier), the pair / time budgets, LoRA, SimPO, the CLI."""

import json
import textwrap

import pytest
import torch
from safetensors.torch import load_file
from tinyhf import save_suite_model

from rlhflab import models
from rlhflab.cli import main
from rlhflab.config import DPOConfig
from rlhflab.errors import UserInputError
from rlhflab.trainers import dpo


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_suite_model(tmp_path_factory.mktemp("policy"))


def tiny_cfg(policy_dir, out, **overrides) -> DPOConfig:
    base = dict(model=policy_dir, output_dir=str(out), num_train_prompts=22, num_validation_prompts=11,
                num_test_prompts=11, pairs_per_prompt=2, batch_size=8, eval_prompts=4, max_new_tokens=6,
                progress=False, threads=1, learning_rate=1e-3, warmup_steps=0, log_every=1, eval_every=0)
    return DPOConfig(**{**base, **overrides})


def metric_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_short_run_learns_the_suites_preference_and_moves_every_parameter(policy_dir, tmp_path):
    result = dpo.train(tiny_cfg(policy_dir, tmp_path / "run", num_epochs=2, beta=0.5))
    summary = result.summary
    assert summary["stage"] == "dpo" and summary["steps"] == 11 and summary["pairs_seen"] == 88 == summary["episodes"]
    accuracy, margin = summary["validation_accuracy"], summary["validation_margin"]
    assert accuracy["start"] == 0.0 and accuracy["end"] > 0.75, accuracy  # held-out pairs (ties at the start)
    assert margin["start"] == pytest.approx(0.0, abs=1e-6) and margin["end"] > 0.2, margin
    val_loss = [r["val/loss"] for r in metric_rows(result.run_dir) if "val/loss" in r]
    assert val_loss[0] == pytest.approx(0.6931, abs=1e-4) and val_loss[-1] < 0.62, val_loss
    rows = [r for r in metric_rows(result.run_dir) if "loss" in r]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.1 and rows[-1]["rewards/margins"] > rows[0]["rewards/margins"]
    assert {"rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "grad_norm", "lr"} <= set(rows[0])
    start, end = load_file(f"{policy_dir}/model.safetensors"), load_file(str(result.model_dir / "model.safetensors"))
    assert start.keys() == end.keys()
    assert [k for k in start if torch.equal(start[k], end[k])] == []  # every trainable tensor moved
    rate = summary["validation_pass_rate"]
    assert 0.0 <= rate["start"] <= 1.0 and 0.0 <= rate["end"] <= 1.0  # the suite's checker on 4 prompts
    assert set(summary["wall_time_s"]) == {"setup", "loop", "evaluation", "save", "total"}
    assert summary["pairs_per_s"] > 0 and summary["final"]["pairs_seen"] == 88


VERIFIER = '''
def says_yes(prompts, completions, **columns):
    return ["yes" in c for c in completions]
'''


def conversational_rows(numbers):
    """Implicit prompt (chosen and rejected share the user turn), conversational: TRL's format."""
    def turn(answer, n):
        return [{"role": "user", "content": f"Agree with {n}."}, {"role": "assistant", "content": answer}]
    return [{"chosen": turn(f"yes {n}", n), "rejected": turn("no", n)} for n in numbers]


@pytest.fixture()
def user_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in conversational_rows(range(100))))
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in conversational_rows(range(200, 208))))
    (tmp_path / "my_verifier.py").write_text(textwrap.dedent(VERIFIER))
    return tmp_path


def test_a_users_implicit_prompt_conversational_file_trains_with_its_verifier(policy_dir, user_files):
    cfg = tiny_cfg(policy_dir, "run", train_file="prefs.jsonl", validation_file="val.jsonl",
                   verifier="my_verifier.py:says_yes", num_epochs=1, eval_every=5)
    summary = dpo.train(cfg).summary
    assert summary["prompts"] == "prefs.jsonl" and summary["train_pairs"] == 100 and summary["validation_pairs"] == 8
    assert summary["verifier"] == "says_yes"
    assert summary["validation_accuracy"]["end"] == 1.0 and summary["validation_margin"]["end"] > 0.3
    evaluations = [r for r in metric_rows(user_files / "run") if "val/pass_rate" in r]
    assert [r["step"] for r in evaluations] == [0, 5, 10, 13]
    samples = [json.loads(line) for line in (user_files / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 * 4  # 4 evaluations x eval_prompts 4 (one answer per distinct validation prompt)
    assert {s["prompt"] for s in samples} == {f"user: Agree with {n}.\nassistant: " for n in range(200, 204)}
    assert all(s["passed"] == ("yes" in s["answer"]) for s in samples)  # the user's verifier judged them


def test_without_a_verifier_a_users_file_has_no_pass_rate_and_holds_out_prompts(policy_dir, user_files):
    summary = dpo.train(tiny_cfg(policy_dir, "run", train_file="prefs.jsonl", max_steps=2)).summary
    assert summary["verifier"] is None and summary["validation_pass_rate"] == {"start": None, "end": None}
    assert summary["train_pairs"] == 90 and summary["validation_pairs"] == 10  # 10 % of the prompts held out
    assert not (user_files / "run" / "samples.jsonl").exists() or not (user_files / "run" / "samples.jsonl").read_text()


def test_the_pair_budget_ends_inside_a_step_and_the_time_budget_stops_the_run(policy_dir, tmp_path):
    summary = dpo.train(tiny_cfg(policy_dir, tmp_path / "pairs", max_pairs=20, max_steps=10)).summary
    assert summary["steps"] == 3 and summary["pairs_seen"] == 20  # 8 + 8 + 4
    summary = dpo.train(tiny_cfg(policy_dir, tmp_path / "time", max_seconds=1e-6, max_steps=50)).summary
    assert summary["steps"] == 1 and summary["budget_stop"]["step"] == 1 and summary["budget_stop"]["episode"] == 8
    assert (tmp_path / "time" / "model" / "model.safetensors").exists()


def test_lora_saves_the_adapter_and_a_merged_model_plain_transformers_loads(policy_dir, tmp_path):
    result = dpo.train(tiny_cfg(policy_dir, tmp_path / "run", lora_r=4, max_steps=3, learning_rate=1e-2))
    assert (result.run_dir / "adapter" / "adapter_config.json").exists()
    merged = models.load_causal_lm(str(result.model_dir))
    start = models.load_causal_lm(policy_dir)
    assert not torch.equal(merged.model.layers[0].self_attn.q_proj.weight, start.model.layers[0].self_attn.q_proj.weight)
    assert torch.equal(merged.model.embed_tokens.weight, start.model.embed_tokens.weight)  # LoRA left it alone


def test_simpo_needs_no_reference_and_learns(policy_dir, tmp_path):
    result = dpo.train(tiny_cfg(policy_dir, tmp_path / "run", loss_type="simpo", beta=2.0, num_epochs=3,
                                learning_rate=3e-3))
    accuracy, margin = result.summary["validation_accuracy"], result.summary["validation_margin"]
    assert accuracy["end"] > accuracy["start"] + 0.2, accuracy  # per-token means of a random model: ~0.55 at start
    assert margin["end"] > 2 * margin["start"] > 0, margin


def test_hard_negatives_and_near_misses_join_the_training_pairs_only(policy_dir, tmp_path):
    plain = dpo.train(tiny_cfg(policy_dir, tmp_path / "plain", max_steps=1)).summary
    more = dpo.train(tiny_cfg(policy_dir, tmp_path / "more", max_steps=1, hard_negatives=2, near_misses=1)).summary
    assert plain["train_pairs"] == 44 and plain["validation_pairs"] == 22
    assert more["train_pairs"] > 44 + 22 and more["validation_pairs"] == 22  # 22 near misses + failing samples
    with pytest.raises(UserInputError, match="built from the built-in suite's items"):
        dpo.train(tiny_cfg(policy_dir, tmp_path / "file", train_file="prefs.jsonl", hard_negatives=1))


def test_bad_settings_are_refused_before_any_work(policy_dir, tmp_path):
    with pytest.raises(UserInputError, match="label_smoothing is conservative DPO's"):
        dpo.train(tiny_cfg(policy_dir, tmp_path / "run", loss_type="ipo", label_smoothing=0.1))
    with pytest.raises(UserInputError, match="no policy given"):
        dpo.train(tiny_cfg("", tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_the_cli_runs_dpo_end_to_end(policy_dir, tmp_path, capsys):
    code = main(["dpo", "--model", policy_dir, "--output_dir", str(tmp_path / "run"), "--num_train_prompts", "22",
                 "--num_validation_prompts", "11", "--num_test_prompts", "11", "--pairs_per_prompt", "1",
                 "--batch_size", "8", "--max_steps", "2", "--eval_prompts", "4", "--max_new_tokens", "6",
                 "--progress", "false", "--threads", "1", "--loss_type", "ipo"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "validation pass rate" in out and "pairs/s" in out and "report:" in out
    assert (tmp_path / "run" / "report.html").stat().st_size > 1000
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["loss_type"] == "ipo"
