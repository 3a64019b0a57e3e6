"""Synchronous vs asynchronous generation (issue 33) on this machine's cores, at equal episodes.

    python benchmarks/async_speed.py [--methods grpo,ppo] [--episodes 640] [--repeats 2]

Each configuration is a fresh process (`rlhflab <method> ...`), interleaved, on the demo's model shape (the tiny
default Llama, 96 wide, 3 layers, the suite's prompts) freshly initialised, so every answer runs to the
26-token cap: the work per update is the same in every row. Rows:
- sync, threads 2: the synchronous loop on both cores (the CLI's default on this machine);
- sync, threads 1: one core (what each side of an async run gets);
- async k=0 / k=1: the generator on one core, the trainer on the other (--generator_threads 1 --threads 1).
Printed: episodes per second of the loop (summary.json's `eps_loop`: updates only, not loading or the held-out
evaluations, which every row runs the same), and for async the share of the loop the trainer waited for
rollouts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROWS = {
    "sync, threads 2": ["--threads", "2"],
    "sync, threads 1": ["--threads", "1"],
    "async k=0": ["--threads", "1", "--async_generation", "--max_staleness", "0", "--generator_threads", "1"],
    "async k=1": ["--threads", "1", "--async_generation", "--max_staleness", "1", "--generator_threads", "1"],
}
METHOD_FLAGS = {"grpo": ["--num_generations", "4"], "ppo": []}


def tiny_model(folder: Path) -> str:
    """The demo's model shape with the suite's tokenizer, freshly initialised."""
    from rlhflab import models, tasks

    tokenizer = models.build_tokenizer(tasks.template_corpus(), vocab_size=384)
    models.save_model_folder(folder, models.build_tiny_model(tokenizer, seed=0), tokenizer)
    return str(folder)


def run(method: str, row: str, model: str, out: Path, episodes: int) -> dict:
    command = [sys.executable, "-m", "rlhflab", method, "--model", model, "--output_dir", str(out), "--overwrite",
               "--total_episodes", str(episodes), "--batch_size", "64", "--eval_every", "0", "--eval_prompts", "16",
               "--progress", "false", "--write_report", "false", "--save_every", "-1", "--console_samples", "0",
               *METHOD_FLAGS[method], *ROWS[row]]
    subprocess.run(command, check=True, capture_output=True, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    waited = sum(m.get("async/wait_s", 0.0) for m in metrics)
    loop = summary["wall_time_s"]["loop"]
    return {"eps": summary["episodes"] / loop, "waited_share": waited / loop if loop else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="grpo,ppo")
    parser.add_argument("--episodes", type=int, default=640)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp) / "model")
        results: dict[tuple[str, str], list[dict]] = {}
        for repeat in range(args.repeats):
            for method in args.methods.split(","):
                for row in ROWS:
                    got = run(method, row, model, Path(tmp) / f"{method}-{repeat}-{len(results)}", args.episodes)
                    results.setdefault((method, row), []).append(got)
                    print(f"{method:5} {row:16} eps {got['eps']:.1f} waited {got['waited_share']:.0%}", flush=True)
    print("\n| method | row | episodes/s of the loop (runs) | median | x best sync | trainer waited |")
    print("|---|---|---|---|---|---|")
    for method in args.methods.split(","):
        best = max(statistics.median(r["eps"] for r in results[(method, row)]) for row in ROWS if row.startswith("sync"))
        for row in ROWS:
            runs = results[(method, row)]
            median = statistics.median(r["eps"] for r in runs)
            listed = ", ".join(f"{r['eps']:.1f}" for r in runs)
            print(f"| {method} | {row} | {listed} | {median:.1f} | "
                  f"{median / best:.2f} | {statistics.median(r['waited_share'] for r in runs):.0%} |")


if __name__ == "__main__":
    main()
