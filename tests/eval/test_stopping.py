"""The stopping rule: exactly `patience` evaluations without a `min_delta` rise; stop_on_alarms; RunMonitor."""

import pytest

from rlhflab.config import PPOConfig
from rlhflab.errors import UserInputError
from rlhflab.eval import RunMonitor
from rlhflab.eval.alarms import AlarmRules
from rlhflab.eval.stopping import StoppingRule, parse_alarm_names


def stop_step(rule: StoppingRule, rates: list[float], eval_every: int = 10) -> int | None:
    """Feed evaluations at 0, 10, 20, ...; the step at which the rule first asks to stop."""
    for i, rate in enumerate(rates):
        rule.observe_eval(i * eval_every, rate)
        if rule.reason:
            return i * eval_every
    return None


def test_stops_after_exactly_patience_evaluations_without_improvement():
    rates = [0.5, 0.6, 0.6, 0.605, 0.59, 0.7]  # best 0.6 at step 10; 0.605 is not a 0.01 rise
    assert stop_step(StoppingRule(patience=3, min_delta=0.01), rates) == 40
    assert stop_step(StoppingRule(patience=4, min_delta=0.01), rates) is None  # step 50 improves in time
    rule = StoppingRule(patience=3, min_delta=0.01)
    stop_step(rule, rates[:4])
    assert rule.reason is None  # two evaluations without improvement: not yet
    rule.observe_eval(40, 0.59)
    assert "best 0.6 (step 10) in 3 evaluations" in rule.reason and "0.59 (step 40)" in rule.reason


def test_an_improvement_resets_the_count_and_min_delta_decides_what_counts():
    rates = [0.5, 0.49, 0.48, 0.51, 0.5, 0.5]  # 0.51 is a 0.01 rise over 0.5: counts
    assert stop_step(StoppingRule(patience=3, min_delta=0.01), rates) is None
    assert stop_step(StoppingRule(patience=3, min_delta=0.02), rates) == 30  # now 0.51 does not count


def test_patience_zero_never_stops():
    assert stop_step(StoppingRule(patience=0), [0.5] + [0.1] * 20) is None


def test_stop_on_alarms_stops_on_the_listed_names_only():
    rule = StoppingRule(stop_on=("reward_hacking",))
    rule.observe_alarms([{"name": "mode_collapse", "step": 5, "reason": "r1"}])
    assert rule.reason is None
    rule.observe_alarms([{"name": "reward_hacking", "step": 7, "reason": "score up, pass rate down"}])
    assert rule.reason == "alarm reward_hacking (stop_on_alarms): score up, pass rate down"


def test_alarm_names_are_checked():
    assert parse_alarm_names("reward_hacking, mode_collapse") == ("reward_hacking", "mode_collapse")
    assert parse_alarm_names("") == ()
    assert len(parse_alarm_names("all")) == 4
    with pytest.raises(UserInputError, match="reward_hack"):
        parse_alarm_names("reward_hack")


def test_run_monitor_from_config_stops_on_an_alarm_it_raised():
    cfg = PPOConfig(stop_on_alarms="reward_hacking", kl_cap=5.0, stop_patience=0)
    monitor = RunMonitor.from_config(cfg)
    assert monitor.alarms.rules.kl_cap == 5.0
    assert monitor.observe(0, {"val/pass_rate": 0.5, "episode": 0}) == []
    fired = []
    for step in range(1, 8):
        fired += monitor.observe(step, {"objective/kl": 6.0, "episode": 64 * step})
        if monitor.stop_reason():
            break
    assert step == 7 and [a["name"] for a in fired] == ["reward_hacking"]
    assert monitor.stop_reason().startswith("alarm reward_hacking") and monitor.fired == fired
    with pytest.raises(UserInputError):
        RunMonitor.from_config(PPOConfig(stop_on_alarms="nope"))


def test_run_monitor_feeds_evaluations_to_the_stopping_rule():
    monitor = RunMonitor.from_config(PPOConfig(stop_patience=2))
    for step, rate in [(0, 0.5), (10, 0.5), (20, 0.45)]:
        assert monitor.stop_reason() is None
        monitor.observe(step, {"val/pass_rate": rate, "episode": 64 * step})
    assert "in 2 evaluations" in monitor.stop_reason()


# --- the edges (issue 36: mutants of stopping.py and monitor.py that the cases above let through) -------------------


def test_the_defaults_watch_the_pass_rate_for_a_rise_of_one_point_and_never_stop_on_it():
    rule = StoppingRule()
    assert (rule.patience, rule.min_delta, rule.stop_on, rule.signal) == (0, 0.01, (), "val/pass_rate")
    assert (rule.best, rule.since_best, rule.reason) == (None, [], None)
    rule.observe_eval(0, 0.0)  # the first evaluation sets the best, even at 0
    rule.observe_eval(10, 0.009)
    assert rule.best == (0, 0.0) and rule.since_best == [(10, 0.009)]
    rule.observe_eval(20, 0.01)  # exactly min_delta above the best: an improvement (the sum is not exact in floats)
    assert rule.best == (20, 0.01) and rule.since_best == [] and rule.reason is None
    rule.observe_eval(30, 0.0199)
    assert rule.best == (20, 0.01) and rule.since_best == [(30, 0.0199)]


def test_zero_patience_and_zero_delta_are_allowed_and_negatives_refused():
    rule = StoppingRule(patience=1, min_delta=0.0)
    rule.observe_eval(0, 0.5)
    rule.observe_eval(10, 0.5)  # a tie is a rise of 0 >= 0
    assert rule.reason is None and rule.best == (10, 0.5)
    rule.observe_eval(20, 0.4)
    assert rule.reason == "val/pass_rate did not rise by 0 over its best 0.5 (step 10) in 1 evaluations: 0.4 (step 20)"
    for patience, min_delta in [(-1, 0.01), (0, -0.01)]:
        with pytest.raises(UserInputError, match=rf"stop_patience \({patience}\) and stop_min_delta \({min_delta}\) "
                                                 "must be >= 0") as refused:
            StoppingRule(patience=patience, min_delta=min_delta)
        assert refused.value.where == "stop_patience / stop_min_delta"


def test_the_first_reason_is_kept():
    rule = StoppingRule(patience=1, stop_on=("mode_collapse", "reward_hacking"), signal="val/reward")
    rule.observe_eval(0, 1.0)
    rule.observe_eval(10, 0.5)
    first = rule.reason
    assert first == "val/reward did not rise by 0.01 over its best 1 (step 0) in 1 evaluations: 0.5 (step 10)"
    rule.observe_eval(20, 0.4)
    rule.observe_alarms([{"name": "mode_collapse", "step": 20, "reason": "r"}])
    assert rule.reason == first
    alarms = StoppingRule(stop_on=("mode_collapse", "reward_hacking"))
    alarms.observe_alarms([{"name": "mode_collapse", "step": 3, "reason": "one"},
                           {"name": "reward_hacking", "step": 3, "reason": "two"}])
    assert alarms.reason == "alarm mode_collapse (stop_on_alarms): one"


def test_alarm_names_are_split_on_commas_and_stripped():
    assert parse_alarm_names(" length_drift ,, training_health ") == ("length_drift", "training_health")
    assert parse_alarm_names(" all ") == ("reward_hacking", "length_drift", "mode_collapse", "training_health")
    with pytest.raises(UserInputError) as refused:
        parse_alarm_names("all, nope, mode_collapse, worse", where="--stop_on_alarms")  # "all" only alone
    assert (refused.value.what, refused.value.where) == ("unknown alarm name(s) all, nope, worse", "--stop_on_alarms")
    with pytest.raises(UserInputError) as default_where:
        parse_alarm_names("nope")
    assert default_where.value.where == "stop_on_alarms"
    assert default_where.value.fix == ("use a comma-separated subset of reward_hacking, length_drift, mode_collapse, "
                                       "training_health, or all")


def test_run_monitor_from_config_carries_every_bound_and_the_signal():
    from rlhflab.eval.alarms import AlarmRules

    cfg = PPOConfig(stop_patience=4, stop_min_delta=0.05, stop_on_alarms="length_drift, mode_collapse",
                    score_rise_bound=0.3, kl_rate_bound=2.5, kl_cap=7.0, length_drift_bound=0.6,
                    capped_share_bound=0.4, min_distinct_ratio=0.45, duplicate_share_bound=0.55, min_entropy_ratio=0.25)
    monitor = RunMonitor.from_config(cfg)
    assert monitor.alarms.rules == AlarmRules(min_delta=0.05, score_rise_bound=0.3, kl_rate_bound=2.5, kl_cap=7.0,
                                              length_drift_bound=0.6, capped_share_bound=0.4, min_distinct_ratio=0.45,
                                              duplicate_share_bound=0.55, min_entropy_ratio=0.25)
    rule = monitor.stopping
    assert (rule.patience, rule.min_delta, rule.stop_on, rule.signal) == (4, 0.05, ("length_drift", "mode_collapse"),
                                                                          "val/pass_rate")
    assert monitor.signal == monitor.alarms.history.signal == "val/pass_rate"
    from rlhflab.trainers.given import Given

    given = RunMonitor.from_config(PPOConfig(verifier="none"), Given(verifier=lambda *a, **k: []))
    assert given.signal == "val/pass_rate"  # a verifier handed in memory: its pass rate
    reward = RunMonitor.from_config(PPOConfig(verifier="none", stop_patience=1))  # no verifier: the reward
    assert reward.signal == reward.stopping.signal == reward.alarms.history.signal == "val/reward"
    reward.observe(0, {"val/reward": 0.5, "val/pass_rate": 0.9})
    reward.observe(10, {"val/reward": 0.2, "val/pass_rate": 0.95})
    assert reward.stop_reason().startswith("val/reward did not rise by 0.01 over its best 0.5 (step 0)")


def test_run_monitor_defaults_and_what_observe_returns():
    monitor = RunMonitor(signal="val/reward")
    assert monitor.stopping.signal == "val/reward" and monitor.alarms.rules == AlarmRules()
    assert monitor.stopping.patience == 0 and monitor.fired == [] and monitor.stop_reason() is None
    monitor.observe(0, {"val/reward": 1})  # an int is read as a float
    assert monitor.stopping.best == (0, 1.0) and isinstance(monitor.stopping.best[1], float)
    fired = monitor.observe(1, {"loss/policy_avg": float("inf")})
    assert [a["name"] for a in fired] == ["training_health"] and fired[0]["step"] == 1
    assert monitor.fired == fired
    assert monitor.observe(2, {"loss/policy_avg": float("inf")}) == []  # each alarm once


def test_the_reason_lists_every_evaluation_since_the_best():
    rule = StoppingRule(patience=3, min_delta=0.01)
    stop_step(rule, [0.5, 0.6, 0.6, 0.605, 0.59])
    assert rule.reason == ("val/pass_rate did not rise by 0.01 over its best 0.6 (step 10) in 3 evaluations: "
                           "0.6 (step 20), 0.605 (step 30), 0.59 (step 40)")
