"""The commands that train nothing, as functions: evaluate a model, diagnose a reward model, write a report,
compare methods (`compare_methods` and `write_report`: rlhflab.compare and rlhflab.report are the packages). Each takes the config its command builds (`rlhflab <command> --help` lists the fields) and
returns what the command prints from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhflab.api.inputs import check_config
from rlhflab.config import CompareConfig, EvalConfig, RMDiagnoseConfig
from rlhflab.errors import UserInputError
from rlhflab.tracking import RunResult


def evaluate(args: EvalConfig) -> RunResult:
    """`rlhflab eval`: answer a split's (or your file's) prompts, check each answer; `.summary["pass_rate"]`."""
    from rlhflab.eval import evaluate as run_eval

    check_config(args, EvalConfig, "evaluate")
    return run_eval(args)


def diagnose(args: RMDiagnoseConfig) -> RunResult:
    """`rlhflab rm diagnose`: score the policy's own answers with the reward model; `.summary["rm_diagnosis"]`."""
    from rlhflab.eval.rm_diagnosis import diagnose as run_diagnose

    check_config(args, RMDiagnoseConfig, "diagnose")
    return run_diagnose(args)


def write_report(*run_dirs: str | Path, out: str | Path | None = None) -> Path:
    """`rlhflab report`: one run folder's report.html, or a page comparing several; returns the file written."""
    from rlhflab.report import check_run_folder, write_comparison
    from rlhflab.report import write_report as write_single

    if not run_dirs:
        raise UserInputError("no run folder given", "write_report",
                             "write_report('runs/ppo') or write_report('runs/a', 'runs/b')")
    folders = [check_run_folder(path) for path in run_dirs]  # every bad path is named before any work
    if len(folders) == 1:
        return write_single(folders[0], out)
    return write_comparison(folders, out or "comparison.html")


def compare_methods(args: CompareConfig, sections: dict[str, dict[str, Any]] | None = None) -> RunResult:
    """`rlhflab compare`: each method from the same model, prompts, seed and budget; `sections` are the
    per-method settings a --config file's sections give (e.g. {"ppo": {"learning_rate": 1e-5}})."""
    from rlhflab.compare import run_compare
    from rlhflab.compare.plan import plan_compare

    check_config(args, CompareConfig, "compare")
    return run_compare(plan_compare(args, sections or {}, "compare_methods(sections=...)"))
