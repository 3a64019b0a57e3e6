"""The stopping rule: end a run whose validation pass rate stopped improving, or that raised an alarm.

The seeds' PPO with a learned RM did not raise the held-out pass rate at 400 or
1,600 episodes (MISSION.md); a user should see that quickly and stop. Patience is
counted in evaluations (every `eval_every` updates), not in updates: the pass rate
is the only trustworthy signal, and it is measured only then.
"""

from __future__ import annotations

from collections.abc import Iterable

from rlhflab.errors import UserInputError
from rlhflab.eval.alarms import ALARM_NAMES


def parse_alarm_names(text: str, where: str = "stop_on_alarms") -> tuple[str, ...]:
    """'reward_hacking, mode_collapse' -> names; 'all' -> every alarm; '' -> none."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if names == ("all",):
        return ALARM_NAMES
    unknown = [n for n in names if n not in ALARM_NAMES]
    if unknown:
        raise UserInputError(f"unknown alarm name(s) {', '.join(unknown)}", where,
                             f"use a comma-separated subset of {', '.join(ALARM_NAMES)}, or all")
    return names


class StoppingRule:
    """Stop after `patience` evaluations in a row without a rise of `min_delta` over the best pass rate.

    The first evaluation (step 0) sets the best; an evaluation improves when its pass
    rate >= best + min_delta, and then becomes the best. patience=0 never stops on the
    pass rate. Independently, the first alarm whose name is in `stop_on` stops the run.
    """

    def __init__(self, patience: int = 0, min_delta: float = 0.01, stop_on: Iterable[str] = (),
                 signal: str = "val/pass_rate"):
        if patience < 0 or min_delta < 0:
            raise UserInputError(f"stop_patience ({patience}) and stop_min_delta ({min_delta}) must be >= 0",
                                 "stop_patience / stop_min_delta")
        self.patience = patience
        self.min_delta = min_delta
        self.stop_on = tuple(stop_on)
        self.signal = signal  # the held-out metric it watches (val/reward when there is no verifier)
        self.best: tuple[int, float] | None = None  # (step, pass rate) of the last improvement
        self.since_best: list[tuple[int, float]] = []  # evaluations after it
        self.reason: str | None = None

    def observe_eval(self, step: int, pass_rate: float) -> None:
        if self.best is None or pass_rate >= self.best[1] + self.min_delta - 1e-9:
            self.best, self.since_best = (step, pass_rate), []
            return
        self.since_best.append((step, pass_rate))
        if self.patience and len(self.since_best) >= self.patience and self.reason is None:
            seen = ", ".join(f"{rate:.3g} (step {s})" for s, rate in self.since_best)
            self.reason = (f"{self.signal} did not rise by {self.min_delta:.3g} over its best {self.best[1]:.3g} "
                           f"(step {self.best[0]}) in {self.patience} evaluations: {seen}")

    def observe_alarms(self, alarms: Iterable[dict]) -> None:
        for alarm in alarms:
            if alarm["name"] in self.stop_on and self.reason is None:
                self.reason = f"alarm {alarm['name']} (stop_on_alarms): {alarm['reason']}"
