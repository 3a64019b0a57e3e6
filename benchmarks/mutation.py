"""Mutation testing (issue 36): does the suite fail when the maths is wrong? mutmut 3.8.1, one module at a time.

    make mutation                                    # every module in MODULES, then the table
    make mutation MODULE=src/rlhflab/core/losses.py  # one
    .venv/bin/python benchmarks/mutation.py src/rlhflab/core/losses.py --rerun survived   # after adding tests

Modules are checked in groups (MODULES, GROUPS below); a group runs in its own folder, mutants/<group>/
(git-ignored): links to src/, tests/, pyproject.toml and the files tests read (README.md, configs/, docs/,
mkdocs.yml; mutmut copies them: `also_copy` in [tool.mutmut]), and mutmut's own state inside it. mutmut's settings
are [tool.mutmut] in pyproject.toml; this script adds the group's `only_mutate` and test selection. To look at one
mutant: `cd mutants/core && ../../.venv/bin/mutmut show NAME` (or `tests-for-mutant NAME`, `apply NAME`).

Pitfalls this script handles (measured, issue 36):
- a test that starts `python -m rlhflab...` in a subprocess imports the editable src/, never the mutated copy,
  unless PYTHONPATH points at mutants/src: set here for mutmut and everything it starts;
- tests that read README.md, configs/ or docs/ find them only through `also_copy`;
- a narrow test selection gives false survivors: each group lists the tests that exercise it (GROUPS);
- `mutmut print-time-estimates` run on its own re-collects and so wipes the test mapping: not used here.

The table (module, mutants, killed, judged equivalent, survived, timed out, no tests, minutes) goes to
mutants/table.md; survivors that docs/mutation.md names as "`NAME`: equivalent" count as equivalent.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "mutants"
NOTES = ROOT / "docs" / "mutation.md"
LINKED = ["src", "tests", "pyproject.toml", "README.md", "configs", "docs", "mkdocs.yml"]

# the tests each group of modules is checked against. A selection only narrows which tests mutmut maps to a
# function, so a narrow one can add survivors (which then want a unit test), never hide a kill: the maths of core/
# is held to its unit tests alone, the algorithm units to theirs plus the trainers' tiny-model tests
GROUPS: dict[str, list[str]] = {
    "core": ["tests/core"],
    # the trainers' tiny-model tests (test_grpo.py, test_rloo_reinforce.py) would add kills but make it ~10x slower
    "units": ["tests/core", "tests/trainers/test_algorithm_units.py", "tests/trainers/test_algorithm_units_rollout.py"],
    # narrowed from tests/core, tests/trainers, tests/invariants, tests/parallel to their unit tests: with the
    # trainers' tiny-model tests (test_grpo.py, test_ppo*.py, test_rlvr_controls.py, ...) each mutant ran ~10 s of
    # them on 2 shared cores (~3 hours for the 800 mutants), and the torchrun launches take minutes each;
    # test_online_units.py drives passes / state / ranks in-process with a stand-in algorithm and roles
    "online": ["tests/trainers/test_online_units.py", "tests/trainers/test_online_state.py",
               "tests/trainers/test_online_ranks_units.py", "tests/trainers/test_algorithm_units.py",
               "tests/parallel/test_parallel_units.py",
               *(f"tests/parallel/test_online_ranks.py::{name}" for name in (  # its unit tests, not its torchrun ones
                   "test_micro_batches_are_one_process_cut_shared_out_in_blocks_with_zero_weight_padding",
                   "test_a_global_batch_that_does_not_share_out_is_refused_with_sizes_that_do")),
               "tests/trainers/test_online_loop_unit.py",  # train_online itself, every collaborator stood in for
               "tests/trainers/test_online_loop_unit2.py"],
    # narrowed from tests/checkpoint to its unit-level files: its SIGKILL / SIGTERM tests start CLI subprocesses
    # (~45 s), and its tiny-model trainings and resumes (test_faults.py, test_resume.py, test_write_failures.py, ...)
    # made each surviving mutant of resume.py run ~30-80 s of them on 2 shared cores; check_layout's and
    # FollowerRun's tests are in test_parallel_units.py; test_signals_units.py joined later (signals.py; tests only
    # added, so the stored selection fingerprint was moved by hand, docs/mutation.md), test_signals.py's CLI runs not
    "checkpoint": ["tests/checkpoint/test_resume_units.py", "tests/checkpoint/test_state_units.py",
                   "tests/checkpoint/test_folder.py",
                   "tests/checkpoint/test_fingerprints.py", "tests/parallel/test_parallel_units.py",
                   "tests/checkpoint/test_signals_units.py"],
    # test_sft_unit.py joined later: tests only added, so mutmut's stored selection fingerprint was moved to this
    # one by hand (docs/mutation.md) rather than reset every verdict; its tests were traced as new ones
    "stages": ["tests/core", "tests/trainers/test_ppo_unit.py", "tests/trainers/test_online_dpo_unit.py",
               "tests/trainers/test_dpo_unit.py", "tests/trainers/test_algorithm_units.py",
               "tests/trainers/test_sft_unit.py",
               # joined for trainers/reward.py (tests only added, the fingerprint moved again): its unit tests and
               # the step-loss ones; its tiny-backbone tests (test_reward.py) made each of train()'s mutants run
               # ~12 trainings: 0.1 mutants a second, ~3 hours for the module on 2 cores
               "tests/trainers/test_reward_pass_fail.py", "tests/trainers/test_reward_units.py",
               "tests/trainers/test_reward_run_units.py", "tests/trainers/test_reward_data_units.py"],
    # tests/rewards alone (~15 s, its tiny GRPO runs included): tests/trainers and tests/cli (tiny-model training,
    # CLI subprocesses) would take hours on 2 cores; rewards/ has its own unit tests in tests/rewards
    "rewards": ["tests/rewards"],
    # narrowed from tests/eval, tests/trainers, tests/report, tests/test_intervals.py, tests/test_compare.py: their
    # tiny-model trainings, report demos and compare sweeps (two in tests/eval/test_headroom.py) took ~1 minute a
    # survivor of intervals.py under mutmut on 2 shared cores; these files (~30 s) test the eval modules,
    # intervals.py, the headroom probe and the online Monitor in-process
    "eval": ["tests/eval", "tests/test_intervals.py", "tests/trainers/test_run_watch.py",
             "tests/report/test_report_headroom.py", "tests/report/test_report_length_bias.py",
             *(f"--deselect=tests/eval/test_headroom.py::{name}" for name in (
                 "test_online_run_writes_the_start_policys_headroom_and_the_report_shows_it",
                 "test_eval_command_probes_the_validation_split"))],
}
# module -> its group; modules of a group share one folder, mutants/<group>/, and one collection of which test
# calls which function (mutmut's "stats", the slow part: the whole selection once, traced)
MODULES: dict[str, str] = {
    "src/rlhflab/core/losses.py": "core",
    "src/rlhflab/core/advantages.py": "core",
    "src/rlhflab/core/kl.py": "core",
    "src/rlhflab/core/importance.py": "core",
    "src/rlhflab/core/masked.py": "core",
    "src/rlhflab/core/entropy.py": "core",
    "src/rlhflab/core/shaping.py": "core",
    "src/rlhflab/core/logprobs.py": "core",
    "src/rlhflab/trainers/grpo.py": "units",
    "src/rlhflab/trainers/rloo.py": "units",
    "src/rlhflab/trainers/reinforce.py": "units",
    "src/rlhflab/trainers/online/clipped.py": "units",
    "src/rlhflab/trainers/ppo.py": "stages",
    "src/rlhflab/trainers/online_dpo.py": "stages",
    "src/rlhflab/trainers/dpo.py": "stages",
    "src/rlhflab/trainers/reward.py": "stages",
    "src/rlhflab/trainers/sft.py": "stages",
    "src/rlhflab/trainers/online/passes.py": "online",
    "src/rlhflab/trainers/online/state.py": "online",
    "src/rlhflab/trainers/online/ranks.py": "online",
    "src/rlhflab/trainers/online/loop.py": "online",
    "src/rlhflab/checkpoint/resume.py": "checkpoint",
    "src/rlhflab/checkpoint/state.py": "checkpoint",
    "src/rlhflab/checkpoint/ranks.py": "checkpoint",
    "src/rlhflab/checkpoint/signals.py": "checkpoint",
    "src/rlhflab/rewards/functions.py": "rewards",
    "src/rlhflab/rewards/checker.py": "rewards",
    "src/rlhflab/rewards/combine.py": "rewards",
    "src/rlhflab/rewards/deadline.py": "rewards",
    "src/rlhflab/rewards/base.py": "rewards",
    "src/rlhflab/intervals.py": "eval",
    "src/rlhflab/eval/stopping.py": "eval",
    "src/rlhflab/eval/alarms.py": "eval",
    "src/rlhflab/eval/length_bias.py": "eval",
    "src/rlhflab/eval/headroom.py": "eval",
    "src/rlhflab/eval/monitor.py": "eval",
    "src/rlhflab/eval/pass_rate.py": "eval",
    "src/rlhflab/trainers/headroom.py": "eval",
    "src/rlhflab/trainers/online/monitor.py": "eval",
}


def dotted(module: str) -> str:
    """src/rlhflab/core/losses.py -> rlhflab.core.losses, the prefix of its mutants' names."""
    return module.removeprefix("src/").removesuffix(".py").replace("/", ".")


def workdir(group: str) -> Path:
    """mutants/<group>/ with links to what mutmut copies; the group's mutmut state lives in it."""
    work = OUT / group
    work.mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        link = work / name
        if not link.is_symlink() and (ROOT / name).exists():
            link.symlink_to(ROOT / name)
    return work


def child(group: str, names: list[str], max_children: int) -> None:
    """Inside mutants/<group>/: mutmut's `run` with the group's modules and test selection."""
    from mutmut import __main__ as mutmut_main
    from mutmut.configuration import config

    cfg = config()
    cfg.only_mutate = [m for m, g in MODULES.items() if g == group]
    cfg.pytest_add_cli_args_test_selection = list(GROUPS[group])
    mutmut_main.cli(["run", "--max-children", str(max_children), *names], prog_name="mutmut")


def statuses(module: str) -> tuple[dict[str, str], float]:
    """{mutant name: mutmut's verdict} of a module's last run, and its mutants' test seconds added up."""
    from mutmut.stats import status_by_exit_code

    meta = OUT / MODULES[module] / "mutants" / (module + ".meta")
    if not meta.exists():
        return {}, 0.0
    data = json.loads(meta.read_text())
    return ({name: status_by_exit_code[code] for name, code in data["exit_code_by_key"].items()},
            sum(data["durations_by_key"].values()))


def judged_equivalent() -> set[str]:
    """Survivors docs/mutation.md names as "`NAME`: equivalent" (or "message only")."""
    if not NOTES.exists():
        return set()
    return set(re.findall(r"`([^`\s]+__mutmut_\d+)`:\s*(?:equivalent|message only)", NOTES.read_text()))


def run_group(group: str, names: list[str], max_children: int) -> float:
    work = workdir(group)
    # on PYTHONPATH from the start: a folder missing when Python starts stays unimportable in that process (its
    # path finder is cached as None), and the tests would then import the editable src/ and record nothing
    (work / "mutants" / "src").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE",
           # subprocess tests (python -m rlhflab ...) must import the mutated copy, not the editable src/
           "PYTHONPATH": os.pathsep.join(p for p in [str(work / "mutants" / "src"), os.environ.get("PYTHONPATH")] if p)}
    start = time.monotonic()
    code = [sys.executable, str(Path(__file__).resolve()), "--child", group, "--max-children", str(max_children),
            "--mutants", *names]
    done = subprocess.run(code, cwd=work, env=env)
    if done.returncode != 0:
        sys.exit(f"mutmut failed on group {group} (exit {done.returncode}); its state is in {work}")
    return time.monotonic() - start


def record_minutes(group: str, modules: list[str], seconds: float, rerun: bool) -> None:
    """mutants/<group>/minutes.json: the run's wall time shared among its modules by their mutants (a rerun adds)."""
    saved = OUT / group / "minutes.json"
    minutes = json.loads(saved.read_text()) if saved.exists() else {}
    counts = {m: len(statuses(m)[0]) for m in modules}
    for module, count in counts.items():
        share = seconds / 60 * count / max(sum(counts.values()), 1)
        minutes[module] = (minutes.get(module, 0.0) if rerun else 0.0) + share
    saved.write_text(json.dumps(minutes, indent=1))


def table(modules: list[str]) -> str:
    equivalent = judged_equivalent()
    lines = ["| module | mutants | killed | equivalent | survived | timeout | no tests | minutes |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    survivors = []
    for module in modules:
        status, _ = statuses(module)
        saved = OUT / MODULES[module] / "minutes.json"
        minutes = json.loads(saved.read_text()).get(module, 0.0) if saved.exists() else 0.0
        if not status:
            continue
        count = Counter(status.values())
        left = sorted(n for n, s in status.items() if s != "killed" and n not in equivalent)
        judged = sum(1 for n, s in status.items() if s != "killed" and n in equivalent)
        lines.append(f"| {module.removeprefix('src/rlhflab/')} | {len(status)} | {count['killed']} | {judged} | "
                     f"{count['survived'] - judged} | {count['timeout']} | {count['no tests']} | {minutes:.1f} |")
        survivors += [f"- `{n}`: {status[n]}" for n in left]
    return "\n".join(lines + ["", "Not killed and not judged equivalent:", ""] + (survivors or ["- none"])) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", help="paths of MODULES (default: all of them)")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rerun", choices=["survived"], help="run a module's survivors (and untested mutants) again, after new tests")
    parser.add_argument("--mutants", nargs="*", default=[], help="only these mutant names (globs allowed)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.mutants, args.max_children)
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        sys.exit(f"not in benchmarks/mutation.py's MODULES: {unknown}; known: {', '.join(MODULES)}")
    modules = args.modules or list(MODULES)
    for group in dict.fromkeys(MODULES[m] for m in modules):
        names = list(args.mutants)
        mine = [m for m in modules if MODULES[m] == group]
        if args.rerun:
            names += [n for m in mine for n, s in statuses(m)[0].items() if s in ("survived", "no tests")]
            if not names:
                print(f"{group}: nothing {args.rerun}")
                continue
        elif not names and len(mine) < sum(g == group for g in MODULES.values()):
            names = [dotted(m) + ".*" for m in mine]  # the group's other modules keep their results
        seconds = run_group(group, names, args.max_children)
        print(f"group {group}: {seconds / 60:.1f} minutes wall")
        record_minutes(group, mine, seconds, rerun=bool(args.rerun or args.mutants))
    (OUT / "table.md").write_text(table(modules))
    print(f"\n{(OUT / 'table.md').read_text()}\n(written to {OUT / 'table.md'})")


if __name__ == "__main__":
    main()
