"""An online run's periodic check on the validation prompts: the held-out signal, samples and a console table.

With a verifier (the suite's checker, or `--verifier`) the signal is `val/pass_rate` (and
`val/pass_rate/<family>` when rows have a `family` column). Without one it is `val/reward`,
the training reward's mean on the validation answers (missing-EOS penalty included): the
reward's own opinion of held-out answers, not an independent check. The report says so.

The table (`console_samples` answers, every evaluation) is for the person watching: a rising
score with answers that read wrong is reward hacking caught by eye, long before the curves
say so. It goes through `logging` (logger "rlhflab", INFO), never into metrics, and is
independent of `progress`: turn it off with `console_samples 0` or by raising the log level.
"""

from __future__ import annotations

import io
import logging
import random

from rlhflab import rewards
from rlhflab.data.prompt_rows import PromptRow
from rlhflab.tracking import RunDir
from rlhflab.trainers.validation import answer_rows_and_ids, pass_rate_table, verify_rows

log = logging.getLogger("rlhflab")


class Evaluator:
    """Same prompts and decoding at every evaluation, so the curve compares like with like."""

    def __init__(self, validation: list[PromptRow], tokenizer, cfg, run: RunDir,
                 verifier: rewards.Verifier | None, reward_fn=None, steps_per_update: int = 1):
        if verifier is None and reward_fn is None:
            raise ValueError("Evaluator needs a verifier or a reward source")
        self.rows = validation[: cfg.eval_prompts]
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.run = run
        self.verifier = verifier
        self.reward_fn = reward_fn
        self.steps_per_update = steps_per_update  # optimiser steps an update: the reward's trainer_state.global_step

    @property
    def signal(self) -> str:
        """The metric that validation, alarms, stopping and keep_best read."""
        return "val/pass_rate" if self.verifier is not None else "val/reward"

    def evaluate(self, policy, step: int, episode: int) -> dict:
        answered, ids = answer_rows_and_ids(policy, self.tokenizer, self.rows, self.cfg)
        if self.verifier is not None:
            answered = verify_rows(answered, self.rows, self.verifier)
            metrics, headline = self._pass_rates(answered)
        else:  # `step` updates are done: the reward functions are told so, as during training
            metrics, headline = self._rewards(answered, rewards.ScoreContext(ids, step * self.steps_per_update))
        self.run.add_samples({"step": step, "episode": episode, **row} for row in answered[: self.cfg.sample_prompts])
        metrics["episode"] = episode
        self.run.log(metrics, step=step)
        if self.cfg.console_samples > 0 and answered:
            title = f"update {step} (episode {episode}): {headline}"
            log.info("sample answers\n%s", samples_table(answered[: self.cfg.console_samples], title))
        return metrics

    def _pass_rates(self, answered: list[dict]) -> tuple[dict, str]:
        table = pass_rate_table(answered)
        families = table["per_family"] if len(table["per_family"]) > 1 or "all" not in table["per_family"] else {}
        metrics = {"val/pass_rate": table["overall"], **{f"val/pass_rate/{f}": r for f, r in families.items()}}
        return metrics, f"validation pass rate {table['overall']:.1%}"

    def _rewards(self, answered: list[dict], context: rewards.ScoreContext) -> tuple[dict, str]:
        out = rewards.as_scored(rewards.score(self.reward_fn, [a["prompt"] for a in answered],
                                              [a["answer"] for a in answered], self.rows[: len(answered)], context))
        penalty = self.cfg.missing_eos_penalty
        for row, score, valid in zip(answered, out.scores.tolist(), out.valid.tolist()):
            row["score"] = score - penalty * (not row["ended_with_eos"]) if valid else None
        scored = [a["score"] for a in answered if a["score"] is not None]
        mean = sum(scored) / len(scored) if scored else float("nan")
        metrics = {"val/reward": mean, "val/reward_unscored": len(answered) - len(scored)}
        return metrics, f"validation reward {mean:.3f} (the reward's own opinion: no verifier)"


def samples_table(rows: list[dict], title: str, width: int = 110) -> str:
    """A compact `rich` table (prompt, answer, verdict or score) rendered to plain text for the log.

    rich is imported here only; model text goes in as `Text`, so brackets in an answer are
    never read as rich markup. Its first import draws from Python's global RNG (rich/style.py:
    getrandbits(24)), which a user's reward function may read: the draw is undone, or a resumed run, whose
    first import comes after its RNGs were restored, would see another stream than the uninterrupted run.
    """
    state = random.getstate()
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    random.setstate(state)

    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("prompt", max_width=70, overflow="fold")
    table.add_column("answer", max_width=40, overflow="fold")
    table.add_column("verdict", no_wrap=True)
    for row in rows:
        table.add_row(Text(" ".join(row["prompt"].split())), Text(row["answer"]), Text(_verdict(row)))
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    console.print(table)
    return "\n".join(line.rstrip() for line in console.file.getvalue().splitlines() if line.strip())


def _verdict(row: dict) -> str:
    if "passed" in row:
        return "pass" if row["passed"] else f"FAIL {row.get('kind') or ''}".strip()
    return "unscored" if row.get("score") is None else f"score {row['score']:.3f}"
