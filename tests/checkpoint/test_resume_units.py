"""Where a resume starts and what it checks, on hand-made folders, no model (issue 36): what changed, the
histories, the Checkpointer and open_run (--overwrite, report_to backends and callbacks, what a refusal and a
commit say; its layout check and several ranks are in test_state_units.py) (checkpoint/resume.py)."""

import json
import logging
import signal

import pytest
import torch

from rlhflab import parallel
from rlhflab.errors import UserInputError

from run_stubs import Rows, recorder_backend


# --- checkpoint/resume.py: where a resume starts, what changed -------------------------------------------


def test_the_checkpoint_a_resume_names_and_the_mistakes_it_refuses(tmp_path):
    from types import SimpleNamespace

    from rlhflab.checkpoint.folder import save_checkpoint
    from rlhflab.checkpoint.resume import resume_target

    run = tmp_path / "run"

    def refused(resume, output_dir=""):
        with pytest.raises(UserInputError) as err:
            resume_target(SimpleNamespace(resume=resume, output_dir=output_dir))
        return str(err.value)

    assert refused("latest") == ("--output_dir: --resume latest needs the run folder -> pass --output_dir RUN (the "
                                 "folder of the run to continue)")
    assert refused("latest", str(run)) == (f"{run / 'checkpoints'}: no complete checkpoint to resume from -> start "
                                           "the run again (with --overwrite to replace the folder)")
    (run / ".replacing.json").parent.mkdir(parents=True)
    from rlhflab.checkpoint import ownership

    (run / ownership.REPLACING).write_text(json.dumps({"replaced": [str(tmp_path / "old")]}))
    assert refused("latest", str(run)).endswith(
        f"(with --overwrite to replace the folder); {ownership.kept_message(run, [tmp_path / 'old'])}")
    for step in (3, 5):
        save_checkpoint(run / "checkpoints", step, {"w": torch.ones(1)}, {})
    assert resume_target(SimpleNamespace(resume="latest", output_dir=str(run))) == (run, run / "checkpoints" / "step-5")
    step3 = run / "checkpoints" / "step-3"
    assert resume_target(SimpleNamespace(resume=str(step3), output_dir="")) == (run, step3)
    assert resume_target(SimpleNamespace(resume=str(step3), output_dir=f"{tmp_path}/./run")) == (run, step3)
    for wrong in (run / "checkpoints", tmp_path / "elsewhere" / "step-3"):
        assert refused(str(wrong)) == (f"--resume {wrong}: not a checkpoint folder (RUN/checkpoints/step-N) -> pass "
                                       "a step-N folder, or --resume latest --output_dir RUN")
    assert refused(str(step3), str(tmp_path / "other")) == (
        f"--resume: the checkpoint belongs to run {run}, not --output_dir {tmp_path / 'other'} -> drop --output_dir, "
        "or pass a checkpoint of that run")


def test_the_config_changes_a_resume_sees(tmp_path):
    import yaml

    from rlhflab.checkpoint.resume import config_changes
    from rlhflab.config import RMConfig, write_config

    saved = tmp_path / "config.yaml"
    with pytest.raises(UserInputError) as err:
        config_changes(RMConfig(model="m"), saved)
    assert str(err.value) == f"{tmp_path}: the run folder has no config.yaml -> is this a run folder?"
    write_config(RMConfig(model="m", output_dir="a", seed=3, save_every=5), saved)
    # where the run is written, how often it saves, resume's own flags: never a change
    same = RMConfig(model="m", output_dir="b", seed=3, save_every=7, keep_last_n=9, overwrite=True, resume="latest",
                    allow_config_change=True, progress=not RMConfig().progress)
    assert config_changes(same, saved) == {}
    assert config_changes(RMConfig(model="n", seed=4), saved) == {"model": {"was": "m", "now": "n"},
                                                                 "seed": {"was": 3, "now": 4}}
    saved.write_text("")  # an empty config.yaml: every setting away from its default is a change
    assert config_changes(RMConfig(model="m", seed=RMConfig().seed + 1), saved) == {
        "model": {"was": None, "now": "m"}, "seed": {"was": None, "now": RMConfig().seed + 1}}
    saved.write_text("- a\n- list\n")
    with pytest.raises(UserInputError) as err:
        config_changes(RMConfig(), saved)
    assert str(err.value) == (f"{saved}: config.yaml holds a list, not a mapping of settings -> restore the run's "
                              "config.yaml, or start the run again with --overwrite")
    saved.write_text("seed: [1\n")
    with pytest.raises(UserInputError, match=r"(?s): unreadable config.yaml \(.+\) -> restore the run's config.yaml, "
                                             r"or start the run again with --overwrite$"):
        config_changes(RMConfig(), saved)
    assert yaml.safe_load("") is None


def test_what_the_run_reads_is_checked_against_its_fingerprints(tmp_path, caplog):
    from rlhflab.checkpoint import fingerprints as prints
    from rlhflab.checkpoint.resume import input_changes
    from rlhflab.config import RMConfig

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = RMConfig(model=str(model))
    with caplog.at_level(logging.INFO, logger="rlhflab"):
        assert input_changes(cfg, tmp_path) == ({}, prints.fingerprints(cfg))
    assert caplog.messages == [f"{tmp_path} has no {prints.FILE} (started by an older rlhflab): its inputs are not "
                               "checked"]
    (tmp_path / prints.FILE).write_text(json.dumps(prints.fingerprints(cfg)))
    assert input_changes(cfg, tmp_path) == ({}, prints.fingerprints(cfg))
    (model / "config.json").write_text('{"changed": 1}')
    changes, now = input_changes(cfg, tmp_path)
    assert now == prints.fingerprints(cfg) and list(changes) and all(k.startswith("model") for k in changes)
    (tmp_path / prints.FILE).write_text("{not json")
    with pytest.raises(UserInputError) as err:
        input_changes(cfg, tmp_path)
    assert str(err.value).startswith(f"{tmp_path / prints.FILE}: unreadable {prints.FILE} (")
    assert str(err.value).endswith(") -> restore it, or delete it to resume without checking the inputs")


def test_overwrite_refuses_a_run_that_reads_from_the_folder_it_replaces_but_not_from_its_inputs(tmp_path):
    from rlhflab.checkpoint.resume import check_reads_outside
    from rlhflab.config import RMConfig

    run = tmp_path / "run"
    check_reads_outside(RMConfig(model=str(tmp_path / "model"), output_dir=str(run)), run)
    check_reads_outside(RMConfig(model=str(run / "inputs" / "model"), output_dir=str(run)), run)
    with pytest.raises(UserInputError) as err:
        check_reads_outside(RMConfig(model=str(run / "model"), output_dir=str(run)), run)
    assert str(err.value) == (
        f"--output_dir: --overwrite would replace {run}, which holds what this run reads (model {run / 'model'}); "
        "the old run is deleted once the new one checkpoints -> write the new run to another --output_dir, or copy "
        "what it reads out of the old run first")


# --- histories ------------------------------------------------------------------------------------


def test_histories_are_cut_back_to_the_checkpoint_and_a_crash_shortened_one_counts_its_lost_rows(tmp_path, caplog):
    from rlhflab.checkpoint.resume import check_histories, history_position, restore_histories

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"a": 1}\n{"a": 2}\n')
    at = history_position(tmp_path)
    assert at == {"metrics.jsonl": {"bytes": 18, "lines": 2}, "samples.jsonl": {"bytes": 0, "lines": 0}}
    metrics.write_text('{"a": 1}\n{"a": 2}\n{"a": 3}\n')  # written after the checkpoint
    (tmp_path / "samples.jsonl").write_text('{"s": 1}\n')
    assert check_histories(tmp_path, at) == {}
    assert restore_histories(tmp_path, at) == {}
    assert metrics.read_text() == '{"a": 1}\n{"a": 2}\n' and (tmp_path / "samples.jsonl").read_text() == ""
    metrics.write_text('{"a": 1}\n{"a"')  # a host crash took a row and a half
    assert check_histories(tmp_path, at) == {"metrics.jsonl": 1}
    with caplog.at_level(logging.WARNING, logger="rlhflab"):
        assert restore_histories(tmp_path, at) == {"metrics.jsonl": 1}
    assert metrics.read_text() == '{"a": 1}\n'
    assert caplog.messages == [f"{metrics} has 1 of the 2 rows it held at the checkpoint (a crash lost the rest): "
                               "continuing from the checkpoint without the 1 lost row(s)"]
    metrics.unlink()  # gone altogether: every row lost, nothing to cut
    assert check_histories(tmp_path, at) == {"metrics.jsonl": 2}
    assert restore_histories(tmp_path, at)["metrics.jsonl"] == 2
    assert not metrics.exists()
    metrics.write_text('{"a": 1, "b": 9}\n{"a": 2}\n')  # not the file the checkpoint saw the start of
    with pytest.raises(UserInputError) as err:
        check_histories(tmp_path, at)
    assert str(err.value) == f"{metrics}: metrics.jsonl does not match the checkpoint's history"
    metrics.write_text('{"a": 1}\n{"a": 2}X')  # as long, but its second row is not the checkpoint's
    with pytest.raises(UserInputError):
        restore_histories(tmp_path, at)


# --- the Checkpointer -----------------------------------------------------------------------------------


def packer(calls, value=1.0, state=None):
    def contents():
        calls.append(value)
        return {"w": torch.full((2,), value)}, {"n": len(calls), **(state or {})}
    return contents


def test_saves_when_due_or_asked_by_a_signal_and_at_the_end_unless_just_saved(tmp_path, monkeypatch):
    from rlhflab.checkpoint import resume
    from rlhflab.checkpoint.folder import complete_checkpoints, load_checkpoint
    from rlhflab.errors import Interrupted

    dropped = []
    monkeypatch.setattr(resume, "drop_replaced", lambda path: dropped.append(path))
    (tmp_path / "metrics.jsonl").write_text('{"a": 1}\n')
    calls = []
    with resume.Checkpointer(tmp_path, save_every=2, keep_last_n=0) as saver:
        saver.step_done(1, packer(calls))
        assert calls == [] and not (tmp_path / "checkpoints").exists()  # packed only when written
        saver.step_done(2, packer(calls))
        assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == ["step-2"] and calls == [1.0]
        assert dropped == [tmp_path] and saver.saved_step == 2
        step, weights, state = load_checkpoint(tmp_path / "checkpoints" / "step-2")
        assert step == 2 and weights["w"].tolist() == [1.0, 1.0]
        assert state == {"n": 1, "histories": {"metrics.jsonl": {"bytes": 9, "lines": 1},
                                               "samples.jsonl": {"bytes": 0, "lines": 0}},
                         "parallel": {"strategy": "none", "world_size": 1, "sharded_state": False}}
        saver.finish(2, packer(calls))  # the end at the step just saved: nothing more
        assert calls == [1.0]
        saver.signals.requested = signal.SIGTERM
        with pytest.raises(Interrupted) as stopped:
            saver.step_done(3, packer(calls))
    assert (stopped.value.signum, stopped.value.step) == (signal.SIGTERM, 3)
    assert stopped.value.checkpoint == tmp_path / "checkpoints" / "step-3"
    assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == ["step-2", "step-3"]
    assert dropped == [tmp_path]  # a signal's save keeps a replaced run (a Ctrl-C after a mistaken --overwrite)
    resume.Checkpointer(tmp_path, save_every=2, keep_last_n=0, saved_step=3).finish(4, packer(calls))
    assert (tmp_path / "checkpoints" / "step-4").is_dir() and dropped == [tmp_path] * 2
    resume.Checkpointer(tmp_path, save_every=0, keep_last_n=0).finish(5, packer(calls))
    assert (tmp_path / "checkpoints" / "step-5").is_dir()
    resume.Checkpointer(tmp_path, save_every=0, keep_last_n=0).step_done(6, packer(calls))  # 0: at the end only
    resume.Checkpointer(tmp_path, save_every=-1, keep_last_n=0).finish(7, packer(calls))  # < 0: never but asked
    assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == ["step-2", "step-3", "step-4", "step-5"]
    resume.Checkpointer(tmp_path, save_every=2, keep_last_n=1).step_done(8, packer(calls))
    assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == ["step-8"]


def test_non_finite_weights_are_never_checkpointed(tmp_path):
    from rlhflab.checkpoint.resume import Checkpointer

    with pytest.raises(FloatingPointError, match=r"^step 4: non-finite weights; no checkpoint written$"):
        Checkpointer(tmp_path, save_every=1, keep_last_n=0).step_done(4, packer([], float("nan")))
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_a_sharded_layout_has_every_rank_write_its_shards_into_the_checkpoint(tmp_path):
    from rlhflab.checkpoint.folder import load_checkpoint
    from rlhflab.checkpoint.resume import Checkpointer

    fsdp2 = parallel.Layout("fsdp2", parallel.World(0, 1))
    with pytest.raises(ValueError, match=r"^a sharded layout needs write_shards \(every rank's part of the state\)$"):
        Checkpointer(tmp_path, 1, 0, layout=fsdp2)
    written = []

    def write_shards(folder):
        folder.mkdir()
        (folder / "rank0.bin").write_bytes(b"shard")
        written.append(folder)

    saver = Checkpointer(tmp_path, 1, 0, layout=fsdp2, write_shards=write_shards)
    path = saver.save(2, packer([]))
    assert path == tmp_path / "checkpoints" / "step-2"
    assert written == [tmp_path / "checkpoints" / ".tmp-step-2" / "sharded"]
    assert (path / "sharded" / "rank0.bin").read_bytes() == b"shard"
    assert load_checkpoint(path)[2]["parallel"] == {"strategy": "fsdp2", "world_size": 1, "sharded_state": True}


def test_a_failed_checkpoint_write_names_it_and_the_space_it_needed_and_leaves_no_partial_folder(tmp_path,
                                                                                                monkeypatch):
    import errno

    from rlhflab.checkpoint import resume
    from rlhflab.checkpoint.folder import complete_checkpoints
    from rlhflab.errors import WriteFailed

    saver = resume.Checkpointer(tmp_path, 1, 0)
    saver.save(1, packer([]))

    def full(root, step, tmp, weights, state, keep):
        (tmp / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(resume, "finish_checkpoint", full)
    with pytest.raises(WriteFailed) as err:
        saver.save(2, packer([], state={"moments": torch.ones(3, dtype=torch.float64)}))
    failed = err.value
    assert (failed.what, failed.path, failed.run) == ("checkpoint step-2", tmp_path / "checkpoints" / "step-2",
                                                      tmp_path)
    assert failed.needed == 2 * 4 + 3 * 8 and "No space left" in failed.reason
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-1"] and saver.saved_step == 1
    assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == ["step-1"]
    monkeypatch.setattr(resume, "finish_checkpoint", lambda *args: (_ for _ in ()).throw(KeyError("not a write")))
    with pytest.raises(KeyError):
        saver.save(3, packer([]))
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-1"]


# --- open_run: a fresh run, then a resume and its commit ---------------------------------------------------


def test_a_resume_checks_first_and_changes_the_folder_only_when_committed(tmp_path, caplog):
    """A fresh run logs 3 rows and checkpoints at 2 and 3; resumed from step 2 with another seed (allowed): nothing
    changes until commit, which cuts metrics.jsonl back to step 2's 2 rows, drops step-3, rewrites config.yaml
    and records the resume in summary.json; a second resume appends to the record."""
    import yaml

    from rlhflab.checkpoint import fingerprints as prints
    from rlhflab.checkpoint.folder import complete_checkpoints
    from rlhflab.checkpoint.ownership import releasing_locks
    from rlhflab.checkpoint.resume import Checkpointer, open_run
    from rlhflab.config import RMConfig

    out = tmp_path / "run"
    with releasing_locks():
        run, resumed = open_run(RMConfig(output_dir=str(out), seed=1), "rm")
        assert resumed is None and run.path == out
        assert yaml.safe_load((out / "config.yaml").read_text())["seed"] == 1
        assert json.loads((out / prints.FILE).read_text()) == prints.fingerprints(RMConfig(output_dir=str(out), seed=1))
        assert (out / "versions.json").exists()
        saver = Checkpointer(out, save_every=1, keep_last_n=0)
        for step in (1, 2, 3):
            run.log({"loss": float(step)}, step=step)
            if step > 1:
                saver.save(step, packer([], float(step)))
        run.update_summary(updates=3)
        run.close()
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}

    step2 = out / "checkpoints" / "step-2"
    with pytest.raises(UserInputError) as err:
        open_run(RMConfig(output_dir=str(out), seed=2, resume=str(step2)), "rm")
    assert str(err.value) == (f"--resume {step2}: the config differs from the run's config.yaml (seed: 1 -> 2) -> "
                              "resume with the run's own settings and inputs, or pass --allow_config_change to proceed "
                              "(the differences are recorded in summary.json)")
    cfg = RMConfig(output_dir=str(out), seed=2, resume=str(step2), allow_config_change=True)
    with releasing_locks(), caplog.at_level(logging.INFO, logger="rlhflab"):
        run, resumed = open_run(cfg, "rm")
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"} == before
        assert (resumed.checkpoint, resumed.step, resumed.config_changes) == (step2, 2, {"seed": {"was": 1, "now": 2}})
        assert resumed.weights["w"].tolist() == [2.0, 2.0] and resumed.state["n"] == 1
        resumed.commit()
        run.close()
    assert [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1.0, 2.0]
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == ["step-2"]
    assert yaml.safe_load((out / "config.yaml").read_text())["seed"] == 2
    record = {"step": 2, "checkpoint": str(step2), "config_changes": {"seed": {"was": 1, "now": 2}},
              "input_changes": {}}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumes"] == [record] and summary["updates"] == 3
    assert f"removing {out / 'checkpoints' / 'step-3'}: resuming from step 2 abandons it" in caplog.messages
    assert f"resuming rm from {step2} (step 2)" in caplog.messages

    (out / "metrics.jsonl").write_text('{"loss": 1.0}\n')  # a crash lost step 2's row
    with releasing_locks():
        run, resumed = open_run(RMConfig(output_dir=str(out), seed=2, resume="latest"), "rm")
        assert resumed.config_changes == {}
        resumed.commit()
        run.close()
    again = {"step": 2, "checkpoint": str(step2), "config_changes": {}, "input_changes": {},
             "lost_history_rows": {"metrics.jsonl": 1}}
    assert json.loads((out / "summary.json").read_text())["resumes"] == [record, again]


def test_a_failed_open_releases_the_lock_and_a_fresh_run_clears_an_old_folders_leftovers(tmp_path):
    from rlhflab.checkpoint import ownership
    from rlhflab.checkpoint.ownership import releasing_locks
    from rlhflab.checkpoint.resume import open_run
    from rlhflab.config import RMConfig

    out = tmp_path / "run"
    with pytest.raises(UserInputError, match="no config.yaml"):
        out.joinpath("checkpoints").mkdir(parents=True)
        from rlhflab.checkpoint.folder import save_checkpoint

        save_checkpoint(out / "checkpoints", 1, {"w": torch.ones(1)}, {"histories": {}})
        open_run(RMConfig(output_dir=str(out), resume="latest"), "rm")
    assert not (out / ownership.LOCK).exists() and ownership._key(out) not in ownership._held
    with pytest.raises(UserInputError, match="report_to"):
        open_run(RMConfig(output_dir=str(tmp_path / "typo"), report_to="tensorbored"), "rm")
    assert not (tmp_path / "typo").exists()  # refused before anything is made or locked
    with releasing_locks():
        run, _ = open_run(RMConfig(output_dir=str(tmp_path / "fresh")), "rm")
        assert (tmp_path / "fresh" / ownership.LOCK).exists()
        run.close()


def test_overwrite_names_every_path_the_new_run_reads_inside_the_old_one(tmp_path):
    from rlhflab.checkpoint.resume import check_reads_outside
    from rlhflab.config import RMConfig

    run = tmp_path / "run"
    with pytest.raises(UserInputError, match=rf"reads \(model {run / 'model'}, tokenizer {run / 'tok'}\); the old"):
        check_reads_outside(RMConfig(model=str(run / "model"), tokenizer=str(run / "tok"), output_dir=str(run)), run)


def test_a_failure_after_the_checkpoint_completed_keeps_it_and_a_failure_before_packing_needs_no_size(tmp_path,
                                                                                                     monkeypatch):
    import errno

    from rlhflab.checkpoint import resume
    from rlhflab.checkpoint.folder import complete_checkpoints, finish_checkpoint
    from rlhflab.errors import WriteFailed

    def completed_then_full(*args):
        finish_checkpoint(*args)
        raise OSError(errno.ENOSPC, "No space left on device")  # e.g. while pruning older ones

    monkeypatch.setattr(resume, "finish_checkpoint", completed_then_full)
    with pytest.raises(WriteFailed):
        resume.Checkpointer(tmp_path, 1, 0).save(2, packer([]))
    assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == ["step-2"]

    def unpackable():
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(WriteFailed) as err:
        resume.Checkpointer(tmp_path, 1, 0).save(3, unpackable)
    assert err.value.needed is None and err.value.what == "checkpoint step-3"


def test_a_partial_folder_that_cannot_be_removed_does_not_hide_the_write_failure(tmp_path, monkeypatch):
    import errno
    import shutil

    from rlhflab.checkpoint import resume
    from rlhflab.errors import WriteFailed

    def full(root, step, tmp, *rest):
        raise OSError(errno.ENOSPC, "No space left on device")

    def stuck(path, ignore_errors=False):
        if not ignore_errors:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(resume, "finish_checkpoint", full)
    monkeypatch.setattr(shutil, "rmtree", stuck)
    with pytest.raises(WriteFailed, match="No space left"):
        resume.Checkpointer(tmp_path, 1, 0).save(2, packer([]))


def test_the_multi_process_tests_failure_hook_fires_after_its_step_on_its_rank(tmp_path, monkeypatch):
    from rlhflab.checkpoint.resume import Checkpointer

    monkeypatch.setenv("RLHFLAB_FAIL_AT", "0:2")
    saver = Checkpointer(tmp_path, save_every=0, keep_last_n=0)
    saver.step_done(1, packer([]))
    with pytest.raises(RuntimeError, match=r"^deliberate failure on rank 0 after step 2 "):
        saver.step_done(2, packer([]))
    Checkpointer(tmp_path, 0, 0, layout=parallel.Layout("none", parallel.World(1, 1))).step_done(2, packer([]))


def test_a_deleted_history_of_one_short_row_lost_that_row():
    import tempfile
    from pathlib import Path

    from rlhflab.checkpoint.resume import check_histories

    with tempfile.TemporaryDirectory() as folder:
        assert check_histories(Path(folder), {"metrics.jsonl": {"bytes": 3, "lines": 1}}) == {"metrics.jsonl": 1}


def test_a_missing_history_leaves_the_others_cut_and_a_shortened_one_keeps_every_complete_row(tmp_path):
    from rlhflab.checkpoint.resume import restore_histories

    at = {"metrics.jsonl": {"bytes": 9, "lines": 1}, "samples.jsonl": {"bytes": 9, "lines": 1}}
    (tmp_path / "samples.jsonl").write_text('{"s": 1}\n{"s": 2}\n')
    assert restore_histories(tmp_path, at) == {"metrics.jsonl": 1}
    assert (tmp_path / "samples.jsonl").read_text() == '{"s": 1}\n'
    (tmp_path / "metrics.jsonl").write_text('{"a": 1}\n{"a": 2}\n{"a"')  # 2 of 3 rows and half the third
    assert restore_histories(tmp_path, {"metrics.jsonl": {"bytes": 27, "lines": 3}}) == {"metrics.jsonl": 1}
    assert (tmp_path / "metrics.jsonl").read_text() == '{"a": 1}\n{"a": 2}\n'


# --- open_run: --overwrite, sinks and callbacks, what a refusal and a commit say, several ranks -------------


def test_an_unreadable_config_yaml_is_refused_naming_the_file(tmp_path):
    from rlhflab.checkpoint.resume import config_changes
    from rlhflab.config import RMConfig

    (tmp_path / "config.yaml").write_text("seed: [1\n")
    with pytest.raises(UserInputError) as err:
        config_changes(RMConfig(), tmp_path / "config.yaml")
    assert str(err.value).startswith(f"{tmp_path / 'config.yaml'}: unreadable config.yaml (")


def test_a_setting_newer_than_the_runs_config_yaml_is_a_change_only_away_from_its_default(tmp_path):
    from dataclasses import dataclass, field

    from rlhflab.checkpoint.resume import config_changes

    @dataclass(frozen=True)
    class Config:  # a required field and a default_factory one beside a plain default
        model: str
        stops: list = field(default_factory=list)
        seed: int = 0

    (tmp_path / "config.yaml").write_text("model: m\n")  # written before stops and seed existed
    assert config_changes(Config("m"), tmp_path / "config.yaml") == {}
    assert config_changes(Config("m", ["\n"], 1), tmp_path / "config.yaml") == {
        "seed": {"was": None, "now": 1}, "stops": {"was": None, "now": ["\n"]}}


def test_overwrite_refuses_a_run_reading_the_old_one_and_carries_over_the_inputs_the_new_one_reads(tmp_path):
    from rlhflab.checkpoint.ownership import releasing_locks
    from rlhflab.checkpoint.resume import open_run
    from rlhflab.config import RMConfig

    out = tmp_path / "run"
    (out / "inputs").mkdir(parents=True)
    (out / "config.yaml").write_text("seed: 1\n")  # a run is there
    (out / "inputs" / "train.jsonl").write_text('{"a": 1}\n')
    with pytest.raises(UserInputError) as err:
        open_run(RMConfig(model=str(out / "model"), output_dir=str(out), overwrite=True), "rm")
    assert str(err.value).startswith(f"--output_dir: --overwrite would replace {out}, which holds what this run "
                                     f"reads (model {out / 'model'}); ")
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # nothing set aside
    with releasing_locks():
        run, _ = open_run(RMConfig(train_file=str(out / "inputs" / "train.jsonl"), output_dir=str(out),
                                   overwrite=True), "rm")
        aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
        assert len(aside) == 1 and (aside[0] / "config.yaml").read_text() == "seed: 1\n"
        assert (out / "inputs" / "train.jsonl").read_text() == '{"a": 1}\n'  # read by the new run: carried over
        run.close()


def test_a_fresh_run_clears_leftover_checkpoints_and_report_and_opens_its_backends_callbacks_and_seed(
        tmp_path, monkeypatch):
    from pathlib import Path

    from rlhflab.checkpoint.ownership import releasing_locks
    from rlhflab.checkpoint.resume import open_run
    from rlhflab.config import RMConfig

    monkeypatch.chdir(tmp_path)
    opened = recorder_backend(monkeypatch)
    out = tmp_path / "run"
    (out / "checkpoints" / "step-1").mkdir(parents=True)  # a folder that never held a whole run
    (out / "report.html").write_text("old")
    callback = Rows()
    with releasing_locks():
        run, _ = open_run(RMConfig(output_dir=str(out), seed=7, report_to="recorder"), "rm", callbacks=[callback])
        run.log({"loss": 0.5}, step=1)
        run.close()
    assert not (out / "checkpoints").exists() and not (out / "report.html").exists()
    assert json.loads((out / "versions.json").read_text())["determinism"]["seed"] == 7
    assert [b.rows for b in opened] == [[("opened", out), (1, {"loss": 0.5})]] and callback.rows == [(1, {"loss": 0.5})]
    with releasing_locks():
        run, _ = open_run(RMConfig(), "rm")  # no --output_dir: runs/rm-<time>
        assert run.path.parent == Path("runs") and run.path.name.startswith("rm-")
        run.close()


def test_a_refused_resume_lists_every_config_change_and_every_input_gone_or_added(tmp_path):
    from rlhflab.checkpoint import fingerprints as prints
    from rlhflab.checkpoint.ownership import releasing_locks
    from rlhflab.checkpoint.resume import open_run
    from rlhflab.config import RMConfig

    model, out = tmp_path / "model", tmp_path / "run"
    model.mkdir()
    (model / "a.txt").write_text("a")
    with releasing_locks():
        open_run(RMConfig(model=str(model), output_dir=str(out), seed=1), "rm")[0].close()
    a = prints.file_digest(model / "a.txt")
    (model / "a.txt").unlink()
    (model / "b.txt").write_text("bb")
    b = prints.file_digest(model / "b.txt")
    step2 = out / "checkpoints" / "step-2"
    with pytest.raises(UserInputError) as err:
        open_run(RMConfig(model=str(model), seed=2, learning_rate=0.5, resume=str(step2)), "rm")
    assert str(err.value) == (
        f"--resume {step2}: the config differs from the run's config.yaml (learning_rate: 0.0003 -> 0.5; seed: 1 -> 2) "
        f"and what the run reads changed since it started (model/a.txt: {a} -> none; model/b.txt: none -> {b}) -> "
        "resume with the run's own settings and inputs, or pass --allow_config_change to proceed (the differences "
        "are recorded in summary.json)")


def test_a_committed_resume_locks_the_run_logs_its_changes_and_starts_the_summary_it_lacked(tmp_path, monkeypatch,
                                                                                            caplog):
    from rlhflab.checkpoint import fingerprints as prints
    from rlhflab.checkpoint import ownership
    from rlhflab.checkpoint.resume import Checkpointer, open_run
    from rlhflab.config import RMConfig

    monkeypatch.chdir(tmp_path)
    opened, model, out = recorder_backend(monkeypatch), tmp_path / "model", tmp_path / "run"
    model.mkdir()
    (model / "a.txt").write_text("a")
    with ownership.releasing_locks():
        run, _ = open_run(RMConfig(model=str(model), output_dir=str(out), seed=1, report_to="recorder"), "rm")
        Checkpointer(out, 1, 0).save(2, packer([]))
        run.close()
    assert not (out / "summary.json").exists()
    inputs = {"model/a.txt": {"was": prints.file_digest(model / "a.txt"), "now": None}}
    (model / "a.txt").write_text("A")
    inputs["model/a.txt"]["now"] = prints.file_digest(model / "a.txt")
    callback, step2 = Rows(), out / "checkpoints" / "step-2"
    cfg = RMConfig(model=str(model), seed=2, resume=str(step2), allow_config_change=True, report_to="recorder")
    with ownership.releasing_locks(), caplog.at_level(logging.WARNING, logger="rlhflab"):
        run, resumed = open_run(cfg, "rm", callbacks=[callback])
        assert ownership._key(out) in ownership._held and not (tmp_path / "runs").exists()  # the run's own lock
        resumed.commit()
        run.log({"loss": 0.5}, step=3)
        run.close()
    assert caplog.messages == ["resuming with config changes: {'seed': {'was': 1, 'now': 2}}",
                               f"resuming with changed inputs: {inputs}"]
    assert json.loads((out / "versions.json").read_text())["determinism"]["seed"] == 2
    assert json.loads((out / "summary.json").read_text()) == {"resumes": [
        {"step": 2, "checkpoint": str(step2), "config_changes": {"seed": {"was": 1, "now": 2}}, "input_changes": inputs}]}
    assert [b.rows for b in opened] == [[("opened", out)], [("opened", out), (3, {"loss": 0.5})]]
    assert callback.rows == [(3, {"loss": 0.5})]
