"""Evaluation and diagnosis: held-out pass rates, training alarms, the stopping rule, the length-bias probe."""

from rlhflab.eval.alarms import ALARM_NAMES, AlarmRules, Alarms
from rlhflab.eval.kl import kl_to_reference
from rlhflab.eval.length_bias import length_bias_probe
from rlhflab.eval.monitor import RunMonitor
from rlhflab.eval.pass_rate import answer_and_check, eval_prompts, eval_verifier, evaluate, format_table, table_from_rows
from rlhflab.eval.stopping import StoppingRule, parse_alarm_names

__all__ = ["ALARM_NAMES", "AlarmRules", "Alarms", "RunMonitor", "StoppingRule", "answer_and_check", "eval_prompts",
           "eval_verifier", "evaluate", "format_table", "kl_to_reference", "length_bias_probe", "table_from_rows", "parse_alarm_names"]
