"""Synchronous against asynchronous generation at equal episodes, over seeds: `rlhflab compare` with each online
method beside its `-async` variant (--async_generation --max_staleness 1), from one SFT model of the demo's recipe.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/async_compare.py --seeds 0,1,2 --out runs/async-compare

Per seed: one `rlhflab compare` process (its own clock), whose table pairs every variant with its method over the
300 test prompts (`vs_method`). Printed: the per-seed table (test pass, gain, the variant's paired difference,
loop time, episodes per second); each loop's time split per update (sync: generation / scoring / training;
async: the generator's sampling, the trainer's wait for it, scoring, training, and the share of generation
hidden behind training = 1 - wait / generator); the staleness and importance-weight figures; over the seeds,
the mean difference of gains (async - sync) with its Student-t 95 % interval and the throughput ratio.
`--write` puts the printed section between its markers in benchmarks/RESULTS.md. Not run by CI.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the children inherit it (FACTS.md)

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from demo_seeds import commit_id, spread, write_section  # noqa: E402

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- async_compare: begin -->", "<!-- async_compare: end -->"


def rlhflab(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "rlhflab", *args, "--progress", "false"], check=True)


def sft_model(out: Path) -> str:
    """The demo's SFT stage (its defaults, one micro-batch a step as the demo runs it), trained once."""
    model = out / "sft" / "model"
    if not model.is_dir():
        rlhflab("sft", "--output_dir", str(out / "sft"), "--gradient_accumulation_steps", "1", "--overwrite", "true")
    return str(model)


def metric_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "time/training" in r]


def mean_of(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.fmean(values) if values else float("nan")


def time_split(run_dir: Path) -> dict:
    """Seconds per update of each phase; async: the generator's sampling and the trainer's wait for it."""
    rows = metric_rows(run_dir)
    split = {phase: mean_of(rows, f"time/{phase}") for phase in ("generation", "scoring", "training")}
    if any("async/generator_s" in r for r in rows):
        generator, wait = mean_of(rows, "async/generator_s"), mean_of(rows, "async/wait_s")
        split = {"generator": generator, "wait": wait, "scoring": split["scoring"], "training": split["training"],
                 "hidden": 1 - wait / generator if generator else float("nan")}
        split |= {"staleness": mean_of(rows, "async/staleness"),
                  "is_mean": mean_of(rows, "sampler/is_weight_mean"),
                  "is_max": max((r["sampler/is_weight_max"] for r in rows if "sampler/is_weight_max" in r),
                                default=float("nan")),
                  "truncated": mean_of(rows, "sampler/is_truncated_share"), "sampler_kl": mean_of(rows, "sampler/kl")}
    return split


def points(values: list[float]) -> str:
    """'+1.2 pts [-0.8, +3.1] (sd 0.9)': the mean of differences of rates, its t interval over the seeds."""
    found = spread(values)
    return f"{100 * found.mean:+.1f} pts [{100 * found.low:+.1f}, {100 * found.high:+.1f}] (sd {100 * found.sd:.1f})"


def report(out: Path, seeds: list[int], methods: list[str]) -> str:
    lines = ["| seed | method | test pass | gain | async - sync (paired, 95 %) | loop s | episodes/s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    splits, differences, ratios = [], {m: [] for m in methods}, {m: [] for m in methods}
    for seed in seeds:
        summary = json.loads((out / f"seed-{seed}" / "summary.json").read_text())
        for name, m in summary["methods"].items():
            versus = m.get("vs_method")
            paired = (f"{100 * versus['difference']:+.1f} pts [{100 * versus['low']:+.1f}, {100 * versus['high']:+.1f}]"
                      if versus else "")
            lines.append(f"| {seed} | {name} | {m['test_pass_rate']:.1%} | {100 * m['gain']:+.1f} pts | {paired} | "
                         f"{m['train_s']:.0f} | {m['episodes_per_s']:.1f} |")
            splits.append((seed, name, time_split(Path(m["run_dir"]))))
        for base in methods:
            sync, variant = summary["methods"].get(base), summary["methods"].get(f"{base}-async")
            if sync and variant and "error" not in sync and "error" not in variant:
                differences[base].append(variant["gain"] - sync["gain"])
                ratios[base].append(variant["episodes_per_s"] / sync["episodes_per_s"])
    lines += ["", "Seconds per update (async: generator = its sampling, wait = the trainer's wait for it, hidden = "
                  "the share of generation overlapped with training):", "",
              "| seed | method | generation / generator | wait | scoring | training | hidden | staleness | IS mean | "
              "IS max | at cap | sampler KL |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for seed, name, s in splits:
        if "generator" in s:
            lines.append(f"| {seed} | {name} | {s['generator']:.3f} | {s['wait']:.3f} | {s['scoring']:.3f} | "
                         f"{s['training']:.3f} | {s['hidden']:.0%} | {s['staleness']:.2f} | {s['is_mean']:.4f} | "
                         f"{s['is_max']:.3f} | {s['truncated']:.2%} | {s['sampler_kl']:.4f} |")
        else:
            lines.append(f"| {seed} | {name} | {s['generation']:.3f} | | {s['scoring']:.3f} | {s['training']:.3f} | "
                         "| | | | | |")
    lines += ["", "Over the seeds (mean, Student-t 95 % interval of the mean):", ""]
    for base in methods:
        if differences[base]:
            lines.append(f"- {base}: test gain async - sync {points(differences[base])}; "
                         f"episodes/s async / sync {statistics.fmean(ratios[base]):.2f} "
                         f"({', '.join(f'{r:.2f}' for r in ratios[base])})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--methods", default="grpo,ppo", help="online methods, each run beside its -async variant")
    parser.add_argument("--budget", default="episodes=3840")
    parser.add_argument("--out", default="runs/async-compare")
    parser.add_argument("--write", action="store_true", help="put the section into benchmarks/RESULTS.md")
    args = parser.parse_args()
    out, seeds = Path(args.out), [int(s) for s in args.seeds.split(",")]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    model = sft_model(out)
    for seed in seeds:
        if not (out / f"seed-{seed}" / "summary.json").is_file():
            rlhflab("compare", "--model", model, "--methods", ",".join(f"{m},{m}-async" for m in methods),
                    "--budget", args.budget, "--seed", str(seed), "--output_dir", str(out / f"seed-{seed}"),
                    "--overwrite", "true")
    text = report(out, seeds, methods)
    print(text)
    if args.write:
        title = (f"## Synchronous against asynchronous generation (`benchmarks/async_compare.py --seeds {args.seeds} "
                 f"--budget {args.budget}`, commit {commit_id()})")
        write_section("\n".join([BEGIN, title, "", text, "", END]) + "\n", begin=BEGIN, end=END)


if __name__ == "__main__":
    main()
