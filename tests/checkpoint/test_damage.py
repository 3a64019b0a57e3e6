"""A checkpoint damaged on disk after it was written (one bit flipped, the size unchanged) is refused on resume,
naming the file and the checkpoint before it; a process SIGKILLed in the middle of its own save leaves nothing that
`--resume latest` would pick, and the next save removes what it left (issue 34's reliability plan: bit flip, kill
during a save)."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from runcheck import metrics, sft_args, train
from safetensors.torch import load_file

from rlhflab.checkpoint import MARKER, complete_checkpoints, latest_checkpoint, load_checkpoint, save_checkpoint
from rlhflab.cli import main
from rlhflab.errors import UserInputError


def flip_one_bit(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["model.safetensors", "state.safetensors", "state.json"])
def test_one_flipped_bit_is_refused_naming_the_file_and_the_checkpoint_before(tmp_path, name):
    weights = {"w": torch.arange(12.0).reshape(3, 4)}
    state = {"step": 2, "exp_avg": torch.ones(5)}  # a tensor: state.safetensors holds data past its header
    save_checkpoint(tmp_path, 1, weights, state)
    path = save_checkpoint(tmp_path, 2, weights, state)
    file = path / name
    size = file.stat().st_size
    flip_one_bit(file, size - 3)  # in the last tensor's bytes (or the JSON's closing characters)
    assert file.stat().st_size == size  # the size check alone would pass it
    if name == "model.safetensors":  # and the file still parses, with another number in it: only the checksum tells
        assert not torch.equal(load_file(str(file))["w"], weights["w"])
    with pytest.raises(UserInputError) as err:
        load_checkpoint(path)
    assert f"{file}: checkpoint file is corrupt (sha256 differs from its marker)" in str(err.value)
    assert f"resume from an earlier checkpoint: --resume {tmp_path / 'step-1'}" in str(err.value)


def test_a_flipped_bit_in_the_latest_checkpoint_stops_resume_latest_before_anything_changes(tmp_path, capsys):
    out = tmp_path / "run"
    train(sft_args(out))
    latest = complete_checkpoints(out / "checkpoints")[-1]
    weights = latest / "model.safetensors"
    flip_one_bit(weights, weights.stat().st_size // 2)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert main([*sft_args(out), "--resume", "latest"]) == 2
    err = capsys.readouterr().err
    assert f"{weights}: checkpoint file is corrupt (sha256 differs from its marker)" in err
    earlier = complete_checkpoints(out / "checkpoints")[-2]
    assert f"--resume {earlier}" in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # nothing trimmed or rewritten
    # the named earlier checkpoint resumes, and the run ends as it had
    reference = metrics(out)
    train([*sft_args(out), "--resume", str(earlier)])
    assert metrics(out) == reference


# A process that saves step-1 whole, then SIGKILLs itself in the middle of saving step-2: while its files are
# written (`.tmp-step-2` left), or after the rename, before the marker (`step-2` without COMPLETE).
KILLED_IN_A_SAVE = """
import os, signal, sys
import torch
import rlhflab.checkpoint.folder as folder

root, point = sys.argv[1], sys.argv[2]
folder.save_checkpoint(folder.Path(root), 1, {"w": torch.ones(3)}, {"step": 1})
real_save, real_fsync = folder.save_file, folder._fsync_file

def save_file(tensors, filename, *args, **kwargs):
    if point == "files" and filename.endswith("state.safetensors"):  # model.safetensors is on disk already
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(tensors, filename, *args, **kwargs)

def fsync_file(path):
    if point == "marker" and path.name == folder.MARKER + ".tmp":  # renamed to step-2, marker not in place
        os.kill(os.getpid(), signal.SIGKILL)
    return real_fsync(path)

folder.save_file, folder._fsync_file = save_file, fsync_file
folder.save_checkpoint(folder.Path(root), 2, {"w": torch.full((3,), 2.0)}, {"step": 2})
"""


@pytest.mark.parametrize("point,left", [("files", ".tmp-step-2"), ("marker", "step-2")])
def test_a_sigkill_in_the_middle_of_a_save_leaves_the_checkpoint_before_as_latest(tmp_path, point, left):
    root = tmp_path / "checkpoints"
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(KILLED_IN_A_SAVE), str(root), point],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr[-2000:]
    assert sorted(p.name for p in root.iterdir()) == sorted([left, "step-1"])  # the half-written one is still there
    assert not (root / left / MARKER).exists()
    assert latest_checkpoint(root) == root / "step-1" and complete_checkpoints(root) == [root / "step-1"]
    step, weights, state = load_checkpoint(root / "step-1")
    assert step == 1 and torch.equal(weights["w"], torch.ones(3)) and state == {"step": 1}
    if point == "marker":  # asked for by name, it is refused: it was never finished
        with pytest.raises(UserInputError, match="no COMPLETE marker: it was never finished"):
            load_checkpoint(root / "step-2")
    save_checkpoint(root, 2, {"w": torch.full((3,), 3.0)}, {"step": 2})  # the resumed run's next save
    assert sorted(p.name for p in root.iterdir()) == ["step-1", "step-2"]
    assert json.loads((root / "step-2" / MARKER).read_text())["step"] == 2
    assert torch.equal(load_checkpoint(root / "step-2")[1]["w"], torch.full((3,), 3.0))
