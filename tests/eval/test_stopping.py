"""The stopping rule: exactly `patience` evaluations without a `min_delta` rise; stop_on_alarms; RunMonitor."""

import pytest

from rlhflab.config import PPOConfig
from rlhflab.errors import UserInputError
from rlhflab.eval import RunMonitor
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
