"""A full disk or an I/O error while writing a checkpoint, the final model or a history file ends the run with one
line (what, where, the space needed, the last complete checkpoint, the command that resumes) and exit code 5; the
partial folder is removed and nothing complete is touched; so do config.yaml, fingerprints.json, worst_cases.md and
the rows copied into RUN/inputs/. The final model folder (and config.yaml) is written whole or not at all.
A history cut short by a host crash resumes with a warning instead of a refusal (issue 34, items 1-2)."""

import errno
import json
import logging
import os
import pickle
import re
import shlex
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from runcheck import assert_same_weights, metrics, sft_args

import rlhflab.checkpoint.folder as folder
from rlhflab import models, tracking
from rlhflab.checkpoint import atomic_folder, complete_checkpoints, verify
from rlhflab.cli import main
from rlhflab.config import RMConfig
from rlhflab.errors import WRITE_FAILED_EXIT_CODE, WriteFailed

NO_SPACE = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def steps(out) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def one_line(err: str) -> str:
    """The CLI's write-failed message: exactly one such line on stderr."""
    lines = [line for line in err.splitlines() if "write failed" in line]
    assert len(lines) == 1, err
    return lines[0]


def resume_command(line: str, out) -> list[str]:
    """The printed command that resumes the run, as `main` takes it."""
    command = line.split("resume with: ", 1)[1]
    assert command == f"rlhflab sft --config {out / 'config.yaml'} --resume latest --output_dir {out}"
    return shlex.split(command)[1:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted SFT run the resumed ones must equal."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert main([*sft_args(out), "--write_report", "false"]) == 0
    return out


def test_a_full_disk_during_a_checkpoint_ends_with_one_line_and_the_printed_command_resumes(
        reference, tmp_path, monkeypatch, capsys):
    real, calls = folder.save_file, []

    def disk_full_at_step_9(tensors, path, *args, **kwargs):  # model + state per checkpoint: step 9's first write
        calls.append(path)
        if len(calls) == 5:
            with open(path, "wb") as f:
                f.write(b"half a file")
            raise NO_SPACE
        return real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(folder, "save_file", disk_full_at_step_9)
    out = tmp_path / "run"
    assert main([*sft_args(out), "--write_report", "false"]) == WRITE_FAILED_EXIT_CODE
    line = one_line(capsys.readouterr().err)
    assert re.search(rf"write failed: could not write checkpoint step-9 to {out}/checkpoints/step-9: No space left on "
                     r"device \(ENOSPC\) \(needed about \d+\.\d KiB, \d+\.\d (KiB|MiB) free\); last complete "
                     rf"checkpoint {out}/checkpoints/step-6; free space, then resume with: ", line), line
    assert steps(out) == ["step-3", "step-6"] and not (out / "model").exists()  # .tmp-step-9 removed
    verify(out / "checkpoints" / "step-6")  # complete and untouched (step-3 pruned only after a new one)

    monkeypatch.setattr(folder, "save_file", real)  # space freed
    assert main(resume_command(line, out)) == 0
    assert metrics(out) == metrics(reference)
    assert_same_weights(reference, out)


def test_a_full_disk_during_the_final_save_leaves_no_model_folder_and_resumes(reference, tmp_path, monkeypatch,
                                                                              capsys):
    real = models.save_model_folder

    def half_written(out_dir, model, tokenizer):
        real(out_dir, model, tokenizer)  # every file there, then the disk fills (a tokenizer file, say)
        raise NO_SPACE

    monkeypatch.setattr(models, "save_model_folder", half_written)
    out = tmp_path / "run"
    assert main([*sft_args(out), "--write_report", "false"]) == WRITE_FAILED_EXIT_CODE
    line = one_line(capsys.readouterr().err)
    assert f"could not write the final model folder to {out}/model: No space left on device" in line
    assert f"last complete checkpoint {out}/checkpoints/step-16" in line
    assert not (out / "model").exists() and not (out / ".tmp-model").exists()

    monkeypatch.setattr(models, "save_model_folder", real)
    assert main(resume_command(line, out)) == 0  # the end-of-run checkpoint: straight to the final save
    assert_same_weights(reference, out)


def test_a_full_disk_while_logging_metrics_exits_5_naming_the_file(tmp_path, monkeypatch, capsys):
    real, rows = open, []

    def metrics_fill_the_disk(file, mode="r", *args, **kwargs):
        if str(file).endswith("metrics.jsonl") and "a" in mode:
            rows.append(1)
            if len(rows) == 8:
                raise NO_SPACE
        return real(file, mode, *args, **kwargs)

    monkeypatch.setattr(tracking, "open", metrics_fill_the_disk, raising=False)
    out = tmp_path / "run"
    assert main([*sft_args(out), "--write_report", "false"]) == WRITE_FAILED_EXIT_CODE
    line = one_line(capsys.readouterr().err)
    assert re.search(rf"could not write metrics.jsonl \(step \d+\) to {out}/metrics.jsonl: No space left on device "
                     rf"\(ENOSPC\) \(needed about \d+\.\d KiB, .* free\); last complete checkpoint "
                     rf"{out}/checkpoints/step-\d+; free space, then resume with: rlhflab sft", line), line
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 7


def test_the_final_folder_is_replaced_whole_or_not_at_all(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text("old")
    with pytest.raises(WriteFailed, match="the final model folder"):
        with atomic_folder(target, "the final model folder", tmp_path) as tmp:
            (tmp / "config.json").write_text("new")
            raise NO_SPACE
    assert [p.name for p in tmp_path.iterdir()] == ["model"] and (target / "config.json").read_text() == "old"
    with pytest.raises(KeyError):  # any other error: the same, and not taken for a write failure
        with atomic_folder(target, "the final model folder") as tmp:
            raise KeyError("bug")
    with atomic_folder(target, "the final model folder") as tmp:
        (tmp / "config.json").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["model"] and (target / "config.json").read_text() == "new"


def test_a_history_cut_short_by_a_crash_resumes_with_a_warning_counting_the_lost_rows(reference, tmp_path, caplog):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    shutil.rmtree(out / "checkpoints" / "step-16")  # the host crashed after step 15's checkpoint ...
    held = json.loads((out / "checkpoints" / "step-15" / "state.json").read_text())["histories"]["metrics.jsonl"]
    rows = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    kept = held["lines"] - 3
    (out / "metrics.jsonl").write_text("".join(rows[:kept]) + rows[kept][:9])  # ... and its last 3 rows, one half
    with caplog.at_level(logging.WARNING, logger="rlhflab"):
        assert main([*sft_args(out), "--write_report", "false", "--resume", "latest"]) == 0
    assert (f"metrics.jsonl has {kept} of the {held['lines']} rows it held at the checkpoint (a crash lost the rest): "
            "continuing from the checkpoint without the 3 lost row(s)") in caplog.text
    assert json.loads((out / "summary.json").read_text())["resumes"][-1]["lost_history_rows"] == {"metrics.jsonl": 3}
    assert metrics(out) == metrics(reference)[:kept] + metrics(reference)[held["lines"]:]
    assert_same_weights(reference, out)


def test_rm_writes_a_checkpoint_every_50_steps_by_default():
    assert RMConfig().save_every == 50  # as DPO; it was 0 (only at the end), so a day's RM run could lose it all


@pytest.fixture
def small_disk(tmp_path):
    """A 7 MB tmpfs (root only; skipped where mounting is not permitted, as on most CI machines)."""
    mount = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=7m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()[:200]}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_real_full_disk_ends_with_exit_5_and_resumes_once_space_is_freed(reference, small_disk, capsys):
    out = small_disk / "run"
    ballast = small_disk / "ballast"
    checkpoint = sum(f.stat().st_size for f in (reference / "checkpoints" / "step-15").iterdir())
    with open(ballast, "wb") as f:  # room for the start and about three checkpoints (keep_last_n 0 keeps all)
        f.write(b"\0" * (shutil.disk_usage(small_disk).free - int(3.5 * checkpoint) - (256 << 10)))
    assert main([*sft_args(out), "--write_report", "false", "--keep_last_n", "0"]) == WRITE_FAILED_EXIT_CODE
    line = one_line(capsys.readouterr().err)
    assert "No space left on device" in line and "free space, then resume with: rlhflab sft" in line
    done = complete_checkpoints(out / "checkpoints")
    assert done and not [p for p in (out / "checkpoints").iterdir() if p not in done]
    assert not (out / "model").exists()
    ballast.unlink()
    assert main(resume_command(line, out)) == 0
    assert_same_weights(reference, out)


def test_safetensors_io_errors_are_write_failures_and_the_message_crosses_to_other_ranks(tmp_path):
    from safetensors import SafetensorError

    from rlhflab.errors import write_error_reason

    disk_full = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert write_error_reason(disk_full) == "No space left on device (ENOSPC)"
    assert write_error_reason(SafetensorError("invalid header")) is None  # not a write failure: raised as it is
    assert write_error_reason(KeyError("x")) is None
    err = WriteFailed("checkpoint step-4", tmp_path / "checkpoints" / "step-4", "No space left on device (ENOSPC)",
                      tmp_path, needed=3 << 20, stage="grpo")
    (tmp_path / "checkpoints" / "step-2").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-2" / "COMPLETE").write_text("{}")
    (tmp_path / "checkpoints" / "step-3").mkdir()  # never finished: not the one to resume from
    crossed = pickle.loads(pickle.dumps(err))  # parallel.World.from_main sends rank 0's error to every rank
    assert str(crossed) == str(err) and crossed.stage == "grpo"
    assert re.fullmatch(rf"could not write checkpoint step-4 to {tmp_path}/checkpoints/step-4: No space left on "
                        r"device \(ENOSPC\) \(needed about 3\.0 MiB, \d+\.\d MiB free\); last complete checkpoint "
                        rf"{tmp_path}/checkpoints/step-2; free space, then resume with: rlhflab grpo --config "
                        rf"{tmp_path}/config.yaml --resume latest --output_dir {tmp_path}", str(err))


# --- the files a run writes at start-up and on the side: the same one line and exit code 5 -------------------


def fill_the_disk_at(monkeypatch, name: str) -> None:
    """Path.write_text of a file called `name` writes half its text, then fails as a full disk does."""
    real = Path.write_text

    def write_text(self, data, *args, **kwargs):
        if self.name == name:
            real(self, data[: len(data) // 2], *args, **kwargs)
            raise NO_SPACE
        return real(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)


@pytest.mark.parametrize("name,written", [("config.yaml", ".config.yaml.partial"),
                                          ("fingerprints.json", "fingerprints.json.tmp")])
def test_a_full_disk_at_start_up_exits_5_with_one_line_and_leaves_no_partial_file(tmp_path, monkeypatch, capsys,
                                                                                   name, written):
    fill_the_disk_at(monkeypatch, written)
    out = tmp_path / "run"
    assert main([*sft_args(out), "--write_report", "false"]) == WRITE_FAILED_EXIT_CODE
    line = one_line(capsys.readouterr().err)
    assert re.search(rf"write failed: could not write {re.escape(name)} to {out}/{re.escape(name)}: No space left on "
                     r"device \(ENOSPC\) \(needed about \d+\.\d KiB, .* free\); no complete checkpoint; free space, "
                     r"then start the run again \(--overwrite\)$", line), line
    assert not (out / written).exists() and not (out / "checkpoints").exists()
    monkeypatch.undo()  # space freed: the run starts again in the same folder (its lock was released)
    assert main([*sft_args(out), "--write_report", "false", "--overwrite"]) == 0
    assert (out / name).is_file() and (out / "model").is_dir()


def test_a_resume_that_rewrites_config_yaml_on_a_full_disk_keeps_the_old_one_whole(reference, tmp_path, monkeypatch,
                                                                                   capsys):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    before = (out / "config.yaml").read_text()
    fill_the_disk_at(monkeypatch, ".config.yaml.partial")
    changed = [*sft_args(out), "--write_report", "false", "--resume", str(out / "checkpoints" / "step-15"),
               "--learning_rate", "0.01", "--allow_config_change", "true"]
    assert main(changed) == WRITE_FAILED_EXIT_CODE
    line = one_line(capsys.readouterr().err)
    assert f"could not write config.yaml to {out}/config.yaml: No space left on device" in line
    assert "resume with: rlhflab sft" in line  # the run has complete checkpoints: the line says how to go on
    assert (out / "config.yaml").read_text() == before  # never half a YAML file: the run stays resumable
    assert not (out / ".config.yaml.partial").exists()


def test_a_full_disk_while_copying_in_memory_rows_into_run_inputs_is_a_write_failure(tmp_path, monkeypatch):
    import builtins

    from rlhflab.api import inputs

    real_open = builtins.open

    def full_disk(file, mode="r", *args, **kwargs):
        if ".partial" in str(file) and "w" in mode:
            with real_open(file, mode, *args, **kwargs) as f:
                f.write('{"prompt": "half a row')
            raise NO_SPACE
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(inputs, "open", full_disk, raising=False)
    run = tmp_path / "run"
    rows = [{"prompt": "2+2=", "completion": "4"}] * 3
    with pytest.raises(WriteFailed) as err:
        inputs.write_dataset(rows, run / "inputs" / "train", "train_dataset", "sft")
    assert str(err.value).startswith(f"could not write train_dataset (the run's copy of its rows) to "
                                     f"{run}/inputs/train.jsonl: No space left on device (ENOSPC)")
    assert list((run / "inputs").iterdir()) == []  # the partial file removed, no train.jsonl
    monkeypatch.undo()
    assert inputs.write_dataset(rows, run / "inputs" / "train", "train_dataset", "sft") == str(run / "inputs" /
                                                                                               "train.jsonl")


def test_a_full_disk_while_writing_worst_cases_md_exits_5_naming_it(policy_dir, tmp_path, monkeypatch, capsys):
    tokenizer = models.load_tokenizer(policy_dir)
    rm_dir = tmp_path / "rm"
    models.build_reward_model_from_causal(policy_dir, tokenizer).save_pretrained(rm_dir)
    tokenizer.save_pretrained(rm_dir)
    fill_the_disk_at(monkeypatch, "worst_cases.md")
    out = tmp_path / "diagnosis"
    args = ["rm", "diagnose", "--reward_model", str(rm_dir), "--policy", policy_dir, "--output_dir", str(out),
            "--split", "validation", "--num_train_prompts", "22", "--num_validation_prompts", "4",
            "--num_test_prompts", "4", "--samples_per_prompt", "1", "--max_new_tokens", "4", "--progress", "false",
            "--threads", "1", "--write_report", "false"]
    assert main(args) == WRITE_FAILED_EXIT_CODE
    line = one_line(capsys.readouterr().err)
    assert f"could not write worst_cases.md to {out}/worst_cases.md: No space left on device (ENOSPC)" in line
