"""The demo's run-to-run spread: `rlhflab demo` once per seed, every headline number's mean, spread and
95 % interval over the seeds (not run by CI; tests/test_demo_seeds.py runs its smoke form).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/demo_seeds.py --seeds 0,1,2 --write

Seed s sets both the demo's `--seed` (model init, data order, sampling) and its `--split_seed` (which
content lands in train / validation / test), so each run is a fresh draw of everything a user's run
could differ in. Each demo is its own process (its own clock; OMP_WAIT_POLICY=PASSIVE before torch).
One run is one draw: the README's demo table cites these means and intervals, not one run's digits.

Per seed it reads RUN/summary.json (test pass rates, gains, reward-model figures, the demo's clock
and its split, CPU seconds, load average, one core's matmul speed) and the PPO stages' metrics.jsonl
(explained variance at the end). The interval of a mean is Student's t over the seeds
(mean +- t * sd / sqrt(n)); a gain's interval excluding 0 means the gain is larger than the seeds' spread can
explain.
`--write` replaces the section between the markers below in benchmarks/RESULTS.md (or appends it).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the children inherit it (FACTS.md)

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "RESULTS.md"
BEGIN, END = "<!-- demo_seeds: begin -->", "<!-- demo_seeds: end -->"
# Student's t, two-sided 95 %, by degrees of freedom (n - 1 seeds); 1.96 past the table
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 19: 2.093, 24: 2.064, 29: 2.045}
# RL stages whose critic is read at the end: the last N updates' mean of val/explained_variance
LAST_UPDATES = 5
SMOKE_ARGS = ["--max_steps", "4", "--batch_size", "8", "--eval_every", "0", "--sft_examples", "64",
              "--num_train_prompts", "22", "--num_validation_prompts", "11", "--num_test_prompts", "11",
              "--hidden_size", "32", "--num_layers", "1", "--intermediate_size", "64", "--max_new_tokens", "8",
              "--rm_pair_prompts", "44", "--rm_epochs", "1", "--ppo_total_episodes", "16",
              "--headroom_samples", "2", "--rm_diagnosis_samples", "1"]


@dataclass(frozen=True)
class Spread:
    mean: float
    sd: float  # sample standard deviation over the seeds (0 with one seed)
    low: float  # 95 % interval of the mean (Student's t)
    high: float
    n: int

    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def t95(df: int) -> float:
    if df <= 0:
        return math.nan
    known = [d for d in T95 if d <= df]
    return T95[max(known)] if df <= 29 else 1.96


def spread(values: list[float]) -> Spread:
    """Mean, sample sd and the t interval of the mean of the finite `values`."""
    xs = [v for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return Spread(math.nan, math.nan, math.nan, math.nan, 0)
    mean = statistics.fmean(xs)
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    half = t95(len(xs) - 1) * sd / math.sqrt(len(xs)) if len(xs) > 1 else math.nan
    return Spread(mean, sd, mean - half, mean + half, len(xs))


# --- one demo per seed ------------------------------------------------------------------------


def run_demo(seed: int, out: Path, extra: list[str], threads: int) -> dict:
    """`rlhflab demo` with --seed and --split_seed = seed in a fresh process; its summary.json."""
    run_dir = out / f"seed-{seed}"
    command = [sys.executable, "-m", "rlhflab", "demo", "--out", str(run_dir), "--overwrite", "true",
               "--seed", str(seed), "--split_seed", str(seed), "--threads", str(threads), "--progress", "false",
               *extra]
    started = time.time()
    with open(out / f"seed-{seed}.log", "w") as log:
        done = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"demo with seed {seed} failed (exit {done.returncode}); see {out / f'seed-{seed}.log'}")
    print(f"seed {seed}: {time.time() - started:.0f} s with start-up", flush=True)
    return json.loads((run_dir / "summary.json").read_text())


def end_explained_variance(metrics: Path) -> float:
    """Mean val/explained_variance over the last LAST_UPDATES updates of a PPO run's metrics.jsonl."""
    values = []
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if "val/explained_variance" in row:
            values.append(float(row["val/explained_variance"]))
    tail = values[-LAST_UPDATES:]
    return statistics.fmean(tail) if tail else math.nan


def headline(summary: dict, run_dir: Path) -> dict[str, float]:
    """The numbers a reader quotes from one demo: pass rates, gains in points, the reward model, the critic,
    the clock (seconds of each part), the CPU seconds, the load average and one core's matmul speed."""
    rates = summary["test_pass_rate"]
    row = {f"test/{name}": 100 * rate for name, rate in rates.items()}
    row |= {f"gain/{name}": 100 * (rate - rates["sft"]) for name, rate in rates.items() if name != "sft"}
    rm = summary.get("rm") or {}
    for key in ("test_accuracy", "pass_fail_correlation", "roc_auc"):
        if key in rm:
            row[f"rm/{key}"] = rm[key]
    for stage in ("ppo", "ppo_rm"):
        metrics = run_dir / stage / "metrics.jsonl"
        if metrics.exists():
            row[f"explained_variance/{stage}"] = end_explained_variance(metrics)
    row |= {f"clock/{k}": v for k, v in summary["wall_time_s"].items()}
    row |= {f"cpu/{k}": v for k, v in (summary.get("cpu_time_s") or {}).items()}
    row |= {f"load/{k}": v for k, v in (summary.get("load_average_1min") or {}).items()}
    row |= {f"gflops/{k}": v for k, v in (summary.get("matmul_gflops") or {}).items()}
    return row


# --- the section of RESULTS.md ----------------------------------------------------------------


def fmt(x: float, key: str) -> str:
    if not math.isfinite(x):
        return "–"
    if key.startswith(("test/", "gain/")):
        return f"{x:+.1f}" if key.startswith("gain/") else f"{x:.1f}"
    if key.startswith(("clock/", "cpu/")):
        return f"{x:.0f}"
    return f"{x:.3f}" if not key.startswith(("load/", "gflops/")) else f"{x:.1f}"


UNITS = {"test/": "% of test prompts", "gain/": "points over SFT", "rm/": "", "explained_variance/":
         f"mean of the last {LAST_UPDATES} updates", "clock/": "s (wall)", "cpu/": "s (process CPU)",
         "load/": "1-min load average", "gflops/": "one core's matmul GFLOP/s (demo/clock.py)"}


def section(rows: dict[int, dict[str, float]], commit: str, extra: list[str], threads: int) -> str:
    seeds = sorted(rows)
    keys = [k for k in rows[seeds[0]] if all(k in rows[s] for s in seeds)]
    lines = [BEGIN, "## The demo over seeds (`benchmarks/demo_seeds.py`)", "",
             f"`rlhflab demo{' ' + ' '.join(extra) if extra else ''}` with `--seed s --split_seed s` for s in "
             f"{', '.join(map(str, seeds))} (commit {commit}, {platform.machine()}, {os.cpu_count()} CPUs, "
             f"`--threads {threads}`, OMP_WAIT_POLICY=PASSIVE). Mean, sample sd and the 95 % interval of the "
             "mean (Student's t over the seeds); test pass rates greedy on the 300-prompt test split of each "
             "seed; the clock is the demo's own (summary.json `wall_time_s`, start-up not included) with the "
             "process's CPU seconds, the 1-minute load average and one core's matmul speed at start and end "
             "(demo/clock.py) beside it, since a shared or slower machine stretches wall time.", "",
             "| number | unit | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | sd | 95 % interval |",
             "| --- | --- | " + " | ".join("---" for _ in seeds) + " | --- | --- | --- |"]
    for key in keys:
        s = spread([rows[seed][key] for seed in seeds])
        unit = next((u for prefix, u in UNITS.items() if key.startswith(prefix)), "")
        interval = f"{fmt(s.low, key)} to {fmt(s.high, key)}" if math.isfinite(s.low) else "–"
        if key.startswith("gain/") and s.n > 1:
            interval += " (excludes 0)" if s.excludes_zero() else " (includes 0)"
        lines.append(f"| `{key}` | {unit} | " + " | ".join(fmt(rows[seed][key], key) for seed in seeds)
                     + f" | {fmt(s.mean, key)} | {fmt(s.sd, key.replace('gain/', 'test/'))} | {interval} |")
    return "\n".join(lines + ["", END]) + "\n"


def write_section(text: str, path: Path = RESULTS, begin: str = BEGIN, end: str = END) -> None:
    """Replace the text between the markers `begin` and `end` in `path` (`text` starts and ends with them), or
    append it."""
    old = path.read_text() if path.exists() else ""
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        new = head + text.rstrip("\n") + rest.split(end, 1)[1]
    else:
        new = old.rstrip("\n") + "\n\n" + text
    path.write_text(new)


def commit_id() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return done.stdout.strip() + (" + uncommitted changes" if dirty else "") if done.returncode == 0 else "unknown"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (>= 3 for an interval worth reading)")
    parser.add_argument("--out", default=str(HERE / ".cache" / "demo-seeds"), help="folder of the demo runs")
    parser.add_argument("--threads", type=int, default=0, help="torch threads of each demo; 0 = all cores")
    parser.add_argument("--write", action="store_true", help="write the section into --results")
    parser.add_argument("--results", default=str(RESULTS), help="the markdown file --write updates")
    parser.add_argument("--reuse", action="store_true", help="read finished seeds' summary.json instead of rerunning")
    parser.add_argument("--smoke", action="store_true", help="a tiny demo per seed (the test's form; seconds each)")
    args, extra = parser.parse_known_args(argv)  # anything else goes to `rlhflab demo`
    extra = (SMOKE_ARGS if args.smoke else []) + extra
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        summary_path = out / f"seed-{seed}" / "summary.json"
        if args.reuse and summary_path.exists() and json.loads(summary_path.read_text()).get("stage") == "demo":
            summary = json.loads(summary_path.read_text())
        else:
            summary = run_demo(seed, out, extra, args.threads)
        rows[seed] = headline(summary, out / f"seed-{seed}")
    (out / "headline.json").write_text(json.dumps(rows, indent=1))
    text = section(rows, commit_id(), extra, args.threads)
    print(text)
    if args.write:
        write_section(text, Path(args.results))
        print(f"wrote the section into {args.results}")


if __name__ == "__main__":
    main()
