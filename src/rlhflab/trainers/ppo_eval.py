"""PPO's periodic check: validation pass rate, and fixed prompts' answers as samples."""

from __future__ import annotations

from rlhflab import tasks
from rlhflab.tracking import RunDir
from rlhflab.trainers.validation import validate_pass_rate


class PPOEvaluator:
    """Same prompts and decoding at every evaluation, so the curve compares like with like."""

    def __init__(self, validation_items: list[tasks.TaskItem], tokenizer, cfg, run: RunDir):
        self.items = validation_items[: cfg.eval_prompts]
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.run = run

    def evaluate(self, policy, step: int, episode: int) -> dict:
        table = validate_pass_rate(policy, self.tokenizer, self.items, self.cfg, step, self.run,
                                   sample_count=self.cfg.sample_prompts, episode=episode)
        metrics = {"val/pass_rate": table["overall"], "episode": episode,
                   **{f"val/pass_rate/{family}": rate for family, rate in table["per_family"].items()}}
        self.run.log(metrics, step=step)
        return metrics
