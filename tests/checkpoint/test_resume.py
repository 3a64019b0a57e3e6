"""SIGKILL a real `rlhflab` process mid-run, resume it, and get the uninterrupted run bit for bit.

Each test: one uninterrupted run in-process (the reference), one CLI subprocess killed
with SIGKILL as soon as its second checkpoint is complete (so it dies inside a later
step, with metrics rows of that step possibly written), then `--resume latest` in-process.
Metrics are compared without wall-clock fields; weights bitwise.
"""

import json
import shutil

import pytest
import yaml
from runcheck import assert_same_weights, kill_after, metrics, ppo_args, rm_args, sft_args, start_cli, train

from rlhflab.checkpoint import MARKER, complete_checkpoints
from rlhflab.cli import main


def killed_then_resumed(args, tmp_path, kill_at_step: int):
    """Run `args` in a subprocess, SIGKILL it once checkpoint `kill_at_step` is complete, resume in-process."""
    out = tmp_path / "resumed"
    proc = start_cli(*args(out))
    code, err = kill_after(out / "checkpoints" / f"step-{kill_at_step}" / MARKER, proc)
    assert code == -9, err
    assert not (out / "summary.json").exists()  # it really died mid-run
    train([*args(out), "--resume", "latest"])
    return out


@pytest.mark.parametrize("stage,kill_at_step,last_step", [("ppo", 4, 6), ("sft", 6, 16), ("rm", 6, 22)])
def test_sigkill_mid_run_then_resume_equals_the_uninterrupted_run(stage, kill_at_step, last_step, policy_dir,
                                                                  tmp_path):
    args = {"ppo": lambda out: ppo_args(policy_dir, out), "sft": sft_args,
            "rm": lambda out: rm_args(policy_dir, out)}[stage]
    reference = tmp_path / "reference"
    train(args(reference))
    resumed = killed_then_resumed(args, tmp_path, kill_at_step)
    assert metrics(resumed) == metrics(reference)
    assert_same_weights(reference, resumed)
    summary = json.loads((resumed / "summary.json").read_text())
    assert [r["step"] for r in summary["resumes"]] == [kill_at_step]
    assert summary["resumes"][0]["config_changes"] == {}
    kept = [p.name for p in complete_checkpoints(resumed / "checkpoints")]
    assert len(kept) == 2 and kept[-1] == f"step-{last_step}"  # keep_last_n = 2, the last one at the end


def test_resume_with_a_changed_config_is_refused_unless_allowed(policy_dir, tmp_path, capsys):
    out = tmp_path / "run"
    args = [*rm_args(policy_dir, out), "--keep_last_n", "0"]  # keep every checkpoint (an ignored key on resume)
    train(args)
    before = (out / "metrics.jsonl").read_text()
    old_lr = {r["step"]: r["lr"] for r in metrics(out) if "lr" in r}
    assert main([*args, "--resume", "latest", "--learning_rate", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "learning_rate: 0.0003 -> 0.1" in err and "--allow_config_change" in err
    assert (out / "metrics.jsonl").read_text() == before  # refused before touching anything
    step = out / "checkpoints" / "step-9"  # past the 5 warmup steps, 13 steps of linear decay to go
    train([*args, "--resume", str(step), "--learning_rate", "0.1", "--allow_config_change", "true"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumes"][-1]["config_changes"] == {"learning_rate": {"was": 0.0003, "now": 0.1}}
    assert yaml.safe_load((out / "config.yaml").read_text())["learning_rate"] == 0.1
    # the optimiser really trains with the new peak lr, on the same schedule (not the checkpoint's 3e-4)
    new_lr = {r["step"]: r["lr"] for r in metrics(out) if "lr" in r}
    assert [new_lr[s] for s in range(1, 10)] == [old_lr[s] for s in range(1, 10)]
    assert [new_lr[s] for s in range(10, 23)] == pytest.approx([old_lr[s] / 0.0003 * 0.1 for s in range(10, 23)])
    assert new_lr[10] > 0.05


def test_a_setting_added_after_the_run_started_is_no_change_at_its_default(tmp_path):
    from rlhflab.checkpoint.resume import config_changes
    from rlhflab.config import RMConfig, write_config

    saved = tmp_path / "config.yaml"
    write_config(RMConfig(model="m"), saved)
    older = {k: v for k, v in yaml.safe_load(saved.read_text()).items() if k != "prompt_rows_together"}
    saved.write_text(yaml.safe_dump(older))  # a run started before the setting existed
    assert config_changes(RMConfig(model="m"), saved) == {}
    assert config_changes(RMConfig(model="m", prompt_rows_together=3), saved) == {
        "prompt_rows_together": {"was": None, "now": 3}}


def test_a_resume_that_fails_to_unpack_leaves_the_run_folder_untouched(tmp_path, capsys):
    out = tmp_path / "run"
    train(sft_args(out))
    before = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    earlier = complete_checkpoints(out / "checkpoints")[0]  # resuming it would cut metrics.jsonl, drop step-16
    code = main([*sft_args(out), "--resume", str(earlier), "--hidden_size", "48", "--allow_config_change", "true"])
    assert code == 2
    assert f"{earlier / 'model.safetensors'}: checkpoint weight" in capsys.readouterr().err
    after = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert after.keys() == before.keys()
    for rel in before:
        assert after[rel] == before[rel], f"{rel} changed by a resume that failed"


def test_a_checkpoint_without_marker_is_skipped_and_cleaned_by_the_next_save(policy_dir, tmp_path):
    reference, out = tmp_path / "reference", tmp_path / "run"
    train(sft_args(reference))
    train(sft_args(out))
    # a crash while writing step 16's checkpoint: renamed but no marker yet, and a half-written temp folder
    (out / "checkpoints" / "step-16" / MARKER).unlink()
    shutil.copytree(out / "checkpoints" / "step-16", out / "checkpoints" / ".tmp-step-17")
    (out / "summary.json").unlink()
    train([*sft_args(out), "--resume", "latest"])
    assert json.loads((out / "summary.json").read_text())["resumes"][0]["step"] == 15
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-15", "step-16"]
    assert metrics(out) == metrics(reference)
    assert_same_weights(reference, out)
