"""Who writes a run folder: `--overwrite` keeps the old run until the new one has a checkpoint, and the folder's
lock refuses a second live writer and takes over one left by a dead process (rlhflab/checkpoint/ownership.py)."""

import json
import logging
import os
import subprocess
import sys

import pytest
from runcheck import sft_args, train

from rlhflab.api import run_stage
from rlhflab.checkpoint import Checkpointer
from rlhflab.cli import main
from rlhflab.config import SFTConfig, parse_config
from rlhflab.errors import UserInputError


def asides(tmp_path) -> list:
    return sorted(p.name for p in tmp_path.glob("run.replaced-*"))


def test_overwrite_keeps_the_old_run_until_the_new_one_checkpoints(tmp_path, monkeypatch, caplog):
    out = tmp_path / "run"
    train(sft_args(out))  # a finished run (checkpoints at 3, 6, ... 15 and 16)
    finished = (out / "summary.json").read_bytes()
    real = Checkpointer.step_done

    def fail_at_step_2(self, step, contents):
        if step == 2:
            raise RuntimeError("a failure before the first checkpoint")
        real(self, step, contents)

    monkeypatch.setattr(Checkpointer, "step_done", fail_at_step_2)
    args = [*sft_args(out), "--overwrite", "true", "--seed", "4"]
    with caplog.at_level(logging.WARNING, logger="rlhflab"), pytest.raises(RuntimeError, match="before the first"):
        run_stage("sft", parse_config(SFTConfig, args[1:], prog="rlhflab sft"))
    [kept] = asides(tmp_path)
    assert (tmp_path / kept / "summary.json").read_bytes() == finished  # the old run, whole, beside the new one
    assert len(list((tmp_path / kept / "checkpoints").glob("step-*"))) == 2
    assert f"kept at {tmp_path / kept}" in caplog.text and f"mv {tmp_path / kept} {out}" in caplog.text
    assert not (out / "summary.json").exists() and not (out / ".lock").exists()

    seen = {}

    def watch(self, step, contents):
        before = asides(tmp_path)
        real(self, step, contents)
        seen[step] = (before, asides(tmp_path))

    monkeypatch.setattr(Checkpointer, "step_done", watch)
    train(args)  # again: the failed attempt is set aside too, and both go with this run's first checkpoint
    assert len(seen[2][1]) == 2 and seen[3] == (seen[2][1], [])
    assert asides(tmp_path) == [] and not (out / ".replacing.json").exists() and not (out / ".lock").exists()
    assert (out / "summary.json").read_bytes() != finished


HOLD = ("import sys; from pathlib import Path; from rlhflab.checkpoint.ownership import lock_run; "
        "lock_run(Path(sys.argv[1])); print('locked', flush=True); sys.stdin.read()")


def test_a_second_live_writer_is_refused_and_a_dead_ones_lock_taken_over(tmp_path, capsys, caplog):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        assert main(sft_args(out)) == 2
        err = capsys.readouterr().err
        assert f"another run is writing this folder: process {holder.pid}" in err
        assert sorted(p.name for p in out.iterdir()) == [".lock"]  # refused before anything was written
    finally:
        holder.stdin.close()  # it ends without releasing: its pid stays in the file, the kernel drops the flock
        holder.wait(timeout=60)
    assert json.loads((out / ".lock").read_text())["pid"] == holder.pid
    with caplog.at_level(logging.WARNING, logger="rlhflab"):
        train(sft_args(out))
    assert f"taking over the lock left by process {holder.pid}" in caplog.text
    assert (out / "summary.json").exists() and not (out / ".lock").exists()  # released at the end


def test_without_flock_the_recorded_pid_decides(tmp_path, monkeypatch):
    from rlhflab.checkpoint import ownership
    from rlhflab.errors import UserInputError

    monkeypatch.setattr(ownership, "_flock", lambda fd: None)  # a file system without flock (some network mounts)
    out = tmp_path / "run"
    out.mkdir()
    record = {"host": ownership.socket.gethostname(), "started": 0}
    (out / ".lock").write_text(json.dumps({**record, "pid": os.getppid()}))  # alive, and not this process
    with pytest.raises(UserInputError, match=f"process {os.getppid()} "):
        ownership.lock_run(out)
    ended = subprocess.Popen(["true"])
    ended.wait()  # reaped: its pid names no process now
    (out / ".lock").write_text(json.dumps({**record, "pid": ended.pid}))
    ownership.lock_run(out)  # taken over
    assert json.loads((out / ".lock").read_text())["pid"] == os.getpid()
    ownership.release_run(out)
    assert not (out / ".lock").exists()


def test_overwrite_is_refused_when_the_new_run_reads_from_the_run_it_would_replace(tmp_path):
    """`--model RUN/model --output_dir RUN --overwrite`: the model would go aside with the old run and be deleted at
    the new run's first checkpoint (a resume could then not load it). Refused before anything moves."""
    out = tmp_path / "run"
    train(sft_args(out))
    finished = sorted(p.relative_to(out) for p in out.rglob("*"))
    args = [*sft_args(out), "--overwrite", "true", "--model", str(out / "model")]
    with pytest.raises(UserInputError, match=rf"would replace {out}, which holds what this run reads \(model "):
        run_stage("sft", parse_config(SFTConfig, args[1:], prog="rlhflab sft"))
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == finished and asides(tmp_path) == []
    assert not (out / ".lock").exists()
