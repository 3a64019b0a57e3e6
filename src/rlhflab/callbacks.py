"""Callbacks: a script or notebook watching a run as it goes (TRL's `TrainerCallback` names where they fit).

    class Plot(rlhflab.Callback):
        def on_log(self, logs, step):
            losses.append(logs.get("loss"))

    rlhflab.GRPOTrainer(..., callbacks=[Plot()]).train()

Every row a run writes to metrics.jsonl reaches `on_log`; a row of held-out numbers (all its keys `val/...`)
reaches `on_evaluate` as well; the summary reaches `on_train_end` when the run closes. They are
called on the process that writes the run folder (rank 0), after the row is on disk; an exception inside
one stops the run like any other error.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class Callback:
    """Override what you need; every method does nothing by default."""

    def on_log(self, logs: dict[str, Any], step: int) -> None:
        """Each logged row (training metrics, evaluations), `step` being its optimiser step or update."""

    def on_evaluate(self, metrics: dict[str, Any], step: int) -> None:
        """Each row of held-out metrics (`val/...`)."""

    def on_train_end(self, summary: dict[str, Any]) -> None:
        """The run's summary.json as it stands when the run folder is closed."""


def is_evaluation(metrics: dict[str, Any]) -> bool:
    """A row of held-out numbers: every key `val/...` but the episode count (an update's own rows also carry
    some `val/` names, e.g. TRL's `val/num_eos_tokens`, beside their training metrics)."""
    keys = [key for key in metrics if key != "episode"]
    return bool(keys) and all(key.startswith("val/") for key in keys)


class CallbackSink:
    """The callbacks as one of a run folder's metric sinks (`tracking.RunDir`)."""

    def __init__(self, callbacks: Sequence[Callback], run_path: Path):
        self.callbacks, self.run_path = list(callbacks), run_path

    def log(self, metrics: dict[str, Any], step: int) -> None:
        held_out = is_evaluation(metrics)
        for callback in self.callbacks:
            callback.on_log(dict(metrics), step)
            if held_out:
                callback.on_evaluate(dict(metrics), step)

    def close(self) -> None:
        summary_file = self.run_path / "summary.json"
        summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
        for callback in self.callbacks:
            callback.on_train_end(summary)
