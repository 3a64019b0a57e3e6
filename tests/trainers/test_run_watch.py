"""The online loop's side of monitoring (trainers/online/monitor.py) on a one-parameter stand-in policy, no model
(issue 36: a monitor that must stop a run). The watch is fed rows as the loop feeds it (an update row, then the
evaluation row of the same update) and driven by the real RunMonitor: alarms are logged once, the stopping rule
stops the run, the best policy is kept, restored and carried through a checkpoint. docs/mutation.md lists the
mutants of the module these tests kill."""

import logging

import pytest
import torch

from rlhflab.eval import RunMonitor, StoppingRule
from rlhflab.eval.alarms import AlarmRules
from rlhflab.trainers.online.monitor import BestPolicy, RunWatch, as_held, whole


class Roles:
    """Stand-in PolicyRoles: one trainable scalar; a frozen one the best policy must not copy."""

    def __init__(self, value: float = 0.0):
        self.weight = torch.nn.Parameter(torch.tensor([value]))
        self.frozen = torch.nn.Parameter(torch.tensor([7.0]), requires_grad=False)

    def trainable_parameters(self):
        return [self.weight]

    def set(self, value: float) -> None:
        with torch.no_grad():
            self.weight.fill_(value)


class Run:
    """Stand-in RunDir: the rows logged, as (step, row)."""

    def __init__(self):
        self.rows = []

    def log(self, row, step):
        self.rows.append((step, row))


def update(kl: float = 0.1) -> dict:
    return {"objective/kl": kl, "loss/policy": 0.5}


def evaluation(rate: float) -> dict:
    return {"val/pass_rate": rate, "episode": 64}


def test_the_best_policy_keeps_the_first_of_equal_values_and_copies_the_weights():
    roles = Roles(1.0)
    best = BestPolicy(roles)
    assert best.pass_rate == float("-inf") and best.state is None and best.step is None and best.update_row == {}
    best.offer(0, 0.0, {})  # a first value of 0 beats -inf
    assert best.step == 0 and best.state[0].item() == 1.0
    roles.set(2.0)
    best.offer(2, 0.0, {"loss/policy": 1.0})  # a tie keeps the earlier policy
    assert best.step == 0 and best.state[0].item() == 1.0 and best.update_row == {}
    best.offer(3, 0.25, {"loss/policy": 1.0})
    roles.set(5.0)
    assert (best.step, best.pass_rate, best.update_row) == (3, 0.25, {"loss/policy": 1.0})
    assert best.state[0].item() == 2.0  # a copy: later steps do not move it
    best.restore()
    assert roles.weight.item() == 2.0 and roles.frozen.item() == 7.0


def test_without_a_monitor_the_watch_does_nothing():
    roles, run = Roles(1.0), Run()
    watch = RunWatch(None, run, roles, keep_best=True)
    assert watch.best is None  # keep_best needs a monitor
    watch.observe(0, evaluation(0.5))
    watch.observe(1, {"val/pass_rate": float("nan")})
    assert watch.observed == [] and run.rows == [] and not watch.should_stop(1, 64) and watch.stopped is None
    assert watch.finish(1, 0.0) == {} and roles.weight.item() == 1.0
    assert RunWatch(RunMonitor(), run, roles, keep_best=False).best is None


def test_a_monitor_that_must_stop_a_run_stops_it_and_the_best_policy_is_restored(caplog):
    roles, run = Roles(0.0), Run()
    watch = RunWatch(RunMonitor(stopping=StoppingRule(patience=2, min_delta=0.01)), run, roles, keep_best=True)
    rates = {0: 0.5, 1: 0.6, 2: 0.6, 3: 0.55}  # best 0.6 at update 1; updates 2 and 3 do not rise by 0.01
    stopped_at = None
    with caplog.at_level(logging.WARNING, logger="rlhflab"):
        for step, rate in rates.items():
            roles.set(float(step))  # the policy of update `step` is the number `step`
            if step:
                watch.observe(step, update())
            watch.observe(step, evaluation(rate))
            if watch.should_stop(step, 64 * step):
                stopped_at = step
                break
    assert stopped_at == 3 and watch.stopped["step"] == 3 and watch.stopped["episode"] == 192
    assert "did not rise by 0.01 over its best 0.6 (step 1) in 2 evaluations" in watch.stopped["reason"]
    assert caplog.records[-1].getMessage() == f"stopping early at update 3 (episode 192): {watch.stopped['reason']}"
    assert watch.best.step == 1 and watch.best.update_row == update()  # the training row logged at update 1
    with caplog.at_level(logging.INFO, logger="rlhflab"):
        fields = watch.finish(3, 0.55)
    assert roles.weight.item() == 1.0  # update 1's policy is what gets saved
    assert caplog.records[-1].getMessage() == "restored the policy of update 1 (val/pass_rate 0.600) before saving"
    assert fields["stopped"] == watch.stopped and fields["alarms"] == []
    assert fields["best"] == {"step": 1, "val/pass_rate": 0.6, "restored": True, "update_row": update()}
    assert len(watch.observed) == 7 and watch.observed[1] == (1, update())


def test_an_alarm_is_logged_once_and_stops_a_run_that_lists_it(caplog):
    roles, run = Roles(0.0), Run()
    monitor = RunMonitor(AlarmRules(kl_cap=5.0), StoppingRule(stop_on=("reward_hacking",)))
    watch = RunWatch(monitor, run, roles, keep_best=False)
    watch.observe(0, evaluation(0.5))
    steps = []
    with caplog.at_level(logging.WARNING, logger="rlhflab"):
        for step in range(1, 12):
            watch.observe(step, update(kl=6.0))
            steps.append(step)
            if watch.should_stop(step, 64 * step):
                break
    # the KL median is above the cap from the 5th update (window 5), for 3 updates in a row (persist 3): update 7
    assert steps[-1] == 7 and run.rows == [(7, {"alarm/reward_hacking": 1})]
    assert [a["name"] for a in watch.alarms] == ["reward_hacking"] and watch.alarms[0]["step"] == 7
    assert caplog.records[0].getMessage() == f"alarm reward_hacking at update 7: {watch.alarms[0]['reason']}"
    assert watch.stopped["reason"].startswith("alarm reward_hacking (stop_on_alarms)")
    assert watch.finish(7, 0.5) == {"alarms": watch.alarms, "stopped": watch.stopped}  # no best without keep_best


@pytest.mark.parametrize("end, last_step, restored", [
    (0.4, 3, True),  # ended below the best: the best policy is saved
    (0.6, 3, False),  # ended level with it: the last policy stays
    (0.4, 1, False),  # the best is the last update's own policy: nothing to restore
])
def test_a_run_that_ends_is_restored_only_below_its_best_and_from_another_update(end, last_step, restored):
    roles, run = Roles(0.0), Run()
    watch = RunWatch(RunMonitor(), run, roles, keep_best=True)
    roles.set(1.0)
    watch.observe(1, update())
    watch.observe(1, evaluation(0.6))
    roles.set(9.0)
    fields = watch.finish(last_step, end)
    assert fields["best"]["restored"] is restored and fields["stopped"] is None
    assert roles.weight.item() == (1.0 if restored else 9.0)


def test_an_evaluation_with_no_update_row_at_its_step_keeps_an_empty_row():
    roles = Roles(0.0)
    watch = RunWatch(RunMonitor(), Run(), roles, keep_best=True)
    watch.observe(1, update())
    watch.observe(2, evaluation(0.5))  # the update row of step 1 does not describe step 2's policy
    assert watch.best.update_row == {} and watch.update_rows == {1: update()}
    watch.observe(3, update(0.2))
    assert watch.update_rows == {3: update(0.2)}  # only the latest update row is kept


def test_a_checkpoint_rebuilds_the_monitor_by_replaying_its_rows_and_keeps_the_best_policy():
    roles, run = Roles(0.0), Run()
    watch = RunWatch(RunMonitor(stopping=StoppingRule(patience=2)), run, roles, keep_best=True)
    for step, rate in [(0, 0.5), (1, 0.7), (2, 0.6)]:
        roles.set(float(step))
        if step:
            watch.observe(step, update())
        watch.observe(step, evaluation(rate))
    watch.alarms = [{"name": "length_drift", "step": 2, "reason": "r"}]
    state = watch.state_dict()
    assert state["best"] == {"step": 1, "pass_rate": 0.7, "params": watch.best.state, "update_row": update()}
    assert state["observed"] == watch.observed and state["stopped"] is None

    roles.set(5.0)
    resumed_run = Run()
    resumed = RunWatch(RunMonitor(stopping=StoppingRule(patience=2)), resumed_run, roles, keep_best=True)
    resumed.load_state_dict(state)
    assert resumed.alarms == watch.alarms and resumed_run.rows == []  # alarms already logged: not again
    assert resumed.update_rows == {2: update()} and resumed.observed == watch.observed
    assert (resumed.best.step, resumed.best.pass_rate, resumed.best.update_row) == (1, 0.7, update())
    assert resumed.best.state[0].item() == 1.0 and resumed.best.state[0] is not state["best"]["params"][0]
    resumed.observe(3, update())
    resumed.observe(3, evaluation(0.65))  # the replayed rule knows 0.6 at step 2: this is the 2nd without a rise
    assert resumed.should_stop(3, 192) and "best 0.7 (step 1)" in resumed.stopped["reason"]
    assert resumed.finish(3, 0.65)["best"]["restored"] and roles.weight.item() == 1.0


def test_a_checkpoint_without_a_best_policy_loads_as_none():
    roles = Roles(0.0)
    watch = RunWatch(RunMonitor(), Run(), roles, keep_best=True)
    assert watch.state_dict() == {"alarms": [], "stopped": None, "observed": [], "best": None}
    state = {"alarms": [], "stopped": {"step": 4}, "observed": [("2", update())], "best": None}
    watch.load_state_dict(state)
    assert watch.best.state is None and watch.stopped == {"step": 4} and watch.observed == [(2, update())]
    assert watch.finish(4, 0.1) == {"alarms": [], "stopped": {"step": 4}}


class Sharded:
    """Stand-in for an FSDP2 parameter: `full_tensor` gathers it, `device_mesh` / `placements` lay it out."""

    device_mesh, placements = "mesh", ("shard",)

    def __init__(self, value):
        self.value = value

    def detach(self):
        return self

    def full_tensor(self):
        return self.value


def test_a_sharded_parameter_is_gathered_whole_and_restored_as_its_shard(monkeypatch):
    import torch.distributed.tensor as dtensor

    value = torch.tensor([1.0, 2.0])
    assert whole(Sharded(value)) is value and whole(value).equal(value)
    calls = []
    monkeypatch.setattr(dtensor, "distribute_tensor",
                        lambda v, mesh, placements, src_data_rank: calls.append((mesh, placements, src_data_rank)) or v[:1])
    assert as_held(value, Sharded(value)).tolist() == [1.0] and calls == [("mesh", ("shard",), None)]
    assert as_held(value, torch.zeros(2)) is value
