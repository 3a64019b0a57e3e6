"""`rlhflab <stage> --config file.yaml --field value`.

Stages: demo, sft, eval, rm, rm diagnose, ppo, grpo, rloo, reinforce, online-dpo, dpo, compare, tasks export,
report, sweep, chain (several stages in one process or launch). `rlhflab <stage> --help` lists every field with
its default and help.

Exit codes: 0 done; 2 a user mistake (the message says what, where, what to do); 3 stopped
by a non-finite loss / gradient / reward (no checkpoint after it); 130 / 143 SIGINT / SIGTERM:
the current step finished and a checkpoint was written (continue with `--resume latest`);
4 a second SIGINT / SIGTERM: exited at once, the last complete checkpoint untouched
(docs/reading-a-run.md "Checkpoints and resume"); 5 a checkpoint, model folder or history file could not be
written (disk full, I/O error: the message names it, the last complete checkpoint and the command that resumes);
6 several processes: another rank ended (killed, out of memory, its own error) and this one stopped (the line
names the rank, how it ended when this host can see it, and the last complete checkpoint);
1 `rlhflab compare`: a method failed (the others ran; its error is in summary.json).
"""

from __future__ import annotations

import os

# Must precede the first torch import: with OpenMP's default spin-waiting, 2 torch
# threads on a 2-vCPU machine ran 5-6x slower (../shared/FACTS.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import contextlib  # noqa: E402
import difflib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from rlhflab.config import STAGES, field_names, parse_config  # noqa: E402
from rlhflab.errors import (PEER_LOST_EXIT_CODE, WRITE_FAILED_EXIT_CODE, Interrupted, StageFailed,  # noqa: E402
                            UserInputError, WriteFailed)
# (torch-free: `--help` stays fast)

USAGE = """usage: rlhflab <stage> [--config FILE.yaml] [--field value ...]

stages:
  demo           tiny model -> SFT -> PPO (checker) and RM -> PPO (RM) -> held-out pass rates, on a CPU
  sft            supervised fine-tuning (completion-only loss)
  eval           generate answers to a split's prompts and check them
  rm             reward model: Bradley-Terry on (prompt, chosen, rejected) pairs
  rm diagnose    score the policy's own answers: reward of passing vs failing, correlation, AUC
  ppo            PPO-RLHF: policy, reference, reward (checker, model or your functions) and value
  grpo           GRPO: k answers per prompt, group-normalised advantages, no critic (TRL's variants as options)
  rloo           RLOO: k answers per prompt, leave-one-out baseline, no critic
  reinforce      REINFORCE with a baseline (batch mean, moving average or leave-one-out), no critic
  online-dpo     on-policy DPO: k answers per prompt ranked by the reward, best vs worst, repeated
  dpo            DPO / IPO / SimPO on preference pairs (the suite's or a file's); reference log-probs once
  tasks export   write the built-in suite as JSONL (sft / pairs / prompts per split)
  report         RUN_DIR -> RUN_DIR/report.html; RUN_A RUN_B ... [--out FILE] -> one page comparing the runs
  sweep          --stage ppo --vary cliprange=0.1,0.2,0.3 [--out DIR]: one run per value, all else fixed,
                 then DIR/comparison.html and a table (`rlhflab sweep --help`)
  chain          STAGE [fields] then STAGE [fields] ...: stages one after another in this process (under torchrun:
                 one start-up and one process group for all), e.g. chain sft --config a.yaml then rm --config b.yaml
  compare        --model SFT_DIR --methods ppo,grpo,dpo [--budget episodes=N|seconds=S]: each method from the same
                 model, prompts, seed and budget; the same test and KL; DIR/report.html side by side

`rlhflab <stage> --help` lists every field with its default and help; `rlhflab --version` prints the version.
"""


def print_report(run_dir: Path, cfg) -> None:
    """Each command that writes a run folder ends with its report.html (unless `--write_report false`). The run's
    files are already written, so a failure here is logged with the command to retry rather than turning a
    finished run into an error."""
    from rlhflab.report import write_report

    if launched_rank()[0] > 0 or not cfg.write_report:  # several processes: rank 0 writes the run folder and report
        return
    try:
        print(f"report: {write_report(run_dir)}")
    except Exception as err:  # noqa: BLE001
        logging.getLogger("rlhflab").warning(
            "report not written (%s: %s); retry with `rlhflab report %s`", type(err).__name__, err, run_dir)


def run_demo(cfg) -> int:
    from rlhflab.compare import format_compare_table, run_demo_with_comparison as demo
    from rlhflab.demo.clock import describe_clock
    from rlhflab.eval import format_table
    from rlhflab.eval.pass_rate import CELL, describe_versus

    result = demo(cfg)  # the demo, then with --compare the methods compared from its SFT model
    summary = result.summary
    demo_tables = {name: t for name, t in summary["test_tables"].items() if not name.startswith("compare/")}
    print(format_table(demo_tables, title=f"test pass rate ({summary['decoding']})"))  # compare's: its own table
    if summary.get("test_rm_score"):
        scores = summary["test_rm_score"]
        print(f"{'RM score':<12}  " + "  ".join(f"{scores[name]:>{CELL}.2f}" for name in demo_tables))
    for line in describe_versus(summary.get("test_vs_sft") or {}, "sft", sum(demo_tables["sft"]["counts"].values())):
        print(line)  # each RL model vs SFT: the paired interval says whether the gain is more than noise
    for name, kl in summary["kl_to_reference"].items():
        print(f"KL to the reference at the end of {name}: {kl:.2f} nats per response")
    if summary.get("rm"):
        rm = summary["rm"]
        print(f"reward model: test pairwise accuracy {rm['test_accuracy']:.1%}, margin {rm['margin']:.2f}; on the SFT "
              f"policy's own answers reward passing {rm['mean_reward_passing']:.2f} vs failing "
              f"{rm['mean_reward_failing']:.2f}, correlation with pass/fail {rm['pass_fail_correlation']:.3f}")
        if rm.get("recipe_chosen_on"):  # the test split is read once, here; validation chose the recipe
            print(f"  (its recipe was chosen on the {rm['recipe_chosen_on']} split; validation pairwise accuracy "
                  f"{rm['validation_accuracy']:.1%} in this run)")
    if summary.get("headroom_verdict"):  # each family's test gain read against the SFT model's headroom
        print("\ngain against headroom (RUN/headroom.json, validation):\n" + "\n".join(summary["headroom_verdict"]))
    if summary.get("compare"):
        compared = result.run_dir / "compare"
        print(f"\nmethods compared from the SFT model ({compared}):")
        print(format_compare_table(json.loads((compared / "summary.json").read_text())))
        print("\n".join(summary["compare"]["verdict"]))
    print(f"\nrun folder: {result.run_dir}   wall time: {summary['wall_time_s']['total']:.0f} s")
    for line in describe_clock(summary):  # the demo's clock split, a stage run beside the others with its own seconds
        print(line)
    print_report(result.run_dir, cfg)
    return 0


def run_sft(cfg) -> int:
    from rlhflab.api import run_stage

    result = run_stage("sft", cfg)
    validation = result.summary.get("validation", {})
    print(f"model: {result.model_dir}")
    print("validation: " + ", ".join(f"{k} {v:.3f}" for k, v in validation.items()))
    print_report(result.run_dir, cfg)
    return 0


def run_eval(cfg) -> int:
    from rlhflab.eval import evaluate, format_table
    from rlhflab.eval.headroom import check_headroom_fields, probe_saved_model
    from rlhflab.trainers.headroom import format_headroom

    check_headroom_fields(cfg)
    result = evaluate(cfg)
    print(format_table({Path(cfg.model).name or cfg.model: result.summary["pass_rate"]}, title=f"{cfg.split} pass rate"))
    if cfg.samples_per_prompt > 1:
        print("\n" + format_headroom(probe_saved_model(cfg, result.run_dir)))
    print(f"\nanswers and verdicts: {result.run_dir / 'samples.jsonl'}")
    print_report(result.run_dir, cfg)
    return 0


def run_tasks_export(cfg) -> int:
    from rlhflab import tasks

    kinds = [k.strip() for k in cfg.pair_kinds.split(",") if k.strip()] or None
    for kind in kinds or []:
        if kind not in tasks.VIOLATION_KINDS:
            close = difflib.get_close_matches(kind, tasks.VIOLATION_KINDS, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"choose from {', '.join(tasks.VIOLATION_KINDS)}"
            raise UserInputError(f"unknown violation kind '{kind}'", "--pair_kinds", hint)
    out = Path(cfg.output_dir or "data/suite")
    written = tasks.export_suite(
        out, seed=cfg.split_seed, train=cfg.num_train_prompts, validation=cfg.num_validation_prompts,
        test=cfg.num_test_prompts, sft_examples=cfg.sft_examples, violation_fraction=cfg.violation_fraction,
        dominant_share=cfg.dominant_share, pair_kinds=kinds, pairs_per_prompt=cfg.pairs_per_prompt,
    )
    for name, path in written.items():
        print(f"{name:>22}  {path}")
    return 0


def run_rm(cfg) -> int:
    from rlhflab.api import run_stage

    result = run_stage("rm", cfg)
    for split, m in result.summary["pairs"].items():
        print(f"{split:>10}: pairwise accuracy {m['accuracy']:.1%}, margin {m['margin']:.2f} ({m['pairs']} pairs)")
    print(f"reward model: {result.model_dir}")
    print_report(result.run_dir, cfg)
    return 0


def run_rm_diagnose(cfg) -> int:
    from rlhflab.eval.length_bias import describe as describe_length_bias
    from rlhflab.eval.rm_diagnosis import diagnose

    result = diagnose(cfg)
    d = result.summary["rm_diagnosis"]
    print(f"{d['answers']} answers of the policy on {cfg.split} (pass rate {d['pass_rate']:.1%}):")
    print(f"  mean reward passing {d['mean_reward_passing']:.2f} vs failing {d['mean_reward_failing']:.2f}")
    if d["pass_rate"] in (0.0, 1.0):
        print(f"  point-biserial correlation and ROC-AUC undefined: {'no' if d['pass_rate'] == 0 else 'every'} "
              "answer passed (more samples per prompt, or a stronger policy)")
    else:
        print(f"  point-biserial correlation with pass/fail {d['point_biserial']:.3f}, ROC-AUC {d['roc_auc']:.3f}")
    print(describe_length_bias(result.summary["length_bias"]))
    print(f"worst cases: {result.run_dir / 'worst_cases.md'}")
    print_report(result.run_dir, cfg)
    return 0


def online_command(stage: str):
    """`rlhflab ppo | grpo | rloo | reinforce | online-dpo`: one online algorithm through the shared loop, then its report."""

    def run(cfg) -> int:
        from rlhflab.api import run_stage

        result = run_stage(stage, cfg)  # the Python API's call: alarms and stopping from the config
        print(online_result_lines(result.summary))
        print(f"model: {result.model_dir}")
        print_report(result.run_dir, cfg)
        return 0

    return run


def online_result_lines(summary: dict) -> str:
    """The held-out start -> end, KL and speed of an online run, its alarms, early stop and restored best."""
    held_out = "val/pass_rate" if "validation_pass_rate" in summary else "val/reward"
    name, fmt = ("validation pass rate", "{:.1%}") if held_out == "val/pass_rate" else ("validation reward", "{:.3f}")
    numbers = summary.get("validation_pass_rate") or summary.get("validation_reward")
    final = summary["final"]
    lines = [f"{name} {fmt.format(numbers['start'])} -> {fmt.format(numbers['end'])}; final KL "
             f"{final['objective/kl']:.2f} nats; {final['eps'] or 0:.0f} episodes/s"]
    lines += [f"alarm {a['name']} at update {a['step']}: {a['reason']}" for a in summary.get("alarms", [])]
    if summary.get("stopped"):
        lines.append(f"stopped early at update {summary['stopped']['step']}: {summary['stopped']['reason']}")
    if summary.get("budget_stop"):
        stop = summary["budget_stop"]
        lines.append(f"max_seconds {stop['max_seconds']:g} spent at update {stop['step']} (episode {stop['episode']})")
    best = summary.get("best") or {}
    if best.get("restored"):
        lines.append(f"saved the best policy: update {best['step']}, {name} {fmt.format(best[held_out])}")
    return "\n".join(lines)


def run_dpo(cfg) -> int:
    from rlhflab.api import run_stage

    result = run_stage("dpo", cfg)
    summary = result.summary
    rate, final = summary["validation_pass_rate"], summary["final"]
    held_out = f"validation pass rate {rate['start']:.1%} -> {rate['end']:.1%}; " if rate["start"] is not None else ""
    print(f"{held_out}final loss {final['loss']:.3f}, rewards/accuracies {final['rewards/accuracies']:.2f}, "
          f"rewards/margins {final['rewards/margins']:.2f}; {summary['pairs_per_s']:.0f} pairs/s")
    print(f"model: {result.model_dir}")
    print_report(result.run_dir, cfg)
    return 0


def run_report(cfg) -> int:
    from rlhflab.report import check_run_folder, write_comparison, write_report

    if not cfg.runs:
        raise UserInputError("no run folder given", "rlhflab report", "usage: rlhflab report RUN_DIR [RUN_DIR ...] [--out FILE]")
    folders = [check_run_folder(path) for path in cfg.runs]  # every bad path is named before any work
    if len(folders) == 1:
        print(write_report(folders[0], cfg.out or None))
    else:
        print(write_comparison(folders, cfg.out or "comparison.html"))
    return 0


def run_sweep(argv: list[str]) -> int:
    """`rlhflab sweep`: its own flags (--stage, --vary, --out) around a stage's, so it parses them itself."""
    from rlhflab.sweep import format_sweep_table, plan_sweep, run_sweep as sweep

    plan = plan_sweep(argv)  # every value parsed and every run's config checked before the first run
    runs = sweep(plan)
    print(format_sweep_table(plan, runs))
    if (plan.out / "comparison.html").is_file():
        print(f"\ncomparison: {plan.out / 'comparison.html'}")
    print(f"runs: {plan.out}/{plan.field}=*   table: {plan.out / 'sweep.json'}")
    return 3 if any(run.error for run in runs) else 0


def run_compare(argv: list[str]) -> int:
    """`rlhflab compare`: shared flags plus per-method sections of --config, so it parses them itself."""
    from rlhflab.compare import format_compare_table, parse_compare, run_compare as compare

    plan = parse_compare(argv)  # every method's config built and checked before the first run
    summary = compare(plan).summary
    print(format_compare_table(summary))
    print("\n".join(summary["verdict"]))
    print(f"\nreport: {plan.out / 'report.html'}   runs: {plan.out}/<method>   summary: {plan.out / 'summary.json'}")
    return 1 if summary["failed"] else 0


def runs_as_flag(args: list[str]) -> list[str]:
    """`report A B --out f` -> `--runs A B --out f`: folders are positional for the user, a field for the parser."""
    if "--runs" in args:
        return args
    runs, rest, i = [], [], 0
    while i < len(args):
        if args[i] in ("--out", "--config") and i + 1 < len(args):
            rest += args[i:i + 2]
            i += 2
            continue
        (rest if args[i].startswith("-") else runs).append(args[i])
        i += 1
    return (["--runs", *runs] if runs else []) + rest


COMMANDS = {"demo": run_demo, "sft": run_sft, "eval": run_eval, "rm": run_rm, "rm diagnose": run_rm_diagnose,
            **{stage: online_command(stage) for stage in ("ppo", "grpo", "rloo", "reinforce", "online-dpo")},
            "dpo": run_dpo,
            "tasks export": run_tasks_export, "report": run_report, "sweep": run_sweep,
            "compare": run_compare}


def split_stage(argv: list[str]) -> tuple[str, list[str]]:
    """'tasks export --out x' -> ('tasks export', ['--out', 'x'])."""
    if len(argv) >= 2 and f"{argv[0]} {argv[1]}" in COMMANDS:
        return f"{argv[0]} {argv[1]}", argv[2:]
    if argv[0] in COMMANDS:
        return argv[0], argv[1:]
    close = difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
    hint = f"did you mean '{close[0]}'?" if close else "run `rlhflab --help` for the list"
    raise UserInputError(f"unknown stage '{' '.join(argv[:2])}'", "rlhflab", hint)


def quiet_library_progress_bars() -> None:
    """transformers' per-file load/save bars are noise next to our own progress bars."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def launched_rank() -> tuple[int, int]:
    """(rank, world size) under torchrun / accelerate launch, (0, 1) without: read without torch (`--help`)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def leave_process_group(code: int) -> None:
    """After a command that returned: leave the process group a trainer joined (rlhflab.parallel), if any
    (waiting for the other ranks only after a success: after an error a peer may be in another collective)."""
    if "rlhflab.parallel" in sys.modules:
        sys.modules["rlhflab.parallel"].shutdown_world(finished=code == 0)


def peer_lost(err: BaseException, argv: list[str]) -> str | None:
    """The one line for a collective that failed because another process of the job ended (killed, out of
    memory, its own error): which rank, how, where this one waited, and how to resume; None for any other error
    (parallel/peers.py)."""
    if "rlhflab.parallel" not in sys.modules or isinstance(err, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        return None
    import signal
    import threading

    from rlhflab.parallel.peers import describe_peer_loss, is_transport_error

    if not is_transport_error(err):
        return None
    previous = {}
    if threading.current_thread() is threading.main_thread():  # the launcher SIGTERMs the ranks left once it
        previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGINT)}  # sees one die
    lost = describe_peer_loss(err)
    if lost is None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        return None
    given = [a.split("=", 1)[1] if "=" in a else b for a, b in zip(argv, [*argv[1:], ""])
             if a.split("=", 1)[0] == "--output_dir"]
    if not given:
        return f"{lost}; continue with the same launch and --resume latest --output_dir RUN"
    from rlhflab.checkpoint.folder import latest_checkpoint

    last = latest_checkpoint(Path(given[-1]) / "checkpoints")
    if last is None:
        return f"{lost}; {given[-1]} has no complete checkpoint: start the run again (with --overwrite)"
    return (f"{lost}; last complete checkpoint {last}: continue with the same launch and --resume latest "
            f"--output_dir {given[-1]}")


def version() -> str:
    """The installed distribution's version; the package's own `__version__` when run from a source tree."""
    from importlib.metadata import PackageNotFoundError, version as installed_version

    try:
        return installed_version("rlhflab")
    except PackageNotFoundError:
        from rlhflab import __version__

        return __version__


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"rlhflab {version()}")
        return 0
    rank, world_size = launched_rank()
    name = f"rlhflab[rank {rank}]" if world_size > 1 else "rlhflab"  # whose message it is, under torchrun
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format=f"{name}: %(message)s")
    quiet_library_progress_bars()
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull if rank > 0 else sys.stdout):
        code = run_command(argv, name)  # ranks > 0 print nothing: rank 0 reports the run
    leave_process_group(code)  # not after an uncaught exception: a peer may be gone, and torchrun ends us anyway
    return code


def refuse_single_process_stage_in_a_launch(stage: str) -> None:
    """Under torchrun / accelerate launch with several processes, only stages built for it may run: any other
    would run once per process, each writing the same run folder."""
    world_size = launched_rank()[1]
    if world_size > 1 and not (stage in STAGES and "parallel_strategy" in field_names(STAGES[stage])):
        able = sorted(name for name, cls in STAGES.items() if "parallel_strategy" in field_names(cls))
        raise UserInputError(f"rlhflab {stage} runs in one process, but this launch started {world_size} "
                             f"(WORLD_SIZE={world_size})", f"rlhflab {stage}",
                             f"run it without torchrun / accelerate launch; these stages run multi-process: "
                             f"{', '.join(able)}")


CHAIN_WORD = "then"


def chain_segments(argv: list[str]) -> list[tuple[str, list[str]]]:
    """`sft --config a.yaml then rm --config b.yaml` -> [("sft", [...]), ("rm", [...])], each stage's config
    parsed now, so a mistake in any of them fails before the first runs."""
    segments, current = [], []
    for word in [*argv, CHAIN_WORD]:
        if word != CHAIN_WORD:
            current.append(word)
            continue
        if not current:
            raise UserInputError(f"an empty stage in the chain ('{CHAIN_WORD}' at the start, the end or twice)",
                                 "rlhflab chain",
                                 f"usage: rlhflab chain STAGE [fields] {CHAIN_WORD} STAGE [fields] ...")
        stage, rest = split_stage(current)
        if stage not in STAGES or stage == "demo":
            raise UserInputError(f"rlhflab {stage} cannot run in a chain", "rlhflab chain",
                                 "chain the training and evaluation stages: sft, rm, dpo, ppo, grpo, rloo, "
                                 "reinforce, online-dpo, eval, rm diagnose")
        refuse_single_process_stage_in_a_launch(stage)
        segments.append((stage, rest))
        current = []
    return segments


def run_chain(argv: list[str]) -> int:
    """`rlhflab chain`: each stage in turn, all processes waiting for each other between stages (a later stage
    reads what an earlier one saved); the first non-zero exit code ends the chain."""
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: rlhflab chain STAGE [--config FILE.yaml] [--field value ...] {CHAIN_WORD} STAGE [...] ...\n\n"
              "Runs the stages one after another in this process; under torchrun / accelerate launch all of them in "
              "one launch\n(one start-up, one process group). Every stage's fields are checked before the first runs.")
        return 0
    configs = [(stage, parse_config(STAGES[stage], rest, prog=f"rlhflab {stage}")) for stage, rest in
               chain_segments(argv)]
    from rlhflab.parallel.world import barrier_if_joined  # torch only now: `rlhflab chain --help` stays fast

    for stage, cfg in configs:
        try:
            code = COMMANDS[stage](cfg)
        except WriteFailed as err:  # the stage that failed is the one to resume
            err.stage = err.stage or (stage if resumable(stage) else None)
            raise
        barrier_if_joined()  # the next stage may read what this one saved on rank 0
        if code:
            return code
    return 0


def resumable(stage: str) -> bool:
    """Whether `rlhflab STAGE --resume latest` continues a run of `stage` (the demo resumes stage by stage)."""
    return stage != "demo" and stage in STAGES and "resume" in field_names(STAGES[stage])


def run_command(argv: list[str], name: str) -> int:
    """The stage's command; a user mistake, a non-finite stop or a signal becomes a message and an exit code."""
    try:
        if argv[0] == "chain":  # several stages, each with its own fields
            return run_chain(argv[1:])
        stage, rest = split_stage(argv)
        refuse_single_process_stage_in_a_launch(stage)
        if stage == "sweep":  # not one config: a stage's config plus --stage / --vary
            return run_sweep(rest)
        if stage == "compare":  # one config plus a section per method in --config
            return run_compare(rest)
        if stage == "report":
            rest = runs_as_flag(rest)
        cfg = parse_config(STAGES[stage], rest, prog=f"rlhflab {stage}")
        return COMMANDS[stage](cfg)
    except UserInputError as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2
    except FloatingPointError as err:  # a non-finite loss, gradient or reward stopped the run
        print(f"{name}: stopped: {err}", file=sys.stderr)
        return 3
    except Interrupted as err:  # SIGINT / SIGTERM: the step finished and a checkpoint was written
        print(f"{name}: interrupted: {err}", file=sys.stderr)
        return err.exit_code
    except WriteFailed as err:  # a full disk / I/O error: the partial write removed, nothing complete touched
        if err.stage is None and argv[0] != "chain" and resumable(split_stage(argv)[0]):
            err.stage = split_stage(argv)[0]
        print(f"{name}: write failed: {err}", file=sys.stderr)
        return WRITE_FAILED_EXIT_CODE
    except StageFailed as err:  # a stage run in a child process stopped (its log has the whole story)
        print(f"{name}: stopped: {err}", file=sys.stderr)
        return err.exit_code
    except BaseException as err:  # torch's DistError is a RuntimeError, a failed DCP save a BaseException
        lost = peer_lost(err, argv)
        if lost is None:
            raise
        print(f"{name}: stopped: {lost}", file=sys.stderr)
        return PEER_LOST_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
