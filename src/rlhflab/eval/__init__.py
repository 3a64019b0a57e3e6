"""Evaluation and diagnosis: held-out pass rates (alarms and probes come later)."""

from rlhflab.eval.pass_rate import answer_and_check, eval_items, evaluate, format_table, table_from_rows

__all__ = ["answer_and_check", "eval_items", "evaluate", "format_table", "table_from_rows"]
