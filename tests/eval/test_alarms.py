"""Each alarm fires at the right step, with its numbers, on a constructed history; a healthy or
once-noisy history raises none."""

import random

import pytest

from rlhflab.eval.alarms import (ALARM_NAMES, AlarmRules, Alarms, Condition, History, hacking_by_score, slope,
                                 smoothed_score_at, training_health)

BATCH = 64
# a healthy update row (tiny runs' typical values); every value gets +-10 % noise
HEALTHY = {"objective/kl": 1.0, "objective/entropy": 0.6, "response/length_mean": 8.0, "response/capped_share": 0.0,
           "response/distinct_2": 0.5, "response/duplicate_share_batch": 0.1, "loss/value_avg": 0.1,
           "val/explained_variance": 0.2, "policy/clipfrac_avg": 0.03, "policy/approxkl_avg": 0.005}


def rising_pass_rate(step: int) -> float:
    return 0.5 + step / 200


def rising_score(step: int) -> float:
    return 0.2 + step / 200


def feed(updates: int, overrides=lambda step: {}, pass_rate=rising_pass_rate, rules=None, eval_every=10):
    """Log `updates` update rows (and an evaluation at 0 and every `eval_every`) -> the alarms fired."""
    alarms, rng, fired = Alarms(rules), random.Random(0), []
    fired += alarms.observe(0, {"val/pass_rate": pass_rate(0), "episode": 0})
    for step in range(1, updates + 1):
        row = {k: v * (1 + 0.1 * rng.uniform(-1, 1)) for k, v in HEALTHY.items()}
        row |= {"objective/scores": rising_score(step), "episode": BATCH * step, **overrides(step)}
        fired += alarms.observe(step, row)
        if step % eval_every == 0:
            rate = pass_rate(step)
            fired += alarms.observe(step, {"val/pass_rate": rate, "val/pass_rate/lists": rate, "episode": BATCH * step})
    return fired


def only(fired, name):
    assert [a["name"] for a in fired] == [name], fired
    assert set(fired[0]) == {"name", "step", "reason"}
    return fired[0]


def test_a_healthy_run_raises_no_alarm():
    assert feed(100) == []


def test_one_noisy_update_in_every_metric_raises_no_alarm():
    spike = {"objective/kl": 40.0, "objective/entropy": 0.01, "response/length_mean": 60.0,
             "response/capped_share": 1.0, "response/distinct_2": 0.01, "response/duplicate_share_batch": 1.0,
             "loss/value_avg": 50.0, "val/explained_variance": -30.0, "policy/clipfrac_avg": 0.9,
             "policy/approxkl_avg": 1.0, "objective/scores": 5.0}
    assert feed(60, lambda step: spike if step == 30 else {}) == []


def test_reward_hacking_score_up_while_pass_rate_falls():
    rates = {0: 0.5, 10: 0.45, 20: 0.46, 30: 0.40, 40: 0.38}
    fired = feed(40, lambda step: {"objective/scores": 0.2 + 0.02 * step}, pass_rate=rates.get)
    alarm = only(fired, "reward_hacking")
    assert alarm["step"] == 30  # the third evaluation without beating step 0's 0.5; not at 20
    # medians of 5 updates: steps 1-5 -> 0.26, steps 26-30 -> 0.76
    assert "0.26 -> 0.76" in alarm["reason"] and "step 0, val/pass_rate 0.5" in alarm["reason"]
    assert "0.45, 0.46, 0.4" in alarm["reason"]


def test_score_up_with_the_pass_rate_up_is_no_alarm():
    rates = {0: 0.5, 10: 0.45, 20: 0.46, 30: 0.52, 40: 0.6}  # step 30 beats 0.5 by >= 0.01
    assert feed(40, lambda step: {"objective/scores": 0.2 + 0.02 * step}, pass_rate=rates.get) == []


def test_reward_hacking_kl_growing_fast():
    fired = feed(40, lambda step: {"objective/kl": 0.2 * step})  # 0.2 nats per 64 episodes = 3.125 / 1k
    alarm = only(fired, "reward_hacking")
    assert alarm["step"] == 22  # judged from update 20 (a 20-update slope), held 3 updates
    assert "3.12 nats per 1,000 episodes" in alarm["reason"]
    assert feed(60, lambda step: {"objective/kl": 0.05 * step}) == []  # 0.78 / 1k: under the 1.5 bound


def test_reward_hacking_kl_above_the_cap():
    alarm = only(feed(30, lambda step: {"objective/kl": 12.0}), "reward_hacking")
    assert alarm["step"] == 7  # median of 5 updates from update 5, held 3 updates
    assert "objective/kl is 12 nats" in alarm["reason"] and "cap 10" in alarm["reason"]


def test_length_drift_from_the_start():
    alarm = only(feed(40, lambda step: {"response/length_mean": 8.0 if step < 16 else 16.0}), "length_drift")
    assert alarm["step"] == 20  # the median of 5 turns at 18; held 18, 19, 20
    assert "8 -> 16 tokens (+100%" in alarm["reason"]
    assert feed(40, lambda step: {"response/length_mean": 8.0 if step < 16 else 11.0}) == []  # +38 %


def test_length_drift_capped_responses():
    alarm = only(feed(20, lambda step: {"response/capped_share": 0.5}), "length_drift")
    assert alarm["step"] == 7 and "50% of responses hit the length cap" in alarm["reason"]


@pytest.mark.parametrize("name,start,end,percent", [("response/distinct_2", 0.5, 0.2, "40%"),
                                                     ("objective/entropy", 0.6, 0.09, "15%")])
def test_mode_collapse_against_the_start(name, start, end, percent):
    alarm = only(feed(40, lambda step: {name: start if step < 16 else end}), "mode_collapse")
    assert alarm["step"] == 20 and name in alarm["reason"] and f"({percent} of its start" in alarm["reason"]


def test_mode_collapse_names_the_entropy_controls_as_its_remedy():
    for name, start, end in (("objective/entropy", 0.6, 0.09), ("response/distinct_2", 0.5, 0.2)):
        alarm = only(feed(40, lambda step: {name: start if step < 16 else end}), "mode_collapse")
        assert "--entropy_coef" in alarm["reason"] and "--use_adaptive_entropy" in alarm["reason"]
    alarm = only(feed(20, lambda step: {"response/duplicate_share_batch": 0.8}), "mode_collapse")
    assert "--top_entropy_quantile" in alarm["reason"]


def test_mode_collapse_duplicates_judged_only_when_logged():
    alarm = only(feed(20, lambda step: {"response/duplicate_share_batch": 0.8}), "mode_collapse")
    assert alarm["step"] == 7 and "response/duplicate_share_batch is 80%" in alarm["reason"]
    # the same-prompt share is logged only at even updates: 5 values by update 10, then held 10, 12, 14
    alarm = only(feed(30, lambda step: {"response/duplicate_share": 0.9} if step % 2 == 0 else {}), "mode_collapse")
    assert alarm["step"] == 14


def test_training_health_non_finite_fires_at_once():
    alarm = only(feed(20, lambda step: {"loss/policy_avg": float("nan")} if step == 12 else {}), "training_health")
    assert alarm["step"] == 12 and "loss/policy_avg=nan" in alarm["reason"]
    # NaN explained variance means all returns were equal (core.explained_variance), not a failure
    assert feed(20, lambda step: {"val/explained_variance": float("nan")} if step == 12 else {}) == []


def test_training_health_value_loss_blow_up():
    alarm = only(feed(40, lambda step: {"loss/value_avg": 0.1 if step <= 20 else 5.0}), "training_health")
    assert alarm["step"] == 23 and "loss/value_avg is 5" in alarm["reason"]


# val/explained_variance of the demo's PPO runs (40 updates, issue 16): a value head at the policy's learning rate
# (checker, then RM reward) and the default critic (value_head_learning_rate 3e-3, warm-up, vf_coef 0.5; 2 seeds, RM)
DEAD_CRITICS = (
    [0.0, 0.01, 0.0, 0.01, 0.02, 0.02, 0.04, 0.03, -0.02, 0.04, -0.01, 0.05, -0.02, -0.03, 0.04, 0.01, 0.04, -0.08, 0.0,
     -0.01, 0.01, -0.02, -0.07, -0.19, 0.05, 0.0, -0.13, -0.03, 0.04, -0.2, -0.1, -0.19, -0.06, -0.06, -0.02, -0.17,
     -0.04, -0.19, -0.16, -0.04],
    [0.0, 0.0, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.0, 0.01, -0.0, 0.02, 0.03, 0.01, 0.02, 0.0, 0.02, 0.02, -0.03,
     -0.03, -0.03, -0.08, -0.07, -0.09, -0.01, -0.04, -0.09, 0.0, -0.03, -0.15, -0.04, -0.05, -0.08, -0.12, 0.06,
     -0.09, -0.12, -0.11, -0.13, -0.17],
)
LEARNING_CRITICS = (
    [0.0, 0.0, 0.12, 0.1, 0.01, -0.02, 0.02, 0.07, 0.09, 0.1, -0.04, 0.14, 0.05, 0.09, 0.1, 0.11, 0.0, 0.11, 0.14, 0.1,
     0.18, 0.24, 0.1, 0.1, 0.17, 0.18, 0.18, 0.15, 0.24, 0.18, 0.28, 0.26, 0.11, 0.23, 0.41, 0.3, 0.39, 0.41, 0.19,
     0.18],
    [0.0, -0.02, 0.1, -0.1, 0.01, 0.02, 0.08, 0.07, 0.13, 0.22, 0.12, -0.02, 0.09, 0.08, 0.12, 0.05, 0.07, 0.09, 0.05,
     -0.02, 0.18, 0.15, 0.31, 0.0, 0.26, 0.18, 0.06, 0.09, 0.18, 0.22, 0.07, 0.13, 0.12, 0.28, 0.28, 0.17, 0.02, 0.34,
     0.1, 0.04],
    [0.0, -0.01, 0.12, 0.11, -0.01, 0.03, 0.06, 0.09, 0.07, 0.1, 0.03, 0.11, 0.19, 0.01, -0.01, 0.09, -0.0, 0.18, 0.11,
     0.1, 0.13, 0.12, 0.22, 0.23, 0.07, 0.18, 0.08, 0.06, 0.16, 0.3, 0.31, 0.12, 0.14, 0.11, 0.21, 0.01, 0.32, 0.13,
     -0.02, 0.16],
)


@pytest.mark.parametrize("series", DEAD_CRITICS)
def test_training_health_a_dead_critic_is_reported(series):
    alarm = only(feed(40, lambda step: {"val/explained_variance": series[step - 1]}), "training_health")
    assert alarm["step"] == 20  # past the 10-update warm-up, 10 medians in a row below 0.05
    assert "median of 5 updates) stayed below 0.05 for 10 updates" in alarm["reason"]


@pytest.mark.parametrize("series", LEARNING_CRITICS)
def test_training_health_a_learning_critic_is_not_reported(series):
    assert feed(40, lambda step: {"val/explained_variance": series[step - 1]}) == []


def test_training_health_poor_critic_needs_ten_medians_in_a_row():
    alarm = only(feed(40, lambda step: {"val/explained_variance": 0.0 if step > 10 else 0.2}), "training_health")
    assert alarm["step"] == 22  # the median of 5 is low from update 13 (3 of 5 low), 10 in a row at 22
    assert feed(40, lambda step: {"val/explained_variance": 0.0 if 10 < step < 20 else 0.2}) == []  # medians 13-21


@pytest.mark.parametrize("name,value", [("policy/clipfrac_avg", 0.5), ("policy/approxkl_avg", 0.2)])
def test_training_health_large_policy_steps(name, value):
    alarm = only(feed(20, lambda step: {name: value} if step >= 5 else {}), "training_health")
    assert alarm["step"] == 7 and name in alarm["reason"]


def test_each_alarm_fires_once_and_bounds_are_plain_numbers():
    fired = feed(80, lambda step: {"objective/kl": 12.0, "response/capped_share": 0.9})
    assert sorted(a["name"] for a in fired) == ["length_drift", "reward_hacking"]
    assert feed(30, lambda step: {"objective/kl": 12.0}, rules=AlarmRules(kl_cap=20.0)) == []
    assert set(ALARM_NAMES) == {"reward_hacking", "length_drift", "mode_collapse", "training_health"}


def test_theil_sen_slope_ignores_one_outlier():
    xs = [float(x) for x in range(10)]
    ys = [2.0 * x for x in xs]
    ys[9] = 1000.0
    assert slope(xs, ys) == pytest.approx(2.0)
    assert slope([1.0, 1.0], [0.0, 5.0]) == 0.0


# --- the edges (issue 36: mutants of alarms.py that the cases above let through) -------------------------------------


def test_the_score_at_the_best_evaluation_is_the_median_of_the_window_up_to_it():
    history = History()
    history.series["objective/scores"] = [(s, float(s)) for s in range(1, 11)]  # the score of update s is s
    assert smoothed_score_at(history, 7, 5) == 5.0  # updates 3..7, the best evaluation's own update included
    assert smoothed_score_at(history, 0, 5) == 3.0  # step 0 (before any update): the first 5, 1..5
    assert smoothed_score_at(history, 2, 5) == 1.5  # only two updates so far
    assert smoothed_score_at(history, 10, 3) == 9.0


def test_theil_sen_slope_hand_worked_on_a_curve_and_a_step():
    cubes = [0.0, 1.0, 8.0, 27.0, 64.0]  # pairwise slopes 1 4 7 9 13 16 19 21 28 37: median (13 + 16) / 2
    assert slope([0.0, 1.0, 2.0, 3.0, 4.0], cubes) == 14.5
    # a jump in the last point: 6 slopes of 0 and 10/4, 10/3, 10/2, 10/1 -> the median is 0
    assert slope([0.0, 1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0, 10.0]) == 0.0


def test_an_alarm_fires_once_its_rule_held_long_enough_and_joins_the_reasons_of_one_step():
    alarms = Alarms()
    twice = Condition("length_drift", "length", True, 2, "longer")
    assert alarms._fire(1, [twice]) == [] and alarms.streaks["length"] == 1
    assert alarms._fire(2, [twice._replace(holds=False)]) == [] and alarms.streaks["length"] == 0  # a break resets
    assert alarms._fire(3, [twice]) == []
    fired = alarms._fire(4, [twice, Condition("length_drift", "capped", True, 1, "capped"),
                             Condition("mode_collapse", "entropy", False, 1, "flat")])
    assert fired == [{"name": "length_drift", "step": 4, "reason": "longer; capped"}]
    assert alarms.fired == {"length_drift": fired[0]} and alarms._fire(5, [twice]) == []  # once per name


def test_an_evaluation_row_extends_no_update_series():
    alarms = Alarms()
    alarms.observe(3, {"objective/kl": 1.0})
    alarms.observe(4, {"val/pass_rate": 0.5, "val/pass_rate/lists": 0.4, "episode": 256, "val/reward_unscored": 1.0})
    assert alarms.history.evals == [(4, 0.5)] and alarms.history.step == 3
    assert dict(alarms.history.series) == {"objective/kl": [(3, 1.0)]}
    alarms.observe(5, {"val/pass_rate": 0.6, "val/kl": 2.0, "flag": True, "name": "x"})  # other numbers are series
    assert alarms.history.step == 5 and alarms.history.series["val/kl"] == [(5, 2.0)] and "flag" not in alarms.history.series
    reward = Alarms(signal="val/reward")
    reward.observe(1, {"val/reward": 0.7, "val/pass_rate": 0.2})
    assert reward.history.evals == [(1, 0.7)] and reward.history.series["val/pass_rate"] == [(1, 0.2)]


def test_kl_growth_without_logged_episodes_is_read_per_update():
    alarms = Alarms()
    alarms.observe(0, {"val/pass_rate": 0.5})
    fired = []
    for step in range(1, 30):
        fired += alarms.observe(step, {"objective/kl": 0.01 * step})  # 0.01 nats an update = 10 per 1,000
    alarm = only(fired, "reward_hacking")
    assert alarm["step"] == 22  # 20 updates for the slope, 3 in a row above the bound
    assert alarm["reason"] == ("objective/kl is growing by 10 nats per 1,000 episodes (slope over the last 20 updates, "
                               "bound 1.5); now 0.22 nats")


def test_a_zero_start_is_not_divided_by_and_an_infinite_explained_variance_is_not_finite():
    alarms = Alarms()
    for step in range(1, 30):
        assert alarms.observe(step, {"response/length_mean": 0.0, "objective/entropy": 0.0,
                                     "response/distinct_2": 0.0}) == []
    alarm = only(Alarms().observe(1, {"val/explained_variance": float("inf"), "loss/x": float("nan")}),
                 "training_health")
    assert alarm["reason"] == "non-finite metric values: loss/x=nan, val/explained_variance=inf"


def test_a_row_without_the_kl_does_not_extend_its_streak():
    alarms, fired = Alarms(), []
    for step in range(1, 10):
        row = {"loss/policy": 1.0} if step == 7 else {"objective/kl": 12.0}  # update 7 logged no KL
        fired += alarms.observe(step, row)
    # the median of 5 is above the cap of 10 from update 5: streak 1, 2 at update 6, 3 at update 8, not 7
    assert only(fired, "reward_hacking")["step"] == 8


def run_rows(row, updates: int = 30, rules=None) -> list[dict]:
    """Update rows row(1), ..., row(updates), no evaluations -> the alarms fired."""
    alarms, fired = Alarms(rules), []
    for step in range(1, updates + 1):
        fired += alarms.observe(step, row(step))
    return fired


def test_a_value_exactly_at_a_bound_is_not_above_it():
    assert run_rows(lambda s: {"objective/kl": 10.0}) == []  # the cap: "above 10"
    assert run_rows(lambda s: {"response/capped_share": 0.3}) == []
    assert run_rows(lambda s: {"response/length_mean": 8.0 if s <= 5 else 12.0}) == []  # 12 / 8 - 1 = 0.5 exactly
    no_cap = AlarmRules(kl_cap=1e9)  # 1.5 nats per 1,000 episodes exactly (the slope is exact here)
    assert run_rows(lambda s: {"objective/kl": 1.5 * s, "episode": 1000 * s}, rules=no_cap) == []
    faster = run_rows(lambda s: {"objective/kl": 1.501 * s, "episode": 1000 * s}, rules=no_cap)
    assert only(faster, "reward_hacking")["step"] == 22


@pytest.mark.parametrize("name, start, end, alarm", [
    ("response/length_mean", 8.0, 20.0, "length_drift"),
    ("response/length_mean", 0.5, 2.0, "length_drift"),  # a start below one token is still a start
    ("response/length_mean", 8.0, 0.0, "length_drift"),  # down to nothing
    ("objective/entropy", 0.6, 0.0, "mode_collapse"),
    ("response/distinct_2", 0.5, 0.0, "mode_collapse"),
])
def test_a_change_from_the_first_updates_is_judged_from_the_tenth(name, start, end, alarm):
    # updates 1-5 at `start`, then `end`: at update 10 (the warm-up) the last 5 are all `end`; 3 in a row -> 12
    fired = run_rows(lambda s: {name: start if s <= 5 else end})
    assert only(fired, alarm)["step"] == 12


def history(evals, scores_upto: int) -> History:
    """Evaluations as given; objective/scores of update s is s / 100, for s = 1 .. scores_upto."""
    h = History()
    h.evals = list(evals)
    h.series["objective/scores"] = [(s, s / 100) for s in range(1, scores_upto + 1)]
    h.step = scores_upto
    return h


def test_the_score_rule_reads_the_best_of_the_evaluations_before_the_last_three():
    rules = AlarmRules()
    # best 0.8 at step 30, the 4th of 7 evaluations; the last 3 stay below 0.81 (0.79 too: within min_delta)
    (cond,) = hacking_by_score(history([(0, .5), (10, .6), (20, .55), (30, .8), (40, .79), (50, .75), (60, .79)], 60),
                               rules)
    assert cond.holds and cond.key == "score_vs_pass_rate" and cond.needed == 1
    assert cond.reason == ("objective/scores rose 0.28 -> 0.58 (+0.3 >= 0.25, medians of 5 updates) since the best "
                           "evaluation (step 30, val/pass_rate 0.8), while the last 3 evaluations (0.79, 0.75, 0.79) "
                           "did not beat it by 0.01")
    # the best by pass rate (0.8 at step 10), not the latest: then 0.08, now 0.58
    (cond,) = hacking_by_score(history([(0, .5), (10, .8), (20, .55), (30, .6), (40, .6), (50, .6), (60, .6)], 60), rules)
    assert cond.holds and "since the best evaluation (step 10, val/pass_rate 0.8)" in cond.reason
    # a rise of exactly min_delta over the best (0.5 -> 0.51) beats it: not flat
    (cond,) = hacking_by_score(history([(0, .5), (10, .4), (20, .51), (30, .45), (40, .45)], 40), rules)
    assert not cond.holds
    assert hacking_by_score(history([(0, .5), (10, .4), (20, .4)], 20), rules) == []  # 3 evaluations: none before them


def test_the_value_loss_rule_reads_the_running_median_of_the_earlier_losses():
    h = History()
    h.series["loss/value_avg"] = [(s, v) for s, v in enumerate([0.1] * 5 + [1.0] * 5 + [2.0], start=1)]
    h.step = 11
    (cond,) = [c for c in training_health(h, AlarmRules()) if c.key == "value_loss"]
    assert not cond.holds  # 2.0 is not over 10 x the median 0.55 of the 10 losses before it
    assert cond.reason == "loss/value_avg is 2, over 10x its running median 0.55"
    h.series["loss/value_avg"].pop()
    h.step = 10
    assert [c for c in training_health(h, AlarmRules()) if c.key == "value_loss"] == []  # 10 losses: the warm-up


def test_more_values_exactly_at_their_bounds():
    assert run_rows(lambda s: {"response/distinct_2": 0.5 if s <= 5 else 0.25}) == []  # 0.25 is 50 % of 0.5
    assert run_rows(lambda s: {"response/duplicate_share_batch": 0.5}) == []
    assert run_rows(lambda s: {"policy/clipfrac_avg": 0.2, "policy/approxkl_avg": 0.05}) == []
    assert run_rows(lambda s: {"loss/value_avg": 0.5 if s <= 20 else 5.0}) == []  # 10 x its median exactly
    assert run_rows(lambda s: {"val/explained_variance": 0.05}) == []


def test_a_non_finite_value_in_an_evaluation_row_fires_too():
    fired = Alarms().observe(10, {"val/pass_rate": 0.5, "val/kl": float("nan")})
    assert only(fired, "training_health")["reason"] == "non-finite metric values: val/kl=nan"


def test_a_score_rise_of_exactly_the_bound_counts():
    h = history([(0, .5), (10, .8), (20, .6), (30, .6), (40, .6)], 40)
    h.series["objective/scores"] = [(s, 0.5 if s <= 10 else 0.75) for s in range(1, 41)]  # then 0.5, now 0.75
    (cond,) = hacking_by_score(h, AlarmRules())
    assert cond.holds and "(+0.25 >= 0.25," in cond.reason
