"""rlhflab GRPO / RLOO / DPO vs TRL 1.16 on identical work, each run in its own process (not run by CI).

Setup, once (TRL 1.16 gets its own virtualenv, beside the TRL 1.12 one of ppo_vs_trl.py):

    python -m venv benchmarks/.venv-trl116                  # the same python as .venv
    benchmarks/.venv-trl116/bin/pip install torch==2.13.0   # the CPU wheel first; a bare `torch` pulls CUDA
    benchmarks/.venv-trl116/bin/pip install "trl==1.16.*" peft requests

Run (from the repository root, in the project's .venv):

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/methods_vs_trl.py                      # everything
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/methods_vs_trl.py --methods grpo --threads 1 --repeats 3

Both sides start from the same `rlhflab sft` model (a tiny Llama, hidden 128, 4 layers), read the
same JSONL file (the suite's train prompts with their `family` / `reference` / `content` columns,
or the suite's train preference pairs), use the same reward (the suite's exact checker: 1 pass,
0 fail; `rlhflab.tasks.check` on both sides), the same batch, k, lengths, optimiser, loss settings
and number of optimiser steps, LoRA off, float32. Throughput = completions (DPO: pairs) / wall
seconds of the training loop: rlhflab's summary `wall_time_s.loop` (the updates, not loading, the
start / end evaluation or the save), TRL's `trainer.train()` (its `__init__`, which loads, tokenises
and, for DPO with precompute_ref_log_probs, computes the reference log-probs, is not timed). Medians
of repeats, runs alternating rlhflab / TRL. See benchmarks/RESULTS.md.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported (FACTS.md)

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

from peak_rss import rss_mib  # noqa: E402
from ppo_vs_trl import cell, markdown_table, median_of, ratio  # noqa: E402

from bench_assets import CACHE, child_env, rlhflab_cli  # noqa: E402

HERE = Path(__file__).resolve().parent
TRL_PYTHON = HERE / ".venv-trl116" / "bin" / "python"
SRC = HERE.parent / "src"

# The model FACTS.md measured TRL 1.16 with: a tiny Llama, hidden 128, 4 layers (rlhflab's tiny
# builder otherwise: 4 heads, MLP 256, its 384-piece BPE tokenizer with pad != eos).
SFT_ARGS = ["--hidden_size", "128", "--num_layers", "4"]

# Identical on both sides: AdamW (0.9, 0.999) eps 1e-8, no weight decay, linear decay, no warmup,
# gradient clipping at 1.0 (TRL's default), logging every optimiser step.
OPTIM = dict(learning_rate=1e-5, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, max_grad_norm=1.0,
             lr_schedule="linear", log_every=1)
# batch = completions per optimiser step (prompts x k); every rollout is used num_iterations times
ONLINE = dict(batch_size=32, num_generations=4, response_length=32, temperature=1.0, rollouts=24, epsilon=0.2,
              epsilon_high=0.0)
METHODS = {
    "grpo": dict(**OPTIM, **ONLINE, beta=0.04, num_iterations=1, loss_type="dapo", scale_rewards="group",
                 importance_sampling_level="token"),
    "rloo": dict(**OPTIM, **ONLINE, beta=0.05, num_iterations=2, normalize_advantages=False),
    "dpo": {**OPTIM, "learning_rate": 5e-5, "batch_size": 32, "max_steps": 30, "loss_type": "sigmoid", "beta": 0.1,
            "label_smoothing": 0.0},
}
# TRL variants run per method. DPO: rlhflab computes the reference log-probs once before training
# (setup, not timed); TRL as shipped keeps a resident reference and runs it at every step, and
# with precompute_ref_log_probs=True it computes them in __init__ like us: that is the equal-work run.
VARIANTS = {"grpo": {"trl": {"use_bias_correction_kl": False}},  # rlhflab's k3 term has no ratio factor
            "rloo": {"trl": {}},
            "dpo": {"trl": {}, "trl_precompute": {"precompute_ref_log_probs": True}}}


# --- what both sides start from ------------------------------------------------------------


def prepare(sft_steps: int, threads: int) -> dict[str, Path]:
    """The SFT model (built once, cached) and the two JSONL files both sides read."""
    root = CACHE / f"sft{sft_steps}-d128-l4"
    sft = root / "sft"
    if not (sft / "done").is_file():
        print(f"building the SFT model: rlhflab sft --max_steps {sft_steps} {' '.join(SFT_ARGS)} ...", flush=True)
        seconds = rlhflab_cli(["sft", "--output_dir", str(sft), "--max_steps", str(sft_steps), "--eval_every", "0",
                               "--save_every", "0", "--seed", "0", *SFT_ARGS], threads)
        (sft / "done").write_text(f"{seconds:.1f} s\n")
    from rlhflab import tasks

    items = tasks.build_splits(0)["train"]  # the online configs' defaults: split_seed 0, 400 train prompts
    prompts = [{"prompt": i.prompt, "family": i.family, "reference": i.reference, "content": list(i.content)}
               for i in items]
    pairs = tasks.pair_rows(items, None, 3, seed=0)  # DPOConfig's defaults: every kind, 3 per prompt
    files = {"model": sft / "model", "prompts": root / "prompts.jsonl", "pairs": root / "pairs.jsonl"}
    for name, rows in (("prompts", prompts), ("pairs", pairs)):
        files[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return files


# --- the rlhflab child ----------------------------------------------------------------------


def rlhflab_config(method: str, s: dict, spec: dict):
    """The rlhflab config of one run: the shared settings, evaluation / checkpoints / progress off."""
    from rlhflab import config

    common = dict(model=spec["model"], device="cpu", threads=spec["threads"], seed=spec["seed"],
                  output_dir=spec["out"], overwrite=True, progress=False, save_every=0, eval_every=0,
                  learning_rate=s["learning_rate"], adam_beta1=s["adam_beta1"], adam_beta2=s["adam_beta2"],
                  adam_eps=s["adam_eps"], weight_decay=0.0, max_grad_norm=s["max_grad_norm"],
                  lr_schedule=s["lr_schedule"], warmup_steps=0, gradient_accumulation_steps=1, log_every=s["log_every"],
                  **spec.get("rlhflab_options", {}))
    if method == "dpo":
        return config.DPOConfig(**common, train_file=spec["data"], batch_size=s["batch_size"],
                                max_steps=s["max_steps"], loss_type=s["loss_type"], beta=s["beta"],
                                label_smoothing=s["label_smoothing"], eval_prompts=8)
    online = dict(common, train_file=spec["data"], reward="checker", verifier="checker", missing_eos_penalty=0.0,
                  batch_size=s["batch_size"], num_mini_batches=1, num_generations=s["num_generations"],
                  response_length=s["response_length"], temperature=s["temperature"],
                  total_episodes=s["rollouts"] * s["batch_size"], beta=s["beta"], num_iterations=s["num_iterations"],
                  epsilon=s["epsilon"], epsilon_high=s["epsilon_high"], eval_prompts=8, sample_prompts=0,
                  console_samples=0, keep_best=False, headroom_samples=0)
    if method == "grpo":
        return config.GRPOConfig(**online, loss_type=s["loss_type"], scale_rewards=s["scale_rewards"],
                                 importance_sampling_level=s["importance_sampling_level"])
    return config.RLOOConfig(**online, normalize_advantages=s["normalize_advantages"])


def rlhflab_child(spec: dict) -> None:
    """One rlhflab run through the Python API; prints one JSON line."""
    import importlib

    import torch

    method, s = spec["method"], spec["settings"]
    before = rss_mib()
    cfg = rlhflab_config(method, s, spec)
    trainer = importlib.import_module(f"rlhflab.trainers.{method}")
    cpu_clock = spec.get("clock") == "cpu"
    if cpu_clock:  # the trainers' own clocks read this process's CPU time: summary wall_time_s in CPU seconds
        for name in ("rlhflab.trainers.online.loop", "rlhflab.trainers.dpo"):
            importlib.import_module(name).time = types.SimpleNamespace(time=time.process_time)
    started = time.time()
    result = trainer.train(cfg)
    total = time.time() - started
    walls = result.summary["wall_time_s"]
    rows = [json.loads(line) for line in (Path(result.run_dir) / "metrics.jsonl").read_text().splitlines()]
    seconds = {"cpu_seconds": walls["loop"]} if cpu_clock else {"seconds": walls["loop"]}
    out = {"library": "rlhflab", **seconds, "setup_seconds": walls["setup"],
           "train_call_seconds": total, "wall_time_s": walls, "peak_rss_mib": rss_mib(),
           "rss_before_models_mib": before, "threads": torch.get_num_threads(),
           "loadavg_1min_after": os.getloadavg()[0]}
    if method == "dpo":
        out["pairs"] = result.summary.get("pairs_seen", result.summary.get("pairs"))
    else:
        updates = [r for r in rows if "time/generation" in r]
        out |= {"completions": result.summary["episodes"], "logged_updates": len(updates),
                "completion_tokens": sum(r["completions/mean_length"] * s["batch_size"] for r in updates),
                "generation_seconds": sum(r["time/generation"] for r in updates)}
    out["last_log"] = rows[-1] if rows else {}
    print(json.dumps(out))


# --- running children -----------------------------------------------------------------------


def run_child(variant: str, method: str, files: dict, threads: int, seed: int, out: Path) -> dict:
    """One run of one variant in a fresh process; returns its JSON line."""
    settings = dict(METHODS[method])
    if method != "dpo":  # TRL counts optimiser steps; each rollout is num_iterations of them
        settings["max_steps"] = settings["rollouts"] * settings["num_iterations"]
    spec = {"method": method, "model": str(files["model"]), "data": str(files["pairs" if method == "dpo" else "prompts"]),
            "settings": settings, "threads": threads, "seed": seed, "out": str(out), "rlhflab_src": str(SRC),
            "trl_options": VARIANTS[method].get(variant, {}), "clock": "cpu" if variant == "rlhflab_cpu" else "wall"}
    out.mkdir(parents=True, exist_ok=True)
    spec_file = out / "spec.json"
    spec_file.write_text(json.dumps(spec))
    if variant.startswith("rlhflab"):
        cmd = [sys.executable, __file__, "--child", str(spec_file)]
    else:
        cmd = [str(TRL_PYTHON), str(HERE / "trl116_child.py"), "--spec", str(spec_file)]
    env = {**child_env(threads), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_DATASETS_CACHE": str(out / "hf-datasets")}  # TRL's precomputed reference log-probs are not reused
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    (out / "stdout.txt").write_text(proc.stdout)
    (out / "stderr.txt").write_text(proc.stderr)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
        return {"failed": tail[0], "variant": variant}
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "variant": variant}


def work(r: dict, method: str) -> float:
    return r["pairs"] if method == "dpo" else r["completions"]


def summary_line(r: dict, method: str) -> str:
    if "failed" in r:
        return f"FAILED: {r['failed']}"
    unit = "pairs" if method == "dpo" else "completions"
    n = work(r, method)
    clocks = [f"{n / r[k]:6.1f} {unit}/{name} ({n} in {r[k]:.1f} {name})"
              for k, name in (("seconds", "s"), ("cpu_seconds", "CPU-s")) if r.get(k)]
    line = ", ".join(clocks)
    if method != "dpo":
        line += f", mean length {r['completion_tokens'] / r['completions']:.1f}"
        if r.get("seconds"):
            line += f", generation {r['generation_seconds']:.1f} s"
    return line + f", setup {r['setup_seconds']:.1f} s, {r['peak_rss_mib']:.0f} MiB, load {r['loadavg_1min_after']:.1f}"


def variants(method: str, threads: int) -> tuple[str, ...]:
    """The runs of one repeat. At 1 thread rlhflab also runs with its trainer's clock on CPU time
    (TRL's CPU time is measured in every run): CPU seconds barely move when other processes share
    the cores, wall seconds do."""
    return ("rlhflab", *(("rlhflab_cpu",) if threads == 1 else ()), *VARIANTS[method])


def benchmark(files: dict, methods: list[str], threads_list: list[int], repeats: int, run_root: Path) -> list[dict]:
    """rlhflab, (rlhflab on CPU time,) TRL (, TRL variant), rlhflab, ...: every repeat runs each variant once."""
    results = []
    for method in methods:
        for threads in threads_list:
            for repeat in range(repeats):
                for variant in variants(method, threads):
                    out = run_root / f"{method}-t{threads}-r{repeat}-{variant}"
                    r = run_child(variant, method, files, threads, seed=repeat, out=out)
                    r |= {"method": method, "threads_asked": threads, "repeat": repeat}
                    print(f"  {method:<5} {threads}t r{repeat} {variant:<15} " + summary_line(r, method), flush=True)
                    results.append(r)
    return results


# --- the table --------------------------------------------------------------------------------


COLUMNS = ["method", "threads", "rlhflab /s", "TRL /s", "x TRL", "rlhflab /CPU-s", "TRL /CPU-s", "x TRL (CPU)",
           "len rlhflab", "len TRL", "gen s rlhflab", "gen s TRL", "setup s rlhflab", "setup s TRL", "RSS rlhflab",
           "RSS TRL", "load"]


def table_rows(results: list[dict], method: str, threads: int) -> list[list[str]]:
    """One row per TRL variant: medians of the repeats; x TRL = rlhflab / TRL throughput."""
    runs = lambda v: [r for r in results if (r["method"], r["threads_asked"], r["variant"]) == (method, threads, v)]  # noqa: E731
    ours, ours_cpu = runs("rlhflab"), runs("rlhflab_cpu")
    online = method != "dpo"
    rate = lambda rs, clock="seconds": median_of(rs, lambda r: work(r, method) / r[clock] if r.get(clock) else None)  # noqa: E731
    length = lambda rs: median_of(rs, lambda r: r["completion_tokens"] / r["completions"]) if online else None  # noqa: E731
    gen = lambda rs: median_of(rs, lambda r: r["generation_seconds"]) if online else None  # noqa: E731
    setup = lambda rs: median_of(rs, lambda r: r["setup_seconds"])  # noqa: E731
    rss = lambda rs: median_of(rs, lambda r: r["peak_rss_mib"])  # noqa: E731
    load = median_of([r for r in results if (r["method"], r["threads_asked"]) == (method, threads)],
                     lambda r: r["loadavg_1min_after"])
    rows = []
    for variant in VARIANTS[method]:
        theirs = runs(variant)
        name = method if variant == "trl" else f"{method} ({variant.removeprefix('trl_')})"
        cpu = threads == 1
        rows.append([name, str(threads), cell(rate(ours), ".1f"), cell(rate(theirs), ".1f"),
                     ratio(rate(ours), rate(theirs)),
                     cell(rate(ours_cpu, "cpu_seconds") if cpu else None, ".1f"),
                     cell(rate(theirs, "cpu_seconds") if cpu else None, ".1f"),
                     ratio(rate(ours_cpu, "cpu_seconds"), rate(theirs, "cpu_seconds")) if cpu else "-",
                     cell(length(ours), ".1f"), cell(length(theirs), ".1f"), cell(gen(ours), ".1f"),
                     cell(gen(theirs), ".1f"), cell(setup(ours), ".1f"), cell(setup(theirs), ".1f"),
                     cell(rss(ours), ".0f"), cell(rss(theirs), ".0f"), cell(load, ".1f")])
    return rows


def results_table(results: list[dict]) -> str:
    keys = dict.fromkeys((r["method"], r["threads_asked"]) for r in results)
    rows = [row for method, threads in keys for row in table_rows(results, method, threads)]
    n = max((r["repeat"] for r in results), default=0) + 1
    return (markdown_table(COLUMNS, rows) + f"\nmedians of {n} repeat(s); /s = completions (DPO: pairs) per wall "
            "second of the training loop; /CPU-s = per CPU second of this process in the loop (1 thread only); "
            "len = mean completion length in tokens (EOS included); gen s = seconds in generation per run; setup s "
            "= loading + building (+ rlhflab DPO's reference log-probs, + TRL DPO's with precompute), not timed; "
            "RSS = peak RSS in MiB; load = median 1-minute load average after the runs (2 cores)")


def machine_lines(threads_list: list[int]) -> list[str]:
    import peft
    import torch
    import transformers

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    trl_versions = "not installed (see the setup at the top of this file)"
    if TRL_PYTHON.exists():
        code = ("import trl, torch, transformers, peft, accelerate, datasets; print(trl.__version__, torch.__version__, "
                "transformers.__version__, peft.__version__, accelerate.__version__, datasets.__version__)")
        out = subprocess.run([str(TRL_PYTHON), "-c", code], capture_output=True, text=True).stdout.split()
        names = ("trl", "torch", "transformers", "peft", "accelerate", "datasets")
        trl_versions = ", ".join(f"{n} {v}" for n, v in zip(names, out)) if len(out) == len(names) else "?"
    git = lambda *a: subprocess.run(["git", *a], cwd=HERE, capture_output=True, text=True).stdout.strip()  # noqa: E731
    dirty = " + uncommitted changes under src/" if git("status", "--porcelain", "--", str(SRC)) else ""
    return [f"rlhflab: commit {git('rev-parse', '--short', 'HEAD')}{dirty}",
            f"machine: {cpu}, {os.cpu_count()} CPUs visible, {platform.system()} {platform.release()}",
            f"threads: {threads_list} (torch.set_num_threads and OMP_NUM_THREADS in every child), "
            f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}",
            f"rlhflab side: torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, "
            f"python {platform.python_version()}",
            f"TRL side:     {trl_versions}"]


def settings_lines(methods: list[str]) -> list[str]:
    return [f"settings {m}: {json.dumps(METHODS[m])}" for m in methods]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=",".join(METHODS), help=f"any of {list(METHODS)}, comma-separated")
    parser.add_argument("--threads", default="1,2", help="thread counts to run, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sft_steps", type=int, default=600, help="steps of the cached `rlhflab sft` model")
    parser.add_argument("--table", default=None, help="only print the table of a results.json (of one or more runs)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        rlhflab_child(json.loads(Path(args.child).read_text()))
        return
    if args.table:
        print(results_table([r for f in args.table.split(",") for r in json.loads(Path(f).read_text())]))
        return
    if not TRL_PYTHON.exists():
        raise SystemExit(f"{TRL_PYTHON} not found: run the setup at the top of {__file__}")
    methods, threads_list = args.methods.split(","), [int(t) for t in args.threads.split(",")]
    print("\n".join(machine_lines(threads_list) + settings_lines(methods)), flush=True)
    files = prepare(args.sft_steps, max(threads_list))
    run_root = Path(tempfile.mkdtemp(prefix="methods-vs-trl-", dir=CACHE))
    results = benchmark(files, methods, threads_list, args.repeats, run_root)
    (run_root / "results.json").write_text(json.dumps(results, indent=1))
    print("\n" + results_table(results), flush=True)
    print(f"\nraw results: {run_root}")


if __name__ == "__main__":
    main()
