"""Injected faults: NaN in a reward or a loss stops the run with no checkpoint after it; a damaged checkpoint
is a clear error on resume, never a silent fresh start."""

import math
import os

import pytest
import torch
from runcheck import ppo_args, sft_args, train

from rlhflab.checkpoint import complete_checkpoints
from rlhflab.cli import main
from rlhflab.trainers import ppo, sft


def saved_steps(out) -> list[int]:
    return [int(p.name.split("-")[1]) for p in complete_checkpoints(out / "checkpoints")]


def every_update(policy_dir, out) -> list[str]:
    return [*ppo_args(policy_dir, out), "--save_every", "1", "--keep_last_n", "0"]


def test_nan_rewards_stop_ppo_naming_the_update_with_no_checkpoint_after_it(policy_dir, tmp_path, monkeypatch):
    calls = []

    def reward_turns_nan(prompts, responses, items):  # one call per update (no calibration for a custom reward)
        calls.append(1)
        return [math.nan if len(calls) >= 3 else 0.5] * len(responses)

    real_train = ppo.train
    monkeypatch.setattr(ppo, "train", lambda cfg, monitor=None: real_train(cfg, reward_fn=reward_turns_nan,
                                                                            monitor=monitor))
    with pytest.raises(FloatingPointError, match="update 3: the reward source failed on every row"):
        train(every_update(policy_dir, tmp_path / "run"))
    assert saved_steps(tmp_path / "run") == [1, 2] and not (tmp_path / "run" / "model").exists()


def test_a_nan_loss_stops_ppo_naming_update_and_rows_with_no_checkpoint_after_it(policy_dir, tmp_path, monkeypatch):
    real = ppo.minibatch_losses
    seen = []

    def nan_at_update_2(roles, rollout, idx, *args):
        loss, stats = real(roles, rollout, idx, *args)
        seen.append(1)
        per_update = 2 * 2  # num_ppo_epochs x num_mini_batches
        return (loss * math.nan if len(seen) > per_update else loss), stats

    monkeypatch.setattr(ppo, "minibatch_losses", nan_at_update_2)
    with pytest.raises(FloatingPointError, match=r"PPO update 2: non-finite loss nan \(rollout rows \[\d"):
        train(every_update(policy_dir, tmp_path / "run"))
    assert saved_steps(tmp_path / "run") == [1]


def test_a_nan_sft_loss_stops_naming_the_step_and_cli_exits_3(tmp_path, monkeypatch, capsys):
    real = sft.completion_loss_sum
    calls = []

    def nan_from_step_4(model, batch):
        calls.append(1)
        loss = real(model, batch)
        return loss * math.nan if len(calls) >= 4 else loss

    monkeypatch.setattr(sft, "completion_loss_sum", nan_from_step_4)
    out = tmp_path / "run"
    assert main([*sft_args(out), "--save_every", "1", "--keep_last_n", "0"]) == 3
    assert "SFT step 4: non-finite SFT loss nan" in capsys.readouterr().err
    assert saved_steps(out) == [1, 2, 3] and not (out / "model").exists()


def test_a_truncated_checkpoint_is_a_clear_error_on_resume_not_a_fresh_start(tmp_path, capsys):
    out = tmp_path / "run"
    train(sft_args(out))
    latest = complete_checkpoints(out / "checkpoints")[-1]
    weights = latest / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    history = (out / "metrics.jsonl").read_text()
    assert main([*sft_args(out), "--resume", "latest"]) == 2
    err = capsys.readouterr().err
    assert str(weights) in err and "truncated" in err and "--resume" in err  # names the earlier checkpoint
    assert (out / "metrics.jsonl").read_text() == history


def test_weights_that_went_non_finite_are_never_checkpointed(tmp_path):
    from rlhflab.checkpoint import Checkpointer

    saver = Checkpointer(tmp_path, save_every=1, keep_last_n=0)
    with pytest.raises(FloatingPointError, match="step 7: non-finite weights"):
        saver.step_done(7, lambda: ({"w": torch.tensor([1.0, math.inf])}, {}))
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
