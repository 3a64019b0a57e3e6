"""The verifiable-reward controls against plain GRPO over seeds, at equal trained and at equal generated answers:
`rlhflab compare --methods grpo,grpo+dynamic,grpo+filter,...` from one SFT model of the demo's recipe.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/controls_compare.py --seeds 0,1,2 --out runs/controls

Per seed: one `rlhflab compare` at the budget (episodes = trained answers), whose table pairs every control with
plain GRPO over the 300 test prompts; then, for each control that generated more answers than it trained on
(dropped groups, the filter's probe), plain GRPO again with that many episodes (rounded down to whole updates),
paired with the control prompt by prompt: the gain at equal generated answers. Printed: the share of all-equal
groups per update in plain GRPO (frac_reward_zero_std), the per-seed table, and over the seeds the mean
difference of gains (control - GRPO) with its Student-t 95 % interval at equal trained and at equal generated
answers. `--write` puts the section between its markers in benchmarks/RESULTS.md. Not run by CI.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the children inherit it (FACTS.md)

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402

from async_compare import metric_rows, points, rlhflab, sft_model  # noqa: E402
from demo_seeds import commit_id, write_section  # noqa: E402

from rlhflab.intervals import paired_counts  # noqa: E402

BEGIN, END = "<!-- controls_compare: begin -->", "<!-- controls_compare: end -->"
BATCH = 64  # GRPO's default batch_size: a budget is a whole number of updates


def passed(compare_dir: Path, model: str) -> list[bool]:
    """A model's test verdicts in prompt order, from a comparison's samples.jsonl."""
    rows = [json.loads(line) for line in (compare_dir / "samples.jsonl").read_text().splitlines()]
    return [bool(r["passed"]) for r in sorted((r for r in rows if r["model"] == model), key=lambda r: r["prompt_index"])]


def pts(found: dict) -> str:
    return f"{100 * found['difference']:+.1f} pts [{100 * found['low']:+.1f}, {100 * found['high']:+.1f}]"


def run_seed(model: str, out: Path, seed: int, methods: list[str], budget: int) -> None:
    """The comparison at equal trained answers, then plain GRPO at each control's generated count."""
    here = out / f"seed-{seed}"
    if not (here / "summary.json").is_file():
        rlhflab("compare", "--model", model, "--methods", ",".join(["grpo", *methods]), "--budget", f"episodes={budget}",
                "--seed", str(seed), "--output_dir", str(here), "--overwrite", "true")
    summary = json.loads((here / "summary.json").read_text())
    for name in methods:
        generated = summary["methods"][name].get("episodes_generated") or budget
        episodes = generated // BATCH * BATCH
        folder = out / f"seed-{seed}-grpo-{episodes}"
        if episodes > budget and not (folder / "summary.json").is_file():
            rlhflab("compare", "--model", model, "--methods", "grpo", "--budget", f"episodes={episodes}", "--seed",
                    str(seed), "--output_dir", str(folder), "--overwrite", "true")


def report(out: Path, seeds: list[int], methods: list[str], budget: int) -> str:
    lines = ["| seed | method | test pass | gain | vs grpo, equal trained | generated | vs grpo, equal generated "
             "| wall s |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    equal_trained = {m: [] for m in methods}
    equal_generated = {m: [] for m in methods}
    dull = []
    for seed in seeds:
        here = out / f"seed-{seed}"
        summary = json.loads((here / "summary.json").read_text())
        dull += [r["frac_reward_zero_std"] for r in metric_rows(Path(summary["methods"]["grpo"]["run_dir"]))
                 if "frac_reward_zero_std" in r]
        for name, m in summary["methods"].items():
            versus, at_generated = m.get("vs_method"), ""
            generated = m.get("episodes_generated") or budget
            episodes = generated // BATCH * BATCH
            matched = out / f"seed-{seed}-grpo-{episodes}"
            if name != "grpo" and versus:
                equal_trained[name].append(versus["difference"])
                if episodes > budget and (matched / "summary.json").is_file():
                    found = paired_counts(passed(matched, "grpo"), passed(here, name))
                    equal_generated[name].append(found["difference"])
                    at_generated = f"{pts(found)} (grpo at {episodes})"
                elif episodes <= budget:
                    equal_generated[name].append(versus["difference"])
                    at_generated = "as trained"
            lines.append(f"| {seed} | {name} | {m['test_pass_rate']:.1%} | {100 * m['gain']:+.1f} pts | "
                         f"{pts(versus) if versus else ''} | {generated} | {at_generated} | {m['wall_s']:.0f} |")
    lines += ["", f"Plain GRPO: {statistics.fmean(dull):.0%} of the groups of an update all-equal on average "
                  f"(frac_reward_zero_std over {len(dull)} updates, {len(seeds)} seeds).", "",
              "Over the seeds (test gain of the control minus plain GRPO's; mean, Student-t 95 % interval):", ""]
    for name in methods:
        if equal_trained[name]:
            lines.append(f"- {name}: at equal trained answers {points(equal_trained[name])}; at equal generated "
                         f"answers {points(equal_generated[name]) if equal_generated[name] else 'not run'}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--methods", default="grpo+dynamic,grpo+filter,grpo+entropy",
                        help="the controls, each run beside plain grpo")
    parser.add_argument("--budget", type=int, default=3840, help="episodes (trained answers) of every method")
    parser.add_argument("--model", default="", help="an SFT model folder; default: train the demo's SFT into --out")
    parser.add_argument("--out", default="runs/controls-compare")
    parser.add_argument("--write", action="store_true", help="put the section into benchmarks/RESULTS.md")
    args = parser.parse_args()
    out, seeds = Path(args.out), [int(s) for s in args.seeds.split(",")]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    model = args.model or sft_model(out)
    for seed in seeds:
        run_seed(model, out, seed, methods, args.budget)
    text = report(out, seeds, methods, args.budget)
    print(text)
    if args.write:
        title = (f"## The controls against plain GRPO (`benchmarks/controls_compare.py --seeds {args.seeds} "
                 f"--budget {args.budget}`, commit {commit_id()})")
        write_section("\n".join([BEGIN, title, "", text, "", END]) + "\n", begin=BEGIN, end=END)


if __name__ == "__main__":
    main()
