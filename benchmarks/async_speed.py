"""Synchronous vs asynchronous generation (issue 33) on this machine's cores, at equal episodes.

    python benchmarks/async_speed.py [--methods grpo,ppo] [--episodes 640] [--repeats 2]

Each configuration is a fresh process (`rlhflab <method> ...`), interleaved, on the demo's model shape (the tiny
default Llama, 96 wide, 3 layers, the suite's prompts) freshly initialised, so every answer runs to the
26-token cap: the work per update is the same in every row. Rows:
- sync, threads 2: the synchronous loop on both cores (the CLI's default on this machine);
- sync, threads 1: one core;
- async k=0 / k=1: a 1-thread generator beside a 2-thread trainer (the defaults: --threads 0 = all cores);
- async k=1, trainer 1 thread: each side on a core of its own (--threads 1 --generator_threads 1).
Printed: episodes per second of the loop (summary.json's `eps_loop`: updates only, not loading or the held-out
evaluations, which every row runs the same), and for async the share of the loop the trainer waited for
rollouts. Then the machine's own bound: two synchronous 1-thread runs started together, their episodes per second
added up against one run alone — what these two cores give two busy processes at once, and so the most an
asynchronous run (a generator and a trainer, one core each) can gain over the best synchronous row.
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
    "async k=0": ["--threads", "2", "--async_generation", "--max_staleness", "0", "--generator_threads", "1"],
    "async k=1": ["--threads", "2", "--async_generation", "--max_staleness", "1", "--generator_threads", "1"],
    "async k=1, trainer 1 thread": ["--threads", "1", "--async_generation", "--max_staleness", "1",
                                    "--generator_threads", "1"],
}
METHOD_FLAGS = {"grpo": ["--num_generations", "4"], "ppo": []}


def tiny_model(folder: Path) -> str:
    """The demo's model shape with the suite's tokenizer, freshly initialised."""
    from rlhflab import models, tasks

    tokenizer = models.build_tokenizer(tasks.template_corpus(), vocab_size=384)
    models.save_model_folder(folder, models.build_tiny_model(tokenizer, seed=0), tokenizer)
    return str(folder)


def run(method: str, row: str, model: str, out: Path, episodes: int) -> dict:
    command = command_of(method, row, model, out, episodes)
    subprocess.run(command, check=True, capture_output=True, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    return read_run(out)


def command_of(method: str, row: str, model: str, out: Path, episodes: int) -> list[str]:
    return [sys.executable, "-m", "rlhflab", method, "--model", model, "--output_dir", str(out), "--overwrite",
            "--total_episodes", str(episodes), "--batch_size", "64", "--eval_every", "0", "--eval_prompts", "16",
            "--progress", "false", "--write_report", "false", "--save_every", "-1", "--console_samples", "0",
            *METHOD_FLAGS[method], *ROWS[row]]


def side_by_side(method: str, model: str, out: Path, episodes: int) -> float:
    """Two synchronous 1-thread runs started together: their episodes per second of the loop, added up."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    procs = [subprocess.Popen(command_of(method, "sync, threads 1", model, out / str(i), episodes), env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(2)]
    if any(p.wait() for p in procs):
        raise RuntimeError(f"a side-by-side {method} run failed")
    return sum(read_run(out / str(i))["eps"] for i in range(2))


def read_run(out: Path) -> dict:
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
                together = side_by_side(method, model, Path(tmp) / f"{method}-{repeat}-pair", args.episodes)
                results.setdefault((method, "pair"), []).append({"eps": together})
                print(f"{method:5} two 1-thread runs side by side: eps {together:.1f} together", flush=True)
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
    print("\nThe machine's bound (two synchronous 1-thread runs side by side, episodes/s added up, against one alone):")
    for method in args.methods.split(","):
        alone = statistics.median(r["eps"] for r in results[(method, "sync, threads 1")])
        pair = statistics.median(r["eps"] for r in results[(method, "pair")])
        print(f"- {method}: {pair:.1f} together against {alone:.1f} alone: {pair / alone:.2f}x")


if __name__ == "__main__":
    main()
