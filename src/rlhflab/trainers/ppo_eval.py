"""PPO's periodic check: validation pass rate, fixed prompts' answers as samples, and a console table.

The table (`console_samples` answers, every evaluation) is for the person watching: a rising
score with answers that read wrong is reward hacking caught by eye, long before the curves
say so. It goes through `logging` (logger "rlhflab", INFO), never into metrics, and is
independent of `progress`: turn it off with `console_samples 0` or by raising the log level.
"""

from __future__ import annotations

import io
import logging

from rlhflab import tasks
from rlhflab.tracking import RunDir
from rlhflab.trainers.validation import checked_answers, pass_rate_table

log = logging.getLogger("rlhflab")


class PPOEvaluator:
    """Same prompts and decoding at every evaluation, so the curve compares like with like."""

    def __init__(self, validation_items: list[tasks.TaskItem], tokenizer, cfg, run: RunDir):
        self.items = validation_items[: cfg.eval_prompts]
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.run = run

    def evaluate(self, policy, step: int, episode: int) -> dict:
        rows = checked_answers(policy, self.tokenizer, self.items, self.cfg)
        self.run.add_samples({"step": step, "episode": episode, **row} for row in rows[: self.cfg.sample_prompts])
        table = pass_rate_table(rows)
        metrics = {"val/pass_rate": table["overall"], "episode": episode,
                   **{f"val/pass_rate/{family}": rate for family, rate in table["per_family"].items()}}
        self.run.log(metrics, step=step)
        if self.cfg.console_samples > 0 and rows:
            title = f"update {step} (episode {episode}): validation pass rate {table['overall']:.1%}"
            log.info("sample answers\n%s", samples_table(rows[: self.cfg.console_samples], title))
        return metrics


def samples_table(rows: list[dict], title: str, width: int = 110) -> str:
    """A compact `rich` table (prompt, answer, verdict) rendered to plain text for the log.

    rich is imported here only; model text goes in as `Text`, so brackets in an answer are
    never read as rich markup.
    """
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("prompt", max_width=70, overflow="fold")
    table.add_column("answer", max_width=40, overflow="fold")
    table.add_column("verdict", no_wrap=True)
    for row in rows:
        verdict = "pass" if row["passed"] else f"FAIL {row.get('kind') or ''}".strip()
        table.add_row(Text(" ".join(row["prompt"].split())), Text(row["answer"]), Text(verdict))
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    console.print(table)
    return "\n".join(line.rstrip() for line in console.file.getvalue().splitlines() if line.strip())
