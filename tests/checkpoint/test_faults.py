"""Injected faults: NaN in a reward, a loss (SFT, RM, DPO, PPO) or an advantage, and an inf gradient behind a finite
loss, stop the run with no checkpoint after it (or, with --nonfinite skip, drop and count the update); a damaged
checkpoint is a clear error on resume, never a silent fresh start."""

import json
import math
import os
import re
import shutil

import pytest
import torch
from runcheck import assert_same_weights, metrics, ppo_args, rm_args, sft_args, train
from safetensors.torch import load_file

from rlhflab import models
from rlhflab.checkpoint import complete_checkpoints
from rlhflab.cli import main
from rlhflab.trainers import ppo, reward, sft


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
    real = ppo.PPO.loss
    seen = []

    def nan_at_update_2(self, *args):
        loss, stats = real(self, *args)
        seen.append(1)
        per_update = 2 * 2  # num_ppo_epochs x num_mini_batches
        return (loss * math.nan if len(seen) > per_update else loss), stats

    monkeypatch.setattr(ppo.PPO, "loss", nan_at_update_2)
    with pytest.raises(FloatingPointError, match=r"PPO update 2: non-finite PPO loss nan at lr \S+ \(rollout rows "
                                                 r"\[\d+(, \d+)*\], train prompts \[\d+(, \d+)*\]\); no checkpoint"):
        train(every_update(policy_dir, tmp_path / "run"))
    assert saved_steps(tmp_path / "run") == [1]


def test_a_nan_sft_loss_stops_naming_the_step_and_cli_exits_3(tmp_path, monkeypatch, capsys):
    real = {"completion_loss_sum": sft.completion_loss_sum, "packed_loss_sum": sft.packed_loss_sum}
    calls = []

    def nan_from_step_4(model, batch):
        calls.append(1)
        loss = real[packed_or_padded(batch)](model, batch)
        return loss * math.nan if len(calls) >= 4 else loss

    monkeypatch.setattr(sft, "completion_loss_sum", nan_from_step_4)
    monkeypatch.setattr(sft, "packed_loss_sum", nan_from_step_4)  # packing (the default) sums through this one
    out = tmp_path / "run"
    assert main([*sft_args(out), "--save_every", "1", "--keep_last_n", "0"]) == 3
    err = capsys.readouterr().err
    assert "SFT step 4: non-finite SFT loss nan" in err
    assert re.search(r"\(train examples \[\d+(, \d+){7}\]\); no checkpoint or model written after it", err)
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


def packed_or_padded(batch) -> str:
    """Which of SFT's two loss sums a batch goes through: packed rows (the default) or a padded batch."""
    return "packed_loss_sum" if isinstance(batch, models.PackedSequences) else "completion_loss_sum"


def patch_sft_loss(monkeypatch, steps: set[int], offset: int = 0) -> None:
    """Both SFT loss sums return NaN at the training steps in `steps` (one shared step count)."""
    real = {"completion_loss_sum": sft.completion_loss_sum, "packed_loss_sum": sft.packed_loss_sum}
    patched = nan_at_steps(lambda model, batch: real[packed_or_padded(batch)](model, batch), steps, offset)
    monkeypatch.setattr(sft, "completion_loss_sum", patched)
    monkeypatch.setattr(sft, "packed_loss_sum", patched)


def nan_at_steps(real, steps: set[int], offset: int = 0):
    """`real` (sft.completion_loss_sum) returning NaN during the training steps in `steps`; a step = one training
    call (validation calls run with model.eval()); `offset` = steps already done by a resumed run."""
    calls = []

    def patched(model, batch):
        loss = real(model, batch)
        if not model.training:
            return loss
        calls.append(1)
        return loss * math.nan if offset + len(calls) in steps else loss

    return patched


def same_tensors(a, b) -> bool:
    left, right = load_file(str(a)), load_file(str(b))
    return left.keys() == right.keys() and all(left[k].equal(right[k]) for k in left)


def test_skip_mode_drops_nan_sft_steps_counts_them_and_resumes_exactly(tmp_path, monkeypatch):
    out = tmp_path / "run"
    args = [*sft_args(out), "--save_every", "1", "--keep_last_n", "0", "--nonfinite", "skip"]
    patch_sft_loss(monkeypatch, {2, 7})
    train(args)
    rows = metrics(out)
    assert [r["nonfinite/skipped_updates"] for r in rows if "loss/sft" in r] == [0] + [1] * 5 + [2] * 10
    assert [r["step"] for r in rows if r.get("loss/sft") == "nan"] == [2, 7]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["nonfinite"] == {"mode": "skip", "skipped_updates": 2} and (out / "model").is_dir()
    steps = out / "checkpoints"
    assert same_tensors(steps / "step-1" / "model.safetensors", steps / "step-2" / "model.safetensors")
    assert not same_tensors(steps / "step-2" / "model.safetensors", steps / "step-3" / "model.safetensors")
    # resumed between the two skips (one counted, one to come): the same history and weights, bit for bit
    reference = tmp_path / "reference"
    shutil.copytree(out, reference)
    patch_sft_loss(monkeypatch, {2, 7}, offset=4)
    train([*args, "--resume", str(steps / "step-4")])
    assert metrics(out) == metrics(reference)
    assert_same_weights(reference, out)


def test_skip_mode_drops_nan_ppo_minibatch_steps_and_counts_them(policy_dir, tmp_path, monkeypatch):
    real = ppo.PPO.loss
    seen = []
    per_update = 2 * 2  # num_ppo_epochs x num_mini_batches
    injected = set(range(2 * per_update + 1, 3 * per_update + 1)) | {4 * per_update + 2}  # all of update 3, one of 5

    def nan_loss(self, *args):
        loss, stats = real(self, *args)
        seen.append(1)
        return (loss * math.nan if len(seen) in injected else loss), stats

    monkeypatch.setattr(ppo.PPO, "loss", nan_loss)
    out = tmp_path / "run"
    train([*every_update(policy_dir, out), "--nonfinite", "skip"])
    rows = [r for r in metrics(out) if "kl_coef" in r]  # the update rows, not the evaluations
    assert [r["nonfinite/skipped_updates"] for r in rows] == [0, 0, 4, 4, 5, 5]
    assert "loss/policy_avg" not in rows[2] and "loss/policy_avg" in rows[4]  # a dropped step's stats stay out
    assert json.loads((out / "summary.json").read_text())["nonfinite"]["skipped_updates"] == 5
    steps = out / "checkpoints"
    assert same_tensors(steps / "step-2" / "model.safetensors", steps / "step-3" / "model.safetensors")
    assert not same_tensors(steps / "step-3" / "model.safetensors", steps / "step-4" / "model.safetensors")
    assert (out / "model").is_dir()


def test_a_nan_reward_model_loss_stops_naming_the_step_and_its_pairs(policy_dir, tmp_path, monkeypatch):
    real, calls = reward.bradley_terry_loss, []

    def nan_at_step_3(chosen, rejected, **kwargs):
        loss, stats = real(chosen, rejected, **kwargs)
        calls.append(1)
        return (loss * math.nan if len(calls) == 3 else loss), stats

    monkeypatch.setattr(reward, "bradley_terry_loss", nan_at_step_3)
    out = tmp_path / "run"
    with pytest.raises(FloatingPointError, match=r"reward-model step 3: non-finite reward-model loss nan at lr \S+ "
                                                 r"\(train pairs \[\d+, \d+, \d+, \d+\]\); no checkpoint"):
        train([*rm_args(policy_dir, out), "--save_every", "1", "--keep_last_n", "0"])
    assert saved_steps(out) == [1, 2]


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_non_finite_advantages_stop_naming_rows_and_prompts_or_drop_the_update(policy_dir, tmp_path, monkeypatch,
                                                                              mode):
    real, calls = ppo.gae, []

    def nan_row_at_update_2(rewards, values, mask, gamma, lam):
        advantages, returns = real(rewards, values, mask, gamma, lam)
        calls.append(1)
        if len(calls) == 2:
            advantages[5, 0] = math.nan  # as a NaN value estimate of row 5 would
        return advantages, returns

    monkeypatch.setattr(ppo, "gae", nan_row_at_update_2)
    out = tmp_path / "run"
    args = [*every_update(policy_dir, out), "--nonfinite", mode]
    if mode == "stop":
        with pytest.raises(FloatingPointError, match=r"PPO update 2: non-finite advantages \(rollout rows \[5\], "
                                                     r"train prompts \[\d+\]\); no checkpoint written after it"):
            train(args)
        assert saved_steps(out) == [1]
        return
    train(args)
    assert [r["nonfinite/skipped_updates"] for r in metrics(out) if "kl_coef" in r] == [0, 4, 4, 4, 4, 4]
    steps = out / "checkpoints"
    assert same_tensors(steps / "step-1" / "model.safetensors", steps / "step-2" / "model.safetensors")


# --- an inf gradient behind a finite loss (float32: no loss scaler to explain it) -----------------------------


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_an_inf_gradient_with_a_finite_loss_stops_or_is_dropped_as_a_nan_loss_is(mode):
    from rlhflab.trainers.nonfinite import clip_and_step

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))

    def backward() -> float:
        loss = model(torch.ones(4, 3)).pow(2).mean()
        loss.backward()
        return loss.item()

    assert clip_and_step(optimizer, scheduler, model.parameters(), 1.0, backward(), mode, "test") is not None
    weights, moments = {k: v.clone() for k, v in model.state_dict().items()}, str(optimizer.state_dict())
    lr = scheduler.get_last_lr()
    loss = backward()
    model.weight.grad[1, 2] = math.inf  # one overflowed gradient element; the loss itself is finite
    assert math.isfinite(loss)
    if mode == "stop":
        with pytest.raises(FloatingPointError, match=r"non-finite test gradient norm at lr"):
            clip_and_step(optimizer, scheduler, model.parameters(), 1.0, loss, mode, "test")
    else:
        assert clip_and_step(optimizer, scheduler, model.parameters(), 1.0, loss, mode, "test") is None
        assert all(p.grad is None for p in model.parameters())  # dropped: nothing carried into the next step
    # no AdamW step (the clip would have scaled every other gradient to 0 and stepped on the moments) and no LR step
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    assert str(optimizer.state_dict()) == moments and scheduler.get_last_lr() == lr


def test_an_inf_gradient_stops_sft_naming_the_step_and_cli_exits_3(tmp_path, monkeypatch, capsys):
    from rlhflab.trainers.nonfinite import clip_and_step

    steps = []

    def inf_gradient_at_step_4(optimizer, scheduler, params, *args, **kwargs):
        params = list(params)
        steps.append(1)
        if len(steps) == 4:
            params[0].grad.view(-1)[0] = math.inf
        return clip_and_step(optimizer, scheduler, params, *args, **kwargs)

    monkeypatch.setattr(sft, "clip_and_step", inf_gradient_at_step_4)
    out = tmp_path / "run"
    assert main([*sft_args(out), "--save_every", "1", "--keep_last_n", "0"]) == 3
    err = capsys.readouterr().err
    assert re.search(r"SFT step 4: non-finite SFT gradient norm at lr \S+ \(train examples \[\d+(, \d+){7}\]\); "
                     r"no checkpoint or model written after it", err), err
    assert saved_steps(out) == [1, 2, 3] and not (out / "model").exists()


def test_a_nan_dpo_loss_stops_naming_the_step_and_its_pairs_with_no_checkpoint_after_it(policy_dir, tmp_path,
                                                                                        monkeypatch, capsys):
    from rlhflab.trainers import dpo

    real_step, real_loss, steps = dpo.train_step, dpo.preference_loss, []

    def counted(*args, **kwargs):
        steps.append(1)
        return real_step(*args, **kwargs)

    def nan_in_step_3(cfg, policy, reference):
        loss, stats = real_loss(cfg, policy, reference)
        return (loss * math.nan, {**stats, "loss": math.nan}) if len(steps) == 3 else (loss, stats)

    monkeypatch.setattr(dpo, "train_step", counted)
    monkeypatch.setattr(dpo, "preference_loss", nan_in_step_3)
    out = tmp_path / "run"
    args = ["dpo", "--model", policy_dir, "--output_dir", str(out), "--pairs_per_prompt", "1", "--batch_size", "4",
            "--max_steps", "5", "--eval_every", "0", "--save_every", "1", "--keep_last_n", "0",
            "--write_report", "false", "--num_train_prompts", "22", "--num_validation_prompts", "11",
            "--num_test_prompts", "11", "--progress", "false", "--threads", "1"]
    assert main(args) == 3
    err = capsys.readouterr().err
    assert re.search(r"DPO step 3: non-finite DPO loss nan at lr \S+ \(train pairs \[\d+, \d+, \d+, \d+\]\); "
                     r"no checkpoint or model written after it", err), err
    assert saved_steps(out) == [1, 2] and not (out / "model").exists()
