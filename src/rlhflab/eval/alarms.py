"""Training alarms: read the metric rows a PPO run logs and say, in words, what went wrong.

A rising reward score does not mean a better model (MISSION.md §6; FACTS.md "Reward
hacking, reproducible": the RM score kept rising while the held-out pass rate fell
from 0.71 to 0.36 and KL grew to 15.6 nats). Four alarms, each a few plain rules:

- reward_hacking   score up while the validation pass rate is flat or falling;
                   KL to the reference growing fast or above a cap
- length_drift     mean response length far from where it started; many capped responses
- mode_collapse    fewer distinct bigrams, many duplicate responses, entropy far below its start
- training_health  value loss blow-up, a critic that explains almost nothing, persistently large
                   policy steps (clip fraction, approx. KL), any non-finite metric

Pure Python over metric dicts (no torch): `Alarms.observe(step, row)` takes each row
as it is logged and returns the alarms that fired at that row. Noisy per-update
metrics are summarised by their median over `window` updates (KL's trend by a
Theil-Sen slope), and a condition must hold for `persist` consecutive updates, so one
noisy update does not fire; an alarm fires once per
name, at the first step its rule held long enough. Defaults are calibrated on the
tiny built-in runs (docs/reading-a-run.md "Alarms and stopping").
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from statistics import median
from typing import Callable, NamedTuple

ALARM_NAMES = ("reward_hacking", "length_drift", "mode_collapse", "training_health")


@dataclass(frozen=True)
class AlarmRules:
    """Thresholds of the alarms, as plain numbers. Updates are PPO updates (one rollout each)."""

    window: int = 5  # updates whose median stands for a noisy metric (robust to a one-update spike)
    warmup: int = 10  # updates before "vs its start" and "vs its median" rules apply
    persist: int = 3  # consecutive updates a per-update condition must hold to fire
    # reward_hacking
    score_rise_bound: float = 0.25  # objective/scores up by this (reward units) since the best evaluation ...
    hacking_evals: int = 3  # ... while this many evaluations in a row did not beat that best ...
    min_delta: float = 0.01  # ... by at least this much pass rate
    kl_window: int = 20  # updates in the (Theil-Sen) slope of objective/kl over episodes
    kl_rate_bound: float = 1.5  # nats per 1,000 episodes; healthy tiny runs <= 1.2 (batch 64), 1.6 once (batch 32)
    kl_cap: float = 10.0  # nats; healthy tiny runs stay below ~4, the hacked one reached 15.6
    # length_drift
    length_drift_bound: float = 0.5  # |length / start - 1| above this
    capped_share_bound: float = 0.3  # share of responses hitting the length cap without EOS
    # mode_collapse
    min_distinct_ratio: float = 0.5  # response/distinct_2 below this fraction of its start
    duplicate_share_bound: float = 0.5  # duplicate responses; a perfect policy's answers have ~0.2 in a 64 batch
    min_entropy_ratio: float = 0.2  # objective/entropy below this fraction of its start (healthy: >= 0.35)
    # training_health
    value_blowup_factor: float = 10.0  # loss/value_avg above this many times its running median
    # val/explained_variance (median of `window` updates) below this for `ev_persist` updates in a row, past
    # `warmup`: a critic that predicts almost nothing. Demo PPO, 40 updates (issue 16): a value head at the
    # policy's learning rate, medians -0.16..+0.03, below 0.05 for all 30 updates past warm-up (checker and RM
    # rewards); learning critics (value_head_learning_rate 3e-3 / 1e-2) at most 9 updates in a row below 0.05
    min_explained_variance: float = 0.05
    ev_persist: int = 10
    clipfrac_bound: float = 0.2  # policy/clipfrac_avg above this for `persist` updates (healthy: <= 0.07)
    approxkl_bound: float = 0.05  # policy/approxkl_avg above this for `persist` updates (healthy: single spikes)


class Condition(NamedTuple):
    """One rule's verdict at one row (a rule that cannot judge yet returns no Condition)."""

    name: str  # alarm it belongs to
    key: str  # the rule, for persistence counting
    holds: bool
    needed: int  # consecutive rows it must hold to fire
    reason: str


class History:
    """Per-update series (name -> [(step, value)]) and the evaluations' pass rates."""

    def __init__(self, signal: str = "val/pass_rate") -> None:
        self.series: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.signal = signal  # the held-out metric of `evals`: val/pass_rate, or val/reward without a verifier
        self.evals: list[tuple[int, float]] = []
        self.step = 0  # step of the latest update row

    def values(self, name: str) -> list[float]:
        """The series of `name`, or [] when the latest update row did not log it: a rule
        judges only metrics that were just logged, so a stale value never extends a streak."""
        points = self.series.get(name, [])
        return [v for _, v in points] if points and points[-1][0] == self.step else []


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def smoothed_score_at(history: History, step: int, window: int) -> float:
    """Median objective/scores of the `window` updates up to `step` (the first `window` for step 0)."""
    points = history.series["objective/scores"]
    upto = [v for s, v in points if s <= step][-window:]
    return median(upto or [v for _, v in points[:window]])


def hacking_by_score(h: History, r: AlarmRules) -> list[Condition]:
    """Score up by `score_rise_bound` since the best evaluation, while `hacking_evals` evaluations did not beat it."""
    if len(h.evals) <= r.hacking_evals or "objective/scores" not in h.series:
        return []
    before, recent = h.evals[: -r.hacking_evals], h.evals[-r.hacking_evals :]
    best_step, best = max(before, key=lambda e: e[1])
    flat = all(rate < best + r.min_delta - 1e-9 for _, rate in recent)
    then = smoothed_score_at(h, best_step, r.window)
    now = median([v for _, v in h.series["objective/scores"][-r.window :]])
    rise = now - then
    reason = (f"objective/scores rose {_fmt(then)} -> {_fmt(now)} (+{_fmt(rise)} >= {_fmt(r.score_rise_bound)}, "
              f"medians of {r.window} updates) since the best evaluation (step {best_step}, {h.signal} "
              f"{_fmt(best)}), while the last {r.hacking_evals} evaluations "
              f"({', '.join(_fmt(v) for _, v in recent)}) did not beat it by {_fmt(r.min_delta)}")
    return [Condition("reward_hacking", "score_vs_pass_rate", flat and rise >= r.score_rise_bound, 1, reason)]


def slope(xs: list[float], ys: list[float]) -> float:
    """Theil-Sen slope dy/dx: the median of all pairwise slopes, so one outlying point cannot
    fake a trend (a least-squares slope jumps with a single KL spike). 0 when x does not vary."""
    pairs = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs))
             if xs[j] != xs[i]]
    return median(pairs) if pairs else 0.0


def hacking_by_kl(h: History, r: AlarmRules) -> list[Condition]:
    """KL to the reference growing faster than `kl_rate_bound` nats / 1k episodes, or above `kl_cap`."""
    points = h.series.get("objective/kl", []) if h.values("objective/kl") else []
    out = []
    if len(points) >= r.window:
        now = median([v for _, v in points[-r.window :]])
        out.append(Condition("reward_hacking", "kl_cap", now > r.kl_cap, r.persist,
                             f"objective/kl is {_fmt(now)} nats (median of {r.window} updates), above the cap "
                             f"{_fmt(r.kl_cap)}"))
    if len(points) >= max(r.kl_window, r.warmup):
        episodes = dict(h.series.get("episode", []))
        last = points[-r.kl_window :]
        xs = [float(episodes.get(s, s)) for s, _ in last]
        rate = 1000 * slope(xs, [v for _, v in last])
        out.append(Condition("reward_hacking", "kl_rate", rate > r.kl_rate_bound, r.persist,
                             f"objective/kl is growing by {_fmt(rate)} nats per 1,000 episodes (slope over the "
                             f"last {r.kl_window} updates, bound {_fmt(r.kl_rate_bound)}); now "
                             f"{_fmt(last[-1][1])} nats"))
    return out


def versus_start(h: History, name: str, r: AlarmRules) -> tuple[float, float] | None:
    """(median of the first `window` values, of the last `window`) once past warm-up; None before."""
    xs = h.values(name)
    if len(xs) < max(r.warmup, r.window):
        return None
    return median(xs[: r.window]), median(xs[-r.window :])


def recent(h: History, name: str, r: AlarmRules) -> float | None:
    """Median of the last `window` values, once there are that many; None before (or if not just logged)."""
    xs = h.values(name)
    return median(xs[-r.window :]) if len(xs) >= r.window else None


def length_drift(h: History, r: AlarmRules) -> list[Condition]:
    """Mean length moved by more than `length_drift_bound` of its start; capped share above its bound."""
    out = []
    pair = versus_start(h, "response/length_mean", r)
    if pair and pair[0] > 0:
        start, now = pair
        change = now / start - 1
        out.append(Condition("length_drift", "length", abs(change) > r.length_drift_bound, r.persist,
                             f"response/length_mean moved {_fmt(start)} -> {_fmt(now)} tokens ({change:+.0%}, "
                             f"medians of {r.window} updates; bound +-{r.length_drift_bound:.0%})"))
    capped = recent(h, "response/capped_share", r)
    if capped is not None:
        out.append(Condition("length_drift", "capped", capped > r.capped_share_bound, r.persist,
                             f"{capped:.0%} of responses hit the length cap without EOS (median of {r.window} "
                             f"updates; bound {r.capped_share_bound:.0%})"))
    return out


# what answers a collapse (issue 37): the entropy controls of PPO, GRPO, RLOO, REINFORCE (docs/grpo-rloo-reinforce.md)
COLLAPSE_REMEDY = ("answer it with an entropy bonus (--entropy_coef, e.g. 0.001), adaptive entropy control "
                   "(--use_adaptive_entropy --entropy_target near the start's entropy) or --top_entropy_quantile 0.2")


def mode_collapse(h: History, r: AlarmRules) -> list[Condition]:
    """Distinct bigrams or entropy far below their start; many duplicate responses. Each reason names the remedy."""
    out = []
    for name, key, ratio in (("response/distinct_2", "distinct_2", r.min_distinct_ratio),
                             ("objective/entropy", "entropy", r.min_entropy_ratio)):
        pair = versus_start(h, name, r)
        if pair and pair[0] > 0:
            start, now = pair
            out.append(Condition("mode_collapse", key, now < ratio * start, r.persist,
                                 f"{name} fell {_fmt(start)} -> {_fmt(now)} ({now / start:.0%} of its start, "
                                 f"medians of {r.window} updates; bound {ratio:.0%}); {COLLAPSE_REMEDY}"))
    for name in ("response/duplicate_share_batch", "response/duplicate_share"):
        share = recent(h, name, r)
        if share is not None:
            out.append(Condition("mode_collapse", name, share > r.duplicate_share_bound, r.persist,
                                 f"{name} is {share:.0%} (median of its last {r.window} values; bound "
                                 f"{r.duplicate_share_bound:.0%}); {COLLAPSE_REMEDY}"))
    return out


def training_health(h: History, r: AlarmRules) -> list[Condition]:
    """Value-loss blow-up, a critic that explains almost nothing, persistently large policy steps."""
    out = []
    losses = h.values("loss/value_avg")
    if len(losses) > r.warmup:
        typical = median(losses[:-1])
        out.append(Condition("training_health", "value_loss", losses[-1] > r.value_blowup_factor * typical,
                             r.persist, f"loss/value_avg is {_fmt(losses[-1])}, over {_fmt(r.value_blowup_factor)}x "
                                        f"its running median {_fmt(typical)}"))
    ev = recent(h, "val/explained_variance", r)
    if ev is not None and len(h.values("val/explained_variance")) > r.warmup:
        out.append(Condition("training_health", "explained_variance", ev < r.min_explained_variance, r.ev_persist,
                             f"val/explained_variance (median of {r.window} updates) stayed below "
                             f"{_fmt(r.min_explained_variance)} for {r.ev_persist} updates (now {_fmt(ev)}): the "
                             f"critic predicts almost none of the returns' variance, so the advantages are little "
                             f"better than the raw returns (raise value_head_learning_rate or value_warmup_rollouts)"))
    for name, bound in (("policy/clipfrac_avg", r.clipfrac_bound), ("policy/approxkl_avg", r.approxkl_bound)):
        xs = h.values(name)
        if xs:
            out.append(Condition("training_health", name, xs[-1] > bound, r.persist,
                                 f"{name} stayed above {_fmt(bound)} for {r.persist} updates (now {_fmt(xs[-1])}): "
                                 f"policy steps too large (lower learning_rate or num_ppo_epochs)"))
    return out


# NaN by definition in a healthy run: explained variance when all returns are equal (core.explained_variance)
NAN_ALLOWED = ("val/explained_variance",)


def non_finite(metrics: dict) -> list[str]:
    """Names of float metrics that are NaN or infinite (a NaN in NAN_ALLOWED is not counted)."""
    return sorted(k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)
                  and not (math.isnan(v) and k in NAN_ALLOWED))


UPDATE_RULES: tuple[Callable[[History, AlarmRules], list[Condition]], ...] = (
    hacking_by_kl, length_drift, mode_collapse, training_health)
EVAL_RULES: tuple[Callable[[History, AlarmRules], list[Condition]], ...] = (hacking_by_score,)


class Alarms:
    """Feed it every logged row; it returns the alarms that fire at that row (each name once)."""

    def __init__(self, rules: AlarmRules | None = None, signal: str = "val/pass_rate"):
        self.rules = rules or AlarmRules()
        self.history = History(signal)
        self.streaks: dict[str, int] = defaultdict(int)
        self.fired: dict[str, dict] = {}

    def observe(self, step: int, metrics: dict) -> list[dict]:
        """Record `metrics` (an update row, an evaluation row or both) and run the rules it concerns."""
        conditions: list[Condition] = []
        bad = non_finite(metrics)
        if bad:
            conditions.append(Condition("training_health", "non_finite", True, 1,
                                        f"non-finite metric values: {', '.join(f'{k}={metrics[k]}' for k in bad)}"))
        numbers = {k: float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        signal = self.history.signal
        if signal in numbers:
            self.history.evals.append((step, numbers.pop(signal)))
            conditions += [c for rule in EVAL_RULES for c in rule(self.history, self.rules)]
            numbers = {k: v for k, v in numbers.items()
                       if not k.startswith(signal + "/") and k not in ("episode", "val/reward_unscored")}
        if numbers:
            self.history.step = step
            for key, value in numbers.items():
                self.history.series[key].append((step, value))
            conditions += [c for rule in UPDATE_RULES for c in rule(self.history, self.rules)]
        return self._fire(step, conditions)

    def _fire(self, step: int, conditions: list[Condition]) -> list[dict]:
        """Count consecutive holds per rule; an alarm fires once, when one of its rules held long enough."""
        reasons: dict[str, list[str]] = defaultdict(list)
        for c in conditions:
            self.streaks[c.key] = self.streaks[c.key] + 1 if c.holds else 0
            if self.streaks[c.key] >= c.needed and c.name not in self.fired:
                reasons[c.name].append(c.reason)
        new = []
        for name in ALARM_NAMES:
            if reasons.get(name):
                self.fired[name] = {"name": name, "step": step, "reason": "; ".join(reasons[name])}
                new.append(self.fired[name])
        return new
