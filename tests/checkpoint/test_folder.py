"""Checkpoint folders: atomic write, marker, latest / pruning, exact state round trip, refusal of bad files."""

import os
import pickle
import random

import numpy as np
import pytest
import torch
from transformers import get_scheduler

from rlhflab.checkpoint import (
    MARKER,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    restore_rng,
    rng_state,
    save_checkpoint,
)
from rlhflab.checkpoint import folder as folder_mod
from rlhflab.checkpoint.state import decode, encode
from rlhflab.errors import UserInputError


def weights(value: float = 1.0) -> dict[str, torch.Tensor]:
    return {"model.w": torch.full((3, 2), value), "model.b": torch.zeros(2)}


def test_save_writes_marker_last_with_sizes_and_checksums(tmp_path):
    path = save_checkpoint(tmp_path, 5, weights(), {"step": 5, "order": [3, 1, 2]})
    assert path == tmp_path / "step-5" and not list(tmp_path.glob(".tmp-*"))
    marker = (path / MARKER).read_text()
    for name in ("model.safetensors", "state.safetensors", "state.json"):
        assert name in marker and str((path / name).stat().st_size) in marker
    step, loaded, state = load_checkpoint(path)
    assert step == 5 and state == {"step": 5, "order": [3, 1, 2]} and torch.equal(loaded["model.w"], weights()["model.w"])


def test_latest_ignores_unfinished_folders_and_the_next_save_removes_them(tmp_path):
    save_checkpoint(tmp_path, 2, weights(), {}, keep_last_n=0)
    (tmp_path / ".tmp-step-4").mkdir()  # killed while writing files
    (tmp_path / "step-3").mkdir()  # killed between the rename and the marker
    (tmp_path / "step-3" / "model.safetensors").write_bytes(b"half")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-2"
    save_checkpoint(tmp_path, 5, weights(), {}, keep_last_n=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-5"]


def test_keep_last_n_prunes_only_once_the_new_checkpoint_is_complete(tmp_path, monkeypatch):
    for step in (1, 2):
        save_checkpoint(tmp_path, step, weights(), {}, keep_last_n=2)
    real_save = folder_mod.save_file

    def dies_on_state(tensors, filename):  # a crash half-way through writing step 3
        if filename.endswith("state.safetensors"):
            raise KeyboardInterrupt
        real_save(tensors, filename)

    monkeypatch.setattr(folder_mod, "save_file", dies_on_state)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 3, weights(), {}, keep_last_n=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-1", "step-2"]
    monkeypatch.setattr(folder_mod, "save_file", real_save)
    save_checkpoint(tmp_path, 3, weights(), {}, keep_last_n=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-3"]


def test_optimizer_scheduler_and_rng_round_trip_bit_for_bit(tmp_path):
    def setup():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
        return model, opt, get_scheduler("cosine", opt, num_warmup_steps=2, num_training_steps=10)

    def steps(model, opt, sched, gen, n):
        for _ in range(n):
            x = torch.randn(5, 4, generator=gen) + torch.randn(5, 4) + random.random() + float(np.random.rand())
            model(x).pow(2).mean().backward()
            opt.step(), sched.step(), opt.zero_grad()

    model, opt, sched = setup()
    gen = torch.Generator().manual_seed(1)
    steps(model, opt, sched, gen, 3)
    state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": rng_state({"g": gen})}
    save_checkpoint(tmp_path, 3, dict(model.named_parameters()), state)
    steps(model, opt, sched, gen, 4)
    expected = [p.detach().clone() for p in model.parameters()]

    model, opt, sched = setup()
    gen = torch.Generator()
    _, loaded, state = load_checkpoint(tmp_path / "step-3")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(loaded[name])
    opt.load_state_dict(state["optimizer"]), sched.load_state_dict(state["scheduler"])
    restore_rng(state["rng"], {"g": gen})
    steps(model, opt, sched, gen, 4)
    for got, want in zip(model.parameters(), expected):
        assert torch.equal(got, want)


def test_state_codec_keeps_types_and_refuses_what_needs_pickle():
    state = {"ints": {0: 1.5, 7: float("inf")}, "pair": (0.9, 0.95), "arr": np.arange(3, dtype=np.uint32),
             "t": torch.tensor(2.0), "nested": [{"x": None, "y": "s"}]}
    tensors: dict = {}
    back = decode(encode(state, tensors), tensors)
    assert back["ints"] == {0: 1.5, 7: float("inf")} and back["pair"] == (0.9, 0.95)
    assert back["arr"].dtype == np.uint32 and back["arr"].tolist() == [0, 1, 2] and back["t"].item() == 2.0
    assert back["nested"] == [{"x": None, "y": "s"}]
    with pytest.raises(TypeError, match="without pickle"):
        encode({"fn": object()}, {})


def test_a_truncated_weights_file_is_an_error_naming_it(tmp_path):
    save_checkpoint(tmp_path, 1, weights(), {})
    path = save_checkpoint(tmp_path, 2, weights(2.0), {})
    file = path / "model.safetensors"
    os.truncate(file, file.stat().st_size - 7)
    with pytest.raises(UserInputError, match="model.safetensors.*truncated") as err:
        load_checkpoint(path)
    assert "step-1" in str(err.value)  # points at the earlier complete checkpoint


class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def test_a_pickle_in_place_of_weights_is_refused_without_running_it(tmp_path):
    target = tmp_path / "PWNED"
    Payload.target = target
    path = save_checkpoint(tmp_path / "ck", 1, weights(), {})
    (path / "model.safetensors").write_bytes(pickle.dumps({"w": Payload()}))
    with pytest.raises(UserInputError, match="model.safetensors"):  # the marker's size / checksum no longer match
        load_checkpoint(path)
    marker = (path / MARKER).read_text()  # a forged marker: the file itself must still be refused
    forged = folder_mod.json.loads(marker)
    file = path / "model.safetensors"
    forged["files"]["model.safetensors"] = {"bytes": file.stat().st_size, "sha256": folder_mod._sha256(file)}
    (path / MARKER).write_text(folder_mod.json.dumps(forged))
    with pytest.raises(UserInputError, match="not a readable safetensors file"):
        load_checkpoint(path)
    assert not target.exists()


def test_a_pickled_model_folder_with_a_payload_is_refused_without_running_it(tmp_path):
    from tinyhf import build

    from rlhflab import models

    target = tmp_path / "PWNED"
    Payload.target = target
    build("llama").config.save_pretrained(tmp_path / "model")
    torch.save({"model.embed_tokens.weight": Payload()}, tmp_path / "model" / "pytorch_model.bin")
    with pytest.raises(UserInputError, match="pickled weights"):
        models.load_causal_lm(str(tmp_path / "model"))
    assert not target.exists()


def test_overwriting_a_run_folder_drops_the_old_runs_checkpoints(tmp_path):
    from rlhflab.checkpoint import open_run
    from rlhflab.config import RMConfig

    save_checkpoint(tmp_path / "run" / "checkpoints", 9, weights(), {})
    (tmp_path / "run" / "config.yaml").write_text("seed: 1\n")
    with pytest.raises(UserInputError, match="already holds a run"):
        open_run(RMConfig(output_dir=str(tmp_path / "run")), "rm")
    (tmp_path / "run" / "summary.json").write_text('{"resumes": [{"step": 9}], "updates": 9}')
    (tmp_path / "run" / "report.html").write_text("<html>the old run</html>")
    run, resumed = open_run(RMConfig(output_dir=str(tmp_path / "run"), overwrite=True), "rm")
    assert resumed is None and not (run.path / "checkpoints").exists()  # `--resume latest` can never pick them
    # nor does the new run's summary inherit the old one's fields (update_summary merges into the file)
    assert not (run.path / "summary.json").exists() and not (run.path / "report.html").exists()


@pytest.mark.parametrize("text", ["seed: [1\n", "- just\n- a list\n"])
def test_an_unreadable_config_yaml_is_a_user_error_naming_the_file(tmp_path, text):
    from rlhflab.checkpoint import open_run
    from rlhflab.config import RMConfig

    save_checkpoint(tmp_path / "run" / "checkpoints", 3, weights(), {"histories": {}})
    (tmp_path / "run" / "config.yaml").write_text(text)
    with pytest.raises(UserInputError, match="config.yaml"):
        open_run(RMConfig(output_dir=str(tmp_path / "run"), resume="latest"), "rm")


@pytest.mark.parametrize("marker", ['{"step": 3, "files": 7}', '{"step": 3, "files": {"model.safetensors": 1}}',
                                    '["step", 3]'])
def test_a_malformed_marker_is_a_user_error(tmp_path, marker):
    path = save_checkpoint(tmp_path, 3, weights(), {})
    (path / MARKER).write_text(marker)
    with pytest.raises(UserInputError, match="marker"):
        load_checkpoint(path)


def test_finishing_at_the_step_resumed_from_does_not_rewrite_its_checkpoint(tmp_path):
    from rlhflab.checkpoint import Checkpointer

    path = save_checkpoint(tmp_path / "checkpoints", 5, weights(), {"histories": {}}, keep_last_n=1)
    before = (path / MARKER).stat().st_mtime_ns, (path / "model.safetensors").stat().st_ino

    def contents():
        raise AssertionError("step 5 is on disk already: nothing to pack")

    with Checkpointer(tmp_path, save_every=0, keep_last_n=1, saved_step=5) as saver:
        saver.finish(5, contents)
    assert ((path / MARKER).stat().st_mtime_ns, (path / "model.safetensors").stat().st_ino) == before


def test_save_every_minus_one_writes_no_checkpoint_but_a_stop_signal_still_saves(tmp_path):
    import signal

    from rlhflab.checkpoint import Checkpointer, Interrupted

    packed = []

    def contents():
        packed.append(1)
        return weights(), {}

    with Checkpointer(tmp_path, save_every=-1, keep_last_n=1) as saver:
        for step in (1, 2, 3):
            saver.step_done(step, contents)
        saver.finish(3, contents)
    assert not packed and not (tmp_path / "checkpoints").exists()
    with Checkpointer(tmp_path, save_every=-1, keep_last_n=1) as saver:
        saver.signals.requested = signal.SIGTERM
        with pytest.raises(Interrupted):
            saver.step_done(4, contents)
    assert packed == [1] and (tmp_path / "checkpoints" / "step-4" / MARKER).is_file()


def _adamw(n_params: int, lr: float, **kw):
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(n_params)]
    opt = torch.optim.AdamW(params, lr=lr, **kw)
    return params, opt, get_scheduler("linear", opt, num_warmup_steps=2, num_training_steps=10)


def test_load_optimiser_keeps_the_moments_and_step_but_takes_the_configs_hyperparameters():
    from rlhflab.checkpoint import load_optimiser

    params, opt, sched = _adamw(2, 1e-3)
    for _ in range(4):
        sum(p.sum() for p in params).backward()
        opt.step()
        sched.step()
    state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
    same_params, same_opt, same_sched = _adamw(2, 1e-3)
    load_optimiser(same_opt, same_sched, state, "ckpt")  # unchanged config: exactly the saved lr
    assert same_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert same_sched.get_last_lr() == sched.get_last_lr()
    _, new_opt, new_sched = _adamw(2, 0.5, betas=(0.5, 0.6), eps=1e-3, weight_decay=0.25)
    load_optimiser(new_opt, new_sched, state, "ckpt")
    group = new_opt.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"], group["initial_lr"]) == ((0.5, 0.6), 1e-3, 0.25, 0.5)
    assert new_sched.base_lrs == [0.5] and new_sched.last_epoch == 4
    assert group["lr"] == pytest.approx(0.5 * 6 / 8) and new_sched.get_last_lr() == [group["lr"]]  # step 4 of 10
    assert new_opt.state_dict()["state"][0]["step"] == 4  # the moments came back
    new_sched.step()
    assert group["lr"] == pytest.approx(0.5 * 5 / 8)


def test_an_optimiser_state_that_does_not_fit_is_a_user_error_naming_the_checkpoint():
    from rlhflab.checkpoint import load_optimiser

    _, opt, sched = _adamw(2, 1e-3)
    _, other, other_sched = _adamw(3, 1e-3)
    state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
    with pytest.raises(UserInputError, match="ckpt/state.safetensors: .*optimiser"):
        load_optimiser(other, other_sched, state, "ckpt/state.safetensors")
