"""The checkpoint state on hand-made values, no model (issue 36): the state codec, RNGs and weights, the
optimiser and schedule, the sharded layout and several ranks (checkpoint/state.py, checkpoint/ranks.py, and
open_run's layout check and ranks in checkpoint/resume.py)."""

import json
import logging
import random
import signal

import numpy as np
import pytest
import torch

from rlhflab import parallel
from rlhflab.checkpoint.state import (all_finite, decode, encode, load_optimiser, load_trainable_weights, restore_rng,
                                      rng_state, trainable_weights)
from rlhflab.errors import UserInputError

from run_stubs import RankOf2, Rows


# --- state codec -------------------------------------------------------------------------------


def test_tensors_leave_the_json_under_their_path_as_copies_of_their_own():
    t = torch.arange(6.0).reshape(2, 3)
    tensors = {}
    encoded = encode({"a": [t.T, (t[0],)], "b": {3: t[1]}}, tensors)
    assert json.loads(json.dumps(encoded)) == encoded
    assert encoded == {"a": [{"__tensor__": "/a/0"}, {"__tuple__": [{"__tensor__": "/a/1/0"}]}],
                       "b": {"__dict__": [[3, {"__tensor__": "/b/3"}]]}}
    assert sorted(tensors) == ["/a/0", "/a/1/0", "/b/3"]
    back = decode(encoded, tensors)
    assert torch.equal(back["a"][0], t.T) and torch.equal(back["a"][1][0], t[0]) and torch.equal(back["b"][3], t[1])
    assert tensors["/a/0"].is_contiguous() and torch.equal(tensors["/a/0"], t.T)
    t.add_(100.0)  # the checkpoint holds what it held when packed
    assert tensors["/a/1/0"].tolist() == [0.0, 1.0, 2.0] and tensors["/b/3"].tolist() == [3.0, 4.0, 5.0]
    alone = {}
    assert encode(torch.ones(2, requires_grad=True), alone) == {"__tensor__": "tensor"}
    assert not alone["tensor"].requires_grad


def test_the_codec_keeps_keys_tuples_arrays_and_numpy_numbers():
    state = {"__tensor__": "not a tensor", "w": np.float32(1.5), "n": np.int64(4), "arr": np.array([[1, 2]], np.int16),
             "t": (1, (2.5, "x")), (0, 1): [None, True], "f": 0.1}
    tensors = {}
    encoded = encode(state, tensors)
    text = json.dumps(encoded)
    assert '"__dict__"' in text and tensors == {}  # a key like the codec's own: the whole dict as pairs
    back = decode(json.loads(text), tensors)
    assert back == {"__tensor__": "not a tensor", "w": 1.5, "n": 4, "arr": back["arr"], "t": (1, (2.5, "x")),
                    (0, 1): [None, True], "f": 0.1}
    assert type(back["w"]) is float and type(back["n"]) is int
    assert back["arr"].dtype == np.int16 and back["arr"].tolist() == [[1, 2]]
    # a key JSON gives back as a list (written by hand, or by an older writer) is read as a tuple
    assert decode({"__dict__": [[[1, 2], "x"], [3, "y"]]}, {}) == {(1, 2): "x", 3: "y"}
    with pytest.raises(TypeError, match=r"^cannot checkpoint a object at '/fn/0' without pickle$"):
        encode({"fn": [object()]}, {})


def test_a_dict_keyed_like_the_codecs_own_markers_stays_a_dict_of_strings():
    tensors = {}
    encoded = encode({"__tensor__": "w", "__tuple__": [1]}, tensors)
    assert encoded == {"__dict__": [["__tensor__", "w"], ["__tuple__", [1]]]}
    assert decode(json.loads(json.dumps(encoded)), tensors) == {"__tensor__": "w", "__tuple__": [1]}
    assert encode({"_x": 1, "x__": 2}, {}) == {"_x": 1, "x__": 2}


def test_tensors_in_lists_tuples_and_int_keyed_dicts_come_back_from_their_paths():
    t = torch.arange(4.0)
    tensors = {}
    back = decode(json.loads(json.dumps(encode({"a": [t, (t + 1,)], "b": {3: t + 2}}, tensors))), tensors)
    assert back["a"][0].tolist() == [0.0, 1.0, 2.0, 3.0] and back["a"][1][0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert back["b"][3].tolist() == [2.0, 3.0, 4.0, 5.0] and isinstance(back["a"][1], tuple)


# --- RNGs and weights ------------------------------------------------------------------------------


def test_every_rng_comes_back_and_a_generator_added_since_keeps_its_seed():
    generators = {"order": torch.Generator().manual_seed(1)}
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    state = rng_state(generators)
    assert set(state) == {"python", "numpy", "torch", "generators"} and set(state["generators"]) == {"order"}
    want = (random.random(), np.random.rand(), torch.rand(1).item(),
            torch.rand(1, generator=generators["order"]).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    added = torch.Generator().manual_seed(2)
    fresh = {"order": torch.Generator().manual_seed(7), "added": added}
    restore_rng(state, fresh)
    assert (random.random(), np.random.rand(), torch.rand(1).item(),
            torch.rand(1, generator=fresh["order"]).item()) == want
    assert added.initial_seed() == 2 and torch.equal(torch.rand(2, generator=added),
                                                      torch.rand(2, generator=torch.Generator().manual_seed(2)))
    assert rng_state()["generators"] == {}
    restore_rng(state)  # no generators of the run's own: the global ones alone


def model_pair():
    policy = torch.nn.Linear(2, 2)
    policy.bias.requires_grad_(False)  # frozen: comes back from the model folder, never from a checkpoint
    return {"policy": policy, "value_head": torch.nn.Linear(2, 1)}


def test_only_trainable_weights_are_checkpointed_and_read_back_exactly():
    torch.manual_seed(0)
    modules = model_pair()
    weights = trainable_weights(modules)
    assert list(weights) == ["policy.weight", "value_head.weight", "value_head.bias"]
    assert not weights["policy.weight"].requires_grad
    torch.manual_seed(1)
    other = model_pair()
    load_trainable_weights(other, {k: v.double() for k, v in weights.items()}, "step-1/model.safetensors")
    for name, value in weights.items():
        module, param = name.split(".")
        got = getattr(other[module], param)
        assert got.dtype == torch.float32 and torch.equal(got, value)
    assert not torch.equal(other["policy"].bias, modules["policy"].bias)


def test_weights_that_do_not_fit_the_model_are_refused_naming_the_names_and_shapes():
    modules = model_pair()
    weights = trainable_weights(modules)
    with pytest.raises(UserInputError) as err:
        load_trainable_weights(modules, {**weights, "x.a": torch.ones(1), "x.b": torch.ones(1), "x.c": torch.ones(1),
                                         "x.d": torch.ones(1)}, "step-1/model.safetensors")
    assert str(err.value) == ("step-1/model.safetensors: checkpoint weights do not fit this model (missing [], "
                              "unexpected ['x.a', 'x.b', 'x.c']) -> resume with the model and LoRA / value "
                              "settings of the run")
    with pytest.raises(UserInputError, match=r"missing \['value_head.bias', 'value_head.weight'\], unexpected \[\]"):
        load_trainable_weights(modules, {"policy.weight": weights["policy.weight"]}, "w")
    with pytest.raises(UserInputError) as err:
        load_trainable_weights(modules, {**weights, "value_head.weight": torch.ones(2, 1)}, "w")
    assert str(err.value) == "w: checkpoint weight value_head.weight has shape (2, 1), the model (1, 2)"


def test_non_finite_floating_weights_are_found_and_integer_ones_ignored():
    assert all_finite({"a": torch.ones(2), "steps": torch.tensor([3])})
    assert not all_finite({"a": torch.ones(2), "b": torch.tensor([1.0, float("inf")])})
    assert not all_finite({"b": torch.tensor([float("nan")], dtype=torch.bfloat16)})
    assert all_finite({})


# --- optimiser and schedule ---------------------------------------------------------------------


def optimiser(lr, betas, decay, halves):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    groups = [{"params": [model.weight]}, {"params": [model.bias], "lr": lr * 10}]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, weight_decay=decay)
    schedule = (lambda step: 0.5 ** step) if halves else (lambda step: 1.0 / (1 + step))
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, [schedule, schedule])


def test_moments_and_steps_come_back_and_hyperparameters_and_lr_come_from_the_resumed_config():
    """Two steps at lr 0.1 (bias 1.0) with a 1 / (1 + step) schedule; resumed with lr 0.2 (2.0), other betas and
    decay, a halving schedule: the moments are the run's, lr = peak x 0.5^2 in each group."""
    model, optimizer, scheduler = optimiser(0.1, (0.8, 0.9), 0.0, False)
    for _ in range(2):
        model(torch.ones(2)).sum().backward()
        optimizer.step(), scheduler.step()
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    _, fresh, fresh_scheduler = optimiser(0.2, (0.5, 0.6), 0.3, True)
    load_optimiser(fresh, fresh_scheduler, state, "step-2/state.safetensors")
    assert [g["lr"] for g in fresh.param_groups] == pytest.approx([0.05, 0.5])
    assert fresh_scheduler.get_last_lr() == pytest.approx([0.05, 0.5]) and fresh_scheduler.base_lrs == [0.2, 2.0]
    assert fresh_scheduler.last_epoch == 2
    assert all(g["betas"] == (0.5, 0.6) and g["weight_decay"] == 0.3 for g in fresh.param_groups)
    for p, q in zip(optimizer.state.values(), fresh.state.values(), strict=True):
        assert torch.equal(p["exp_avg"], q["exp_avg"]) and torch.equal(p["step"], q["step"])
    fresh_scheduler.step()  # and the schedule goes on from there
    assert fresh_scheduler.get_last_lr() == pytest.approx([0.025, 0.25])


def test_moments_read_elsewhere_and_a_state_that_does_not_fit():
    model, optimizer, scheduler = optimiser(0.1, (0.8, 0.9), 0.0, False)
    scheduler.step()
    state = {"scheduler": scheduler.state_dict()}
    _, fresh, fresh_scheduler = optimiser(0.2, (0.5, 0.6), 0.3, True)
    read = []
    load_optimiser(fresh, fresh_scheduler, state, "w", load_moments=lambda: read.append(1))
    assert read == [1] and fresh_scheduler.last_epoch == 1 and fresh.param_groups[0]["lr"] == pytest.approx(0.1)
    with pytest.raises(UserInputError) as err:
        load_optimiser(fresh, fresh_scheduler, state, "step-1/state.safetensors")
    assert str(err.value) == ("step-1/state.safetensors: the checkpoint's optimiser / LR-schedule state does not fit "
                              "this run ('optimizer') -> resume with the model, LoRA and value settings of the run")
    for broken in (ValueError("v"), RuntimeError("r"), TypeError("t")):
        def fail(broken=broken):
            raise broken
        with pytest.raises(UserInputError, match=rf"does not fit this run \({broken}\)"):
            load_optimiser(fresh, fresh_scheduler, state, "w", load_moments=fail)


# --- checkpoint/ranks.py -------------------------------------------------------------------------


def test_a_follower_writes_nothing_and_answers_as_the_writer_would(tmp_path):
    from rlhflab.checkpoint.ranks import FollowerRun

    run = FollowerRun(tmp_path / "run")
    assert run.path == tmp_path / "run" and run.started > 0 and run._sinks == []
    assert run.write_json("summary.json", {"a": 1}) == tmp_path / "run" / "summary.json"
    assert run.update_summary(updates=3, done=True) == {"updates": 3, "done": True}
    run.write_versions(1), run.log({"loss": 1.0}, step=1), run.add_samples([{"x": 1}])
    assert not (tmp_path / "run").exists()


def layout(strategy, world_size):
    return parallel.Layout(strategy, parallel.World(0, world_size))


def test_a_sharded_checkpoint_needs_its_own_layout_and_a_whole_one_changes_world_size_with_a_warning(caplog):
    from rlhflab.checkpoint.ranks import check_layout

    two_fsdp2 = {"strategy": "fsdp2", "world_size": 2, "sharded_state": True}
    check_layout(two_fsdp2, layout("fsdp2", 2), "w")
    for now in (layout("fsdp2", 4), layout("ddp", 2)):
        with pytest.raises(UserInputError) as err:
            check_layout(two_fsdp2, now, "--resume latest")
        assert str(err.value) == (
            f"--resume latest: the checkpoint was written by 2 process(es) with parallel_strategy fsdp2; this run "
            f"has {now.world.world_size} with {now.strategy}, and a sharded (fsdp2) checkpoint is read back only by "
            "the layout that wrote it -> resume with torchrun --nproc_per_node 2 (or accelerate launch "
            "--num_processes 2) and --parallel_strategy fsdp2")
    with pytest.raises(UserInputError, match=r"written by 1 process\(es\) with parallel_strategy none; this run has "
                                             r"2 with fsdp2.* -> resume in one process \(plain rlhflab\), as the run "
                                             r"was written$"):
        check_layout(None, layout("fsdp2", 2), "w")  # a checkpoint of before issue 15: one process
    with caplog.at_level(logging.WARNING, logger="rlhflab"):
        check_layout({"strategy": "ddp", "world_size": 2, "sharded_state": False}, layout("ddp", 2), "w")
        check_layout({"strategy": "ddp", "world_size": 2, "sharded_state": False}, layout("none", 1), "w")
        check_layout(None, layout("ddp", 4), "w")
    assert [r.getMessage() for r in caplog.records] == [
        f"resuming a checkpoint of {was} process(es) with {now}: the whole model and optimiser state are in it, "
        "batch sizes are global, so the run continues with the same updates up to float rounding"
        for was, now in [(2, 1), (1, 4)]]


def test_a_resume_refuses_a_sharded_checkpoint_that_another_layout_wrote(tmp_path):
    from rlhflab.checkpoint.folder import save_checkpoint
    from rlhflab.checkpoint.ownership import releasing_locks
    from rlhflab.checkpoint.resume import history_position, open_run
    from rlhflab.config import RMConfig

    out = tmp_path / "run"
    with releasing_locks():
        open_run(RMConfig(output_dir=str(out)), "rm")[0].close()
    save_checkpoint(out / "checkpoints", 2, {"w": torch.ones(1)}, {
        "histories": history_position(out), "parallel": {"strategy": "fsdp2", "world_size": 2, "sharded_state": True}})
    with pytest.raises(UserInputError) as err:
        open_run(RMConfig(resume=str(out / "checkpoints" / "step-2")), "rm")  # one process
    assert str(err.value) == (
        f"--resume {out / 'checkpoints' / 'step-2'}: the checkpoint was written by 2 process(es) with parallel_strategy "
        "fsdp2; this run has 1 with none, and a sharded (fsdp2) checkpoint is read back only by the layout that wrote "
        "it -> resume with torchrun --nproc_per_node 2 (or accelerate launch --num_processes 2) and "
        "--parallel_strategy fsdp2")


def test_on_two_ranks_rank_0_opens_the_run_folder_and_rank_1_follows_it_to_the_same_checkpoint(tmp_path,
                                                                                                 monkeypatch):
    from pathlib import Path

    from rlhflab.checkpoint.folder import save_checkpoint
    from rlhflab.checkpoint.ownership import OwnedRun, releasing_locks
    from rlhflab.checkpoint.ranks import FollowerRun
    from rlhflab.checkpoint.resume import history_position, open_run
    from rlhflab.config import RMConfig

    monkeypatch.chdir(tmp_path)
    main, callback = RankOf2(0), Rows()
    with releasing_locks():
        run, resumed = open_run(RMConfig(seed=1), "rm", parallel.Layout("ddp", main), callbacks=[callback])
        assert type(run) is OwnedRun and resumed is None and main.sent == (str(run.path), None)
        assert run.path.parent == Path("runs") and run.path.name.startswith("rm-")  # no --output_dir: runs/rm-<time>
        run.log({"loss": 0.5}, step=1)
        run.close()
    assert callback.rows == [(1, {"loss": 0.5})]
    out, step2 = run.path, run.path / "checkpoints" / "step-2"
    save_checkpoint(out / "checkpoints", 2, {"w": torch.full((2,), 2.0)}, {"n": 1, "histories": history_position(out)})
    with releasing_locks():
        run, resumed = open_run(RMConfig(seed=1, resume=str(step2)), "rm", parallel.Layout("ddp", main))
        assert (type(run), run.path, resumed.checkpoint, main.sent) == (OwnedRun, out, step2, (str(out), str(step2)))
        run.close()
    run, resumed = open_run(RMConfig(), "rm", parallel.Layout("ddp", RankOf2(1, (str(out), None))))
    assert (type(run), run.path, resumed) == (FollowerRun, out, None)
    run, resumed = open_run(RMConfig(), "rm", parallel.Layout("ddp", RankOf2(1, (str(out), str(step2)))))
    assert (type(run), run.path, resumed.checkpoint, resumed.step, resumed.config_changes) == (
        FollowerRun, out, step2, 2, {})
    assert resumed.weights["w"].tolist() == [2.0, 2.0] and resumed.state["n"] == 1
