"""The online loop's checkpoint state (trainers/online/state.py) on stand-in roles, no model (issue 36)."""


import math
from types import SimpleNamespace

import pytest
import torch

from rlhflab.models.precision import MixedPrecision
from rlhflab.trainers.online.algorithm import AlgorithmDefaults, ScoredRollout
from rlhflab.trainers.online.passes import average_stats, backward, micro_losses, rows_named, shuffled_rows
from rlhflab.trainers.online.passes import update_passes

from online_stubs import ADVANTAGES, Engine, Recorder, Roles, config, run, scored  # noqa: F401 - not every file uses each


# --- the checkpoint state (trainers/online/state.py) ------------------------------------------


class StateRoles:
    """A policy and a value head (no value model), and a precision whose state is recorded."""

    def __init__(self, seed: int):
        torch.manual_seed(seed)
        self.policy, self.value_head, self.value_model = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1), None
        self.precision = SimpleNamespace(state_dict=lambda: {"scale": 8.0 + seed}, loaded=None)
        self.precision.load_state_dict = lambda state: setattr(self.precision, "loaded", state)


class Baseline(AlgorithmDefaults):
    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"baseline": self.value}

    def load_state_dict(self, state):
        self.value = state["baseline"]


def built(seed: int):
    """Roles, AdamW, a schedule, an algorithm with state, generators, a watch: a run's objects at `seed`."""
    from rlhflab.trainers.online.monitor import RunWatch

    roles = StateRoles(seed)
    params = [*roles.policy.parameters(), *roles.value_head.parameters()]
    optimizer = torch.optim.AdamW(params, lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    generators = {"order": torch.Generator().manual_seed(seed), "sampler": torch.Generator().manual_seed(seed + 1)}
    return roles, optimizer, scheduler, Baseline(float(seed)), generators, RunWatch(None, None, roles, False)


def test_an_online_checkpoint_round_trips_weights_moments_state_rngs_and_position(tmp_path):
    """Pack a run that took two steps, through the checkpoint's JSON + tensors, into one built afresh with
    another seed: every part comes back, and the generators draw what the first run's would have drawn."""
    import json

    from rlhflab.checkpoint import Resumed
    from rlhflab.checkpoint.state import decode, encode
    from rlhflab.trainers.online.state import Progress, pack_online, unpack_online

    roles, optimizer, scheduler, algorithm, generators, watch = built(0)
    for _ in range(2):
        loss = roles.policy(torch.ones(2)).sum() + roles.value_head(torch.ones(2)).sum()
        loss.backward()
        optimizer.step()
        scheduler.step()
    torch.randint(9, (3,), generator=generators["order"])
    watch.alarms, watch.stopped = [{"name": "kl", "step": 2}], {"step": 2}
    progress = Progress(update=2, episode=16, order=[3, 1], last={"loss": 0.5}, skipped=1, generated=20)
    weights, state = pack_online(roles, optimizer, scheduler, algorithm, generators, progress, watch,
                                 rollouts={"ids": torch.ones(2)})
    assert set(weights) == {"policy.weight", "policy.bias", "value_head.weight", "value_head.bias"}
    assert state["amp"] == {"scale": 8.0} and torch.equal(state["in_flight_rollouts"]["ids"], torch.ones(2))
    tensors = {}
    state = decode(json.loads(json.dumps(encode(state, tensors))), tensors)
    expected = {name: torch.randint(99, (4,), generator=g.clone_state()) for name, g in generators.items()}

    fresh = built(1)
    roles2, optimizer2, scheduler2, algorithm2, generators2, watch2 = fresh
    back = unpack_online(Resumed(tmp_path / "step-2", 2, weights, state, {}), roles2, optimizer2, scheduler2,
                         algorithm2, generators2, watch2)
    assert back == progress
    for name, tensor in weights.items():
        module, param = name.split(".")
        assert torch.equal(getattr(getattr(roles2, module), param), tensor)
    assert scheduler2.last_epoch == 2 and optimizer2.param_groups[0]["lr"] == pytest.approx(0.1 / 3)
    for p, p2 in zip(optimizer.state.values(), optimizer2.state.values(), strict=True):
        assert torch.equal(p["exp_avg_sq"], p2["exp_avg_sq"]) and p["step"] == p2["step"]
    assert algorithm2.value == 0.0 and roles2.precision.loaded == {"scale": 8.0}
    assert watch2.alarms == [{"name": "kl", "step": 2}] and watch2.stopped == {"step": 2}
    assert generators2.keys() == expected.keys()
    for name, g in generators2.items():
        assert torch.equal(torch.randint(99, (4,), generator=g), expected[name])


def test_a_sharded_checkpoint_packs_no_weights_or_moments_and_reads_them_from_its_shards(tmp_path):
    from rlhflab.checkpoint import Resumed
    from rlhflab.trainers.online.state import Progress, pack_online, unpack_online

    roles, optimizer, scheduler, algorithm, generators, watch = built(0)
    weights, state = pack_online(roles, optimizer, scheduler, algorithm, generators, Progress(update=1), watch,
                                 sharded=True)
    assert weights == {} and "optimizer" not in state and state["in_flight_rollouts"] == {}
    roles2, optimizer2, scheduler2, algorithm2, generators2, watch2 = built(1)
    policy = roles2.policy.weight.detach().clone()
    read = []
    trained = SimpleNamespace(load_sharded=lambda optimizer, folder: read.append((optimizer, folder)))
    back = unpack_online(Resumed(tmp_path / "step-1", 1, {}, state, {}), roles2, optimizer2, scheduler2, algorithm2,
                         generators2, watch2, trained=trained)
    assert back.update == 1 and read == [(optimizer2, tmp_path / "step-1" / "sharded")]
    assert torch.equal(roles2.policy.weight, policy)  # the shards hold the weights: none from `weights`
    assert algorithm2.value == 0.0 and roles2.precision.loaded == {"scale": 8.0}


def test_an_online_checkpoint_that_does_not_fit_names_its_file(tmp_path):
    from rlhflab.checkpoint import Resumed
    from rlhflab.errors import UserInputError
    from rlhflab.trainers.online.state import Progress, pack_online, unpack_online

    roles, optimizer, scheduler, algorithm, generators, watch = built(0)
    weights, state = pack_online(roles, optimizer, scheduler, algorithm, generators, Progress(), watch)
    del state["amp"]  # a checkpoint written before fp16's scaler was kept: no scaler state
    fresh = built(1)
    with pytest.raises(UserInputError) as err:
        unpack_online(Resumed(tmp_path / "step-1", 1, {"policy.weight": weights["policy.weight"]}, state, {}),
                      *fresh)
    assert err.value.where == str(tmp_path / "step-1" / "model.safetensors")
    unpack_online(Resumed(tmp_path / "step-1", 1, weights, state, {}), *fresh)
    assert fresh[0].precision.loaded == {}
    state["optimizer"] = {"state": {}, "param_groups": []}
    with pytest.raises(UserInputError) as err:
        unpack_online(Resumed(tmp_path / "step-1", 1, weights, state, {}), *built(1))
    assert err.value.where == str(tmp_path / "step-1" / "state.safetensors")


def test_the_checkpointed_modules_are_the_roles_trained_ones_by_name(tmp_path):
    from rlhflab.checkpoint import Resumed
    from rlhflab.errors import UserInputError
    from rlhflab.trainers.online.state import role_modules, unpack_online

    policy, value_model = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    assert role_modules(SimpleNamespace(policy=policy, value_head=None, value_model=value_model)) == {
        "policy": policy, "value_model": value_model}
    roles, optimizer, scheduler, algorithm, generators, watch = built(0)
    trained = SimpleNamespace(load_sharded=lambda optimizer, folder: None)
    with pytest.raises(UserInputError) as err:  # a sharded checkpoint's state that does not fit names its file
        unpack_online(Resumed(tmp_path / "step-1", 1, {}, {"scheduler": {}}, {}), roles, optimizer, scheduler,
                      algorithm, generators, watch, trained=trained)
    assert err.value.where == str(tmp_path / "step-1" / "state.safetensors")


# --- summary.json's numbers, the loop's Checkpointer and its time budget (trainers/online/loop.py) -------------


def test_the_summarys_numbers_are_the_saved_policys_the_restored_best_update_or_the_last():
    """Held-out start / end and the "final" training numbers: the last update's, unless keep_best restored an
    earlier one (its evaluation and training row; update 0 has none: KL 0). The best's training row leaves the
    monitor's summary either way."""
    from rlhflab.trainers.online.loop import FINAL_KEYS, saved_policy_numbers

    first, last_eval = {"val/pass_rate": 0.25, "val/reward": 1.0}, {"val/pass_rate": 0.5, "val/reward": 2.0}
    last = {"objective/kl": 3.0, "objective/scores": 0.75, "eps": 9.0, "loss/policy": 1.0}
    final = {k: last.get(k) for k in FINAL_KEYS}
    assert saved_policy_numbers(first, last_eval, last, {}, "val/pass_rate") == {
        "validation_pass_rate": {"start": 0.25, "end": 0.5}, "final": final, "final_is": "last update"}
    best = {"val/reward": 1.5, "restored": False, "update_row": {"objective/kl": 1.0}}
    assert saved_policy_numbers(first, last_eval, last, {"best": best}, "val/reward") == {
        "validation_reward": {"start": 1.0, "end": 2.0}, "final": final, "final_is": "last update"}
    assert best == {"val/reward": 1.5, "restored": False}
    best = {"val/reward": 1.5, "restored": True, "update_row": {"objective/kl": 1.0, "kl_coef": 0.5}}
    assert saved_policy_numbers(first, last_eval, last, {"best": best}, "val/reward") == {
        "validation_reward": {"start": 1.0, "end": 1.5}, "final_is": "restored best update",
        "final": {k: {"objective/kl": 1.0, "kl_coef": 0.5}.get(k) for k in FINAL_KEYS}}
    assert best == {"val/reward": 1.5, "restored": True}
    best = {"val/pass_rate": 0.75, "restored": True, "update_row": None}
    numbers = saved_policy_numbers(first, last_eval, last, {"best": best}, "val/pass_rate")
    assert numbers["validation_pass_rate"]["end"] == 0.75 and numbers["final"] == {k: None for k in FINAL_KEYS} | {
        "objective/kl": 0.0}
    best = {"val/pass_rate": 0.75, "restored": False}  # a best without a training row: nothing to leave out
    assert saved_policy_numbers(first, last_eval, last, {"best": best}, "val/pass_rate")["final"] == final


def test_the_held_out_signal_is_described_by_its_verifier_or_as_the_rewards_own_opinion():
    from rlhflab.trainers.online.loop import held_out_description

    class Checker:
        pass

    independent = "pass rate of the validation answers by the verifier, an independent check"
    assert held_out_description("val/pass_rate", SimpleNamespace(name="math")) == {
        "metric": "val/pass_rate", "verifier": "math", "note": independent}
    assert held_out_description("val/pass_rate", Checker()) == {"metric": "val/pass_rate", "verifier": "Checker",
                                                                "note": independent}
    assert held_out_description("val/reward", None) == {
        "metric": "val/reward", "verifier": None,
        "note": "no verifier: the held-out signal is the reward's mean on the validation answers, i.e. the reward's "
                "own opinion, not an independent check; read it with the KL to the reference"}


def test_the_loops_checkpointer_writes_shards_only_when_sharded_and_its_budget_counts_three_walls(monkeypatch):
    """The Checkpointer gets the run folder, --save_every, --keep_last_n, the resumed step and the layout; sharded,
    a writer of the trained module's shards and the optimiser's moments. max_seconds bounds the updates,
    evaluations and checkpoints, not the set-up."""
    from rlhflab.trainers.online import loop

    monkeypatch.setattr(loop, "Checkpointer", lambda *args, **kwargs: (args, kwargs))
    saved = []
    trained = SimpleNamespace(save_sharded=lambda optimizer, folder: saved.append((optimizer, folder)))
    cfg, run = SimpleNamespace(save_every=5, keep_last_n=2), SimpleNamespace(path="RUN")
    sharded = SimpleNamespace(layout="layout", sharded=True, trained=trained)
    args, kwargs = loop.checkpointer(run, cfg, 10, sharded, "opt")
    assert args == ("RUN", 5, 2, 10) and set(kwargs) == {"layout", "write_shards"} and kwargs["layout"] == "layout"
    kwargs["write_shards"]("folder")
    assert saved == [("opt", "folder")]
    args, kwargs = loop.checkpointer(run, cfg, None, SimpleNamespace(layout="one", sharded=False), "opt")
    assert args == ("RUN", 5, 2, None) and kwargs == {"layout": "one", "write_shards": None}
    assert loop.cycle_seconds({"setup": 100.0, "loop": 1.0, "evaluation": 2.0, "save": 4.0}) == 7.0
    assert loop.trainer_threads(SimpleNamespace(threads=3), SimpleNamespace(threads=lambda n: 10 * n)) == 30
