"""RunMonitor: alarms + stopping rule behind the trainer's `Monitor` protocol.

The trainers layer sits below eval, so `rlhflab.trainers.ppo.train` only knows a
`Monitor` (observe / stop_reason); whoever calls it (cli, demo) builds this one
from the config and passes it in.
"""

from __future__ import annotations

from rlhflab.eval.alarms import AlarmRules, Alarms
from rlhflab.eval.stopping import StoppingRule, parse_alarm_names
from rlhflab.trainers.given import NOTHING, Given
from rlhflab.trainers.online.setup import held_out_metric


class RunMonitor:
    """Feeds every logged row to the alarms and the stopping rule; implements trainers' `Monitor`."""

    def __init__(self, rules: AlarmRules | None = None, stopping: StoppingRule | None = None,
                 signal: str = "val/pass_rate"):
        self.signal = signal  # val/pass_rate with a verifier, val/reward without one
        self.alarms = Alarms(rules, signal)
        self.stopping = stopping or StoppingRule(signal=signal)

    @classmethod
    def from_config(cls, cfg, given: Given = NOTHING) -> RunMonitor:
        """From a PPOConfig's alarm and stop_* fields (docs/reading-a-run.md "Alarms and stopping"), watching the
        held-out metric its verifier settings (or a verifier `given` in memory) give (`held_out_metric`)."""
        signal = held_out_metric(cfg, given)
        rules = AlarmRules(
            min_delta=cfg.stop_min_delta, score_rise_bound=cfg.score_rise_bound, kl_rate_bound=cfg.kl_rate_bound,
            kl_cap=cfg.kl_cap, length_drift_bound=cfg.length_drift_bound, capped_share_bound=cfg.capped_share_bound,
            min_distinct_ratio=cfg.min_distinct_ratio, duplicate_share_bound=cfg.duplicate_share_bound,
            min_entropy_ratio=cfg.min_entropy_ratio)
        stopping = StoppingRule(cfg.stop_patience, cfg.stop_min_delta, parse_alarm_names(cfg.stop_on_alarms), signal)
        return cls(rules, stopping, signal)

    def observe(self, step: int, metrics: dict) -> list[dict]:
        """Record one logged row (update or evaluation); returns the alarms that fired at it."""
        new = self.alarms.observe(step, metrics)
        if self.signal in metrics:
            self.stopping.observe_eval(step, float(metrics[self.signal]))
        self.stopping.observe_alarms(new)
        return new

    def stop_reason(self) -> str | None:
        return self.stopping.reason

    @property
    def fired(self) -> list[dict]:
        return list(self.alarms.fired.values())
