"""rlhflab PPO vs TRL 1.12 PPO on identical work, each run in its own process (not run by CI).

Setup, once (TRL's PPOTrainer exists only up to trl 1.12.0; it gets its own virtualenv):

    python -m venv benchmarks/.venv-trl          # the same python as .venv
    benchmarks/.venv-trl/bin/pip install torch==2.13.0     # the CPU wheel first; a bare `torch` pulls CUDA
    benchmarks/.venv-trl/bin/pip install trl==1.12.0 peft requests

Run (from the repository root, in the project's .venv):

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/ppo_vs_trl.py                 # everything
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/ppo_vs_trl.py --parts ppo --threads 1 --repeats 3

Parts: `ppo` (throughput + peak RSS + held-out pass rate after the same episodes, median of
repeats, runs alternating rlhflab / TRL / TRL without gc.collect), `rollout` (rlhflab's
generation vs `model.generate`), `mfu` (fp32 matmul peak and model-FLOPs utilisation per
phase for the demo model and a ~25M-parameter one). See benchmarks/RESULTS.md.

`seeds` (issue 16 item 6; not in the default parts): learning per episode over many seeds. Each arm
(`ARMS`: rlhflab, TRL, or TRL with one piece of its loop done rlhflab's way, trl_child.PROBES) runs
full fine-tune, 1 PPO epoch, 1 thread, once per seed; the held-out pass rate of every policy goes to a
JSONL file, and the table gives mean +- sd and Welch's t per arm, with the benchmark's reward model
or with the suite's checker as the reward on both sides (`--reward checker`):

    .venv/bin/python benchmarks/ppo_vs_trl.py --parts seeds --threads 1 --seeds 0-19 --arms rlhflab,TRL \
        --reward checker --results benchmarks/.cache/seeds/checker.jsonl
    .venv/bin/python benchmarks/ppo_vs_trl.py --table benchmarks/.cache/seeds/checker.jsonl
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported (FACTS.md)

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from peak_rss import rss_mib  # noqa: E402

from bench_assets import CACHE, Assets, child_env, prepare  # noqa: E402

HERE = Path(__file__).resolve().parent
TRL_PYTHON = HERE / ".venv-trl" / "bin" / "python"

# Identical on both sides. TRL's PPO loop never clips gradients, so rlhflab's clipping is off.
SHARED = dict(batch_size=8, num_mini_batches=1, response_length=32, total_episodes=256, temperature=0.7,
              learning_rate=1e-4, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-5, kl_coef=0.05, cliprange=0.2,
              cliprange_value=0.2, vf_coef=0.1, gamma=1.0, lam=0.95, missing_eos_penalty=1.0, lora_alpha=16)
CONFIGS = {
    "full 1 epoch": dict(num_ppo_epochs=1, lora_r=0),
    "full 4 epochs": dict(num_ppo_epochs=4, lora_r=0),
    "LoRA r8 1 epoch": dict(num_ppo_epochs=1, lora_r=8),
}
VARIANTS = ("rlhflab", "trl", "trl_no_gc")




# --- the rlhflab child ----------------------------------------------------------------------


def tie_sampling_seed() -> None:
    """rlhflab before 664d07b: token sampling from ONE generator seeded with `seed`, the prompt-order
    generator's seed (the state issue 16 item 6's 20-seed gap was measured in), instead of a generator of
    its own per update (trainers/online/ranks.rollout_generator)."""
    import torch

    from rlhflab.trainers.online import loop

    kept: dict = {}

    def one_generator(seed: int, update: int, device) -> torch.Generator:
        if "sampler" not in kept:
            kept["sampler"] = torch.Generator(device=device).manual_seed(seed)
        return kept["sampler"]

    loop.rollout_generator = one_generator


RLHFLAB_PROBES = {"tied_sampling_seed": tie_sampling_seed}


def rlhflab_child(spec: dict) -> None:
    """One `rlhflab ppo` run through the Python API; prints one JSON line."""
    import torch

    from rlhflab.config import PPOConfig
    from rlhflab.trainers import ppo

    for probe in spec.get("rlhflab_probes", []):
        RLHFLAB_PROBES[probe]()

    s = spec["settings"]
    before = rss_mib()
    keys = ("batch_size", "num_mini_batches", "response_length", "total_episodes", "temperature", "learning_rate",
            "adam_beta1", "adam_beta2", "adam_eps", "kl_coef", "cliprange", "cliprange_value", "vf_coef", "gamma",
            "lam", "missing_eos_penalty", "lora_alpha", "num_ppo_epochs", "lora_r")
    reward = spec.get("reward", "model")  # "checker": the suite's checker, as the TRL child's checker reward
    cfg = PPOConfig(model=spec["sft"], reward=reward, reward_model=spec["reward_model"] if reward == "model" else "",
                    normalize_reward=False, headroom_samples=0,
                    value_mode=spec.get("value_mode", "shared"), max_grad_norm=0.0, lr_schedule="linear",
                    warmup_steps=0, weight_decay=0.0, device="cpu", threads=spec["threads"], seed=spec["seed"],
                    eval_every=0, eval_prompts=8, sample_prompts=0, console_samples=0, save_every=0,
                    progress=False, output_dir=spec["out"], overwrite=True, **{k: s[k] for k in keys},
                    **({"value_model": spec["value_model"]} if spec.get("value_mode") == "separate" else {}),
                    **spec.get("rlhflab_options", {}))
    started = time.time()
    result = ppo.train(cfg)
    total = time.time() - started
    # timed like TRL's trainer.train(): the update loop only (rollout, scoring, PPO epochs, metrics),
    # not loading, the start / end evaluation or the final save (summary wall_time_s, ppo.train)
    walls = result.summary["wall_time_s"]
    rows = [json.loads(line) for line in (Path(result.run_dir) / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in rows if "time/generation" in r]
    phase = {k: sum(r[f"time/{k}"] for r in updates) for k in ("generation", "scoring", "training")}
    print(json.dumps({"library": "rlhflab", "seconds": walls["loop"], "train_call_seconds": total,
                      "wall_time_s": walls, "phase_seconds": phase, "episodes": result.summary["episodes"],
                      "response_tokens": sum(r["response/length_mean"] * s["batch_size"] for r in updates),
                      "peak_rss_mib": rss_mib(), "rss_before_models_mib": before,
                      "threads": torch.get_num_threads(), "model_dir": str(result.model_dir),
                      "loadavg_1min_after": os.getloadavg()[0]}))


# --- running children -----------------------------------------------------------------------


def run_child(variant: str, assets: Assets, config: str, threads: int, seed: int, out: Path,
              rlhflab_options: dict | None = None, save_model: bool = True, env: dict | None = None,
              extra: dict | None = None, **overrides) -> dict:
    """One run of one variant in a fresh process; returns its JSON line. `extra`: more spec keys
    (`reward`, `trl_probes`, `prompt_items`, `no_gc`: the seeds part), over the ones set here."""
    spec = {"sft": str(assets.sft), "reward_model": str(assets.reward_model), "value_model": str(assets.value_model),
            "prompts": str(assets.prompts), "settings": {**SHARED, **CONFIGS[config], **overrides}, "threads": threads,
            "seed": seed, "out": str(out), "no_gc": variant == "trl_no_gc", "rlhflab_options": rlhflab_options or {},
            # gc changes no number: one TRL model per repeat is evaluated
            "save_model": save_model and variant != "trl_no_gc", **(extra or {})}
    out.mkdir(parents=True, exist_ok=True)
    spec_file = out / "spec.json"
    spec_file.write_text(json.dumps(spec))
    if variant == "rlhflab":
        cmd = [sys.executable, __file__, "--child", str(spec_file)]
    else:
        cmd = [str(TRL_PYTHON), str(HERE / "trl_child.py"), "--spec", str(spec_file)]
    proc = subprocess.run(cmd, env={**child_env(threads), **(env or {})}, capture_output=True, text=True)
    (out / "stderr.txt").write_text(proc.stderr)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
        return {"failed": tail[0], "variant": variant}
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "variant": variant}


def held_out_pass_rate(model_dir: str, threads: int) -> float:
    """Greedy pass rate on the suite's test split (300 prompts since 86b6765; split_seed 0, disjoint from
    the 400 train prompts both sides learn from), the same evaluation for every model."""
    import torch

    from rlhflab import models
    from rlhflab.config import EvalConfig
    from rlhflab.eval import answer_and_check, eval_prompts, eval_verifier, table_from_rows

    torch.set_num_threads(threads)
    cfg = EvalConfig(model=model_dir, split="test", do_sample=False, max_new_tokens=32, device="cpu")
    model = models.load_causal_lm(model_dir)
    tokenizer = models.load_tokenizer(model_dir)
    rows = eval_prompts(cfg)
    return table_from_rows(answer_and_check(model, tokenizer, rows, eval_verifier(cfg, rows), cfg))["overall"]


def benchmark(assets: Assets, configs: list[str], threads_list: list[int], repeats: int, run_root: Path,
              episodes: int) -> list[dict]:
    """A B C A B C ...: every repeat runs each variant once, for each config and thread count."""
    results = []
    for config in configs:
        for threads in threads_list:
            for repeat in range(repeats):
                for variant in VARIANTS:
                    out = run_root / f"{config.replace(' ', '')}-t{threads}-r{repeat}-{variant}"
                    r = run_child(variant, assets, config, threads, seed=repeat, out=out, total_episodes=episodes)
                    r |= {"config": config, "threads_asked": threads, "repeat": repeat}
                    if "failed" not in r and variant != "trl_no_gc":
                        r["pass_rate"] = held_out_pass_rate(r["model_dir"], threads)
                    print(f"  {config:<17} {threads}t r{repeat} {variant:<10} " + summary_line(r), flush=True)
                    results.append(r)
    return results


def summary_line(r: dict) -> str:
    if "failed" in r:
        return f"FAILED: {r['failed']}"
    eps = r["episodes"] / r["seconds"]
    rate = f", pass rate {r['pass_rate']:.2f}" if "pass_rate" in r else ""
    return f"{eps:6.1f} episodes/s, {r['response_tokens'] / r['seconds']:7.0f} tokens/s, {r['peak_rss_mib']:5.0f} MiB{rate}"


# --- the table --------------------------------------------------------------------------------


def median_of(runs: list[dict], key) -> float | None:
    values = [key(r) for r in runs if "failed" not in r and key(r) is not None]
    return statistics.median(values) if values else None


def cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def ratio(a, b) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


COLUMNS = ["config", "threads", "eps rlhflab", "eps TRL", "eps TRL-nogc", "x TRL", "x TRL-nogc",
           "tok/s rlhflab", "tok/s TRL", "tok/s TRL-nogc", "RSS rlhflab", "RSS TRL", "x RSS", "pass rlhflab", "pass TRL"]


def table_row(results: list[dict], config: str, threads: int) -> list[str]:
    """Medians of the repeats of one (config, threads); ratios are rlhflab / TRL."""
    runs = {v: [r for r in results if (r["config"], r["threads_asked"], r["variant"]) == (config, threads, v)]
            for v in VARIANTS}
    med = lambda key: {v: median_of(runs[v], key) for v in VARIANTS}  # noqa: E731
    eps = med(lambda r: r["episodes"] / r["seconds"])
    tok = med(lambda r: r["response_tokens"] / r["seconds"])
    rss = med(lambda r: r["peak_rss_mib"])
    rate = med(lambda r: r.get("pass_rate"))
    return [config, str(threads), *(cell(eps[v], ".1f") for v in VARIANTS), ratio(eps["rlhflab"], eps["trl"]),
            ratio(eps["rlhflab"], eps["trl_no_gc"]), *(cell(tok[v], ".0f") for v in VARIANTS),
            cell(rss["rlhflab"], ".0f"), cell(rss["trl"], ".0f"), ratio(rss["rlhflab"], rss["trl"]),
            cell(rate["rlhflab"], ".2f"), cell(rate["trl"], ".2f")]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def ppo_table(results: list[dict], sft_pass_rate: float | None, episodes: int) -> str:
    """eps = episodes/s, tok/s = response tokens (up to EOS) per second, RSS = peak RSS in MiB."""
    keys = dict.fromkeys((r["config"], r["threads_asked"]) for r in results)
    rows = [table_row(results, config, threads) for config, threads in keys]
    n = max((r["repeat"] for r in results), default=0) + 1
    return (markdown_table(COLUMNS, rows) + f"\nmedians of {n} repeat(s); pass = greedy pass rate on the suite's "
            f"test split (100 prompts) after {episodes} episodes; SFT start: "
            f"{cell(sft_pass_rate, '.2f')}")


def machine_lines(threads_list: list[int]) -> list[str]:
    import peft
    import torch
    import transformers

    import rlhflab

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    trl_versions = "not installed (see the setup at the top of this file)"
    if TRL_PYTHON.exists():
        code = "import trl, torch, transformers, peft; print(trl.__version__, torch.__version__, transformers.__version__, peft.__version__)"
        out = subprocess.run([str(TRL_PYTHON), "-c", code], capture_output=True, text=True).stdout.split()
        trl_versions = f"trl {out[0]}, torch {out[1]}, transformers {out[2]}, peft {out[3]}" if len(out) == 4 else "?"
    return [f"machine: {cpu}, {os.cpu_count()} CPUs visible, {platform.system()} {platform.release()}",
            f"threads: {threads_list} (torch.set_num_threads and OMP_NUM_THREADS in every child), "
            f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}",
            f"rlhflab side: rlhflab {getattr(rlhflab, '__version__', '?')}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, peft {peft.__version__}, python {platform.python_version()}",
            f"TRL side:     {trl_versions}"]


def settings_line(episodes: int) -> str:
    s = SHARED
    return (f"settings: batch {s['batch_size']}, response_length {s['response_length']}, {episodes} episodes, "
            f"temperature {s['temperature']}, 1 minibatch, lr {s['learning_rate']} linear decay, AdamW betas "
            f"({s['adam_beta1']}, {s['adam_beta2']}) eps {s['adam_eps']}, no grad clipping, kl_coef {s['kl_coef']} (k1), "
            f"clip {s['cliprange']}/{s['cliprange_value']}, vf_coef {s['vf_coef']}, gamma {s['gamma']}, lam {s['lam']}, "
            f"missing-EOS penalty {s['missing_eos_penalty']}, LoRA alpha {s['lora_alpha']} all-linear; "
            f"rlhflab value head on the policy trunk, TRL a separate value model")


# --- the other parts ----------------------------------------------------------------------


def rollout_part(assets: Assets, threads_list: list[int]) -> str:
    from rollout_speed import ROLLOUT_COLUMNS, rollout_rows

    prompts = json.loads(assets.prompts.read_text())
    return markdown_table(ROLLOUT_COLUMNS, rollout_rows(str(assets.sft), prompts, threads_list))


def mfu_part(assets: Assets, threads_list: list[int], run_root: Path) -> str:
    """fp32 matmul peak, then one short rlhflab PPO run per model size and thread count."""
    from hardware_limit import MFU_COLUMNS, build_25m, matmul_gflops, mfu_rows

    peaks = {t: max(matmul_gflops(t, 512), matmul_gflops(t, 1024), matmul_gflops(t, 2048)) for t in threads_list}
    big_policy, big_rm = build_25m(CACHE / "size25m")
    sizes = {"demo (SFT)": (assets, 256), "~25M (random init)": (Assets(big_policy, big_rm, big_rm, assets.prompts, {}), 32)}
    rows = []
    for name, (model_assets, episodes) in sizes.items():
        for threads in threads_list:
            out = run_root / f"mfu-{name.split()[0].strip('~')}-t{threads}"
            run = run_child("rlhflab", model_assets, "full 1 epoch", threads, 0, out, total_episodes=episodes)
            if "failed" in run:
                rows.append([name, "-", str(threads), f"FAILED: {run['failed']}", *["-"] * 5])
                continue
            rows += mfu_rows(name, str(model_assets.sft), run, peaks[threads], 1, False,
                             assets.notes["mean_prompt_tokens"])
    peak_line = ", ".join(f"{t} thread(s): {p:.1f} GFLOP/s" for t, p in peaks.items())
    return f"fp32 matmul peak (best of 512/1024/2048 square): {peak_line}\n" + markdown_table(MFU_COLUMNS, rows)


def memory_part(assets: Assets, threads: int, run_root: Path, episodes: int = 32) -> str:
    """Peak RSS in LoRA mode at ~25M parameters, where the models, not the imports, dominate.

    Same random-init ~25M Llama policy + same-size reward model as the mfu part (TRL's value
    model is that reward model, a full second network; rlhflab's value is a head on the policy
    trunk). Fewer episodes than the throughput runs: peak memory is reached in the first update.
    """
    from hardware_limit import build_25m

    big_policy, big_rm = build_25m(CACHE / "size25m")
    big = Assets(big_policy, big_rm, big_rm, assets.prompts, {})
    same_malloc = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}  # what mmap_threshold_mib=1 sets, via glibc's env
    runs = {
        "rlhflab (defaults)": ("rlhflab", {}, {}),
        "rlhflab, lora_merge_generation=true": ("rlhflab", {"lora_merge_generation": True}, {}),
        "rlhflab, mmap_threshold_mib=1": ("rlhflab", {"mmap_threshold_mib": 1}, {}),
        "rlhflab, mmap_threshold_mib=1, reuse_rollout_forward=false": (
            "rlhflab", {"mmap_threshold_mib": 1, "reuse_rollout_forward": False}, {}),
        "TRL 1.12 with MALLOC_MMAP_THRESHOLD_=1MiB": ("trl", {}, same_malloc),
        "TRL 1.12": ("trl", {}, {}),
    }
    rows, results = [], {}
    for name, (variant, options, env) in runs.items():
        out = run_root / f"memory-25m-{variant}-{len(results)}"
        # both sides load, train and save the policy (rlhflab's ppo.train saves it; TRL's peak is taken
        # after its save too, "peak_rss_after_save_mib"), so each peak covers the same work
        r = run_child(variant, big, "LoRA r8 1 epoch", threads, 0, out, rlhflab_options=options, env=env,
                      total_episodes=episodes)
        r["peak_rss_mib"] = max(r.get("peak_rss_mib", 0), r.get("peak_rss_after_save_mib", 0))
        results[name] = r
        if "failed" in r:
            rows.append([name, f"FAILED: {r['failed']}", "-", "-", "-"])
            continue
        print(f"  memory 25M LoRA {name}: {r['peak_rss_mib']:.0f} MiB peak", flush=True)
        rows.append([name, f"{r['rss_before_models_mib']:.0f}", f"{r['peak_rss_mib']:.0f}",
                     f"{r['peak_rss_mib'] - r['rss_before_models_mib']:.0f}", f"{r['episodes'] / r['seconds']:.1f}"])
    trl = results["TRL 1.12"]
    if "failed" not in trl:
        for row, r in zip(rows, results.values()):
            row.append("-" if "failed" in r else f"{r['peak_rss_mib'] / trl['peak_rss_mib']:.2f}x")
    (run_root / "memory_results.json").write_text(json.dumps(results, indent=1))
    header = ["run (LoRA r8, ~25M params)", "RSS before models", "peak RSS", "peak - before", "episodes/s", "x TRL"]
    return (f"{episodes} episodes, {threads} thread(s), RSS in MiB\n" + markdown_table(header, rows))


# --- learning per episode over seeds (issue 16 item 6) ------------------------------------------

# arm -> side and what differs from that side's benchmark run: rlhflab PPOConfig options, or the
# trl_child.PROBES that do one piece of TRL's loop rlhflab's way (the reverse of the probes on rlhflab)
ARMS = {
    "rlhflab": ("rlhflab", {}),
    "rlhflab value model": ("rlhflab", {"value_mode": "separate"}),  # TRL's design: the `value` asset
    "rlhflab tied sampling seed": ("rlhflab", {"probes": ["tied_sampling_seed"]}),  # RLHFLAB_PROBES
    # the critic before 3e04953 (issue 16 item 7): value head at the policy's learning rate, no warm-up
    "rlhflab old critic": ("rlhflab", {"value_head_learning_rate": SHARED["learning_rate"], "value_warmup_rollouts": 0}),
    "rlhflab as at the issue": ("rlhflab", {"value_head_learning_rate": SHARED["learning_rate"],
                                            "value_warmup_rollouts": 0, "probes": ["tied_sampling_seed"]}),
    "TRL": ("trl", []),
    "TRL score at EOS": ("trl", ["score_at_eos"]),
    "TRL value head on trunk": ("trl", ["shared_trunk"]),
    "TRL zero value head": ("trl", ["zero_value_head"]),
    "TRL rlhflab sampler": ("trl", ["sampler"]),
    "TRL rlhflab scoring": ("trl", ["rescore"]),
    "TRL all four": ("trl", ["score_at_eos", "shared_trunk", "sampler", "rescore"]),
}


def seed_list(text: str) -> list[int]:
    if "-" in text:
        first, last = text.split("-")
        return list(range(int(first), int(last) + 1))
    return [int(x) for x in text.split(",")]


def read_results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def write_prompt_items(assets: Assets) -> Path:
    """The train prompts' suite items, in prompts.json's order (what the TRL child's checker reward reads)."""
    from rlhflab import tasks

    path = assets.prompts.parent / "prompt_items.json"
    items = tasks.build_splits(0)["train"]  # bench_assets.write_prompts' prompts, same order
    path.write_text(json.dumps([{"family": i.family, "prompt": i.prompt, "reference": i.reference,
                                 "content": list(i.content)} for i in items]))
    return path


def seeds_part(assets: Assets, arms: list[str], seeds: list[int], reward: str, results_file: Path,
               episodes: int) -> None:
    """Every arm once per seed (seed-major, so a busy spell on the machine hits every arm alike), full
    fine-tune, 1 PPO epoch, 1 thread; each policy's held-out pass rate appended to `results_file`."""
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; known: {list(ARMS)}")
    items = write_prompt_items(assets)
    done = {(r["arm"], r["reward"], r["seed"]) for r in read_results(results_file)}
    results_file.parent.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        for arm in arms:
            if (arm, reward, seed) in done:
                continue
            side, change = ARMS[arm]
            out = results_file.parent / f"seeds-{reward}-{arm.replace(' ', '_')}-s{seed}"
            options = dict(change) if side == "rlhflab" else {}
            # TRL's gc.collect calls change no number (they free memory), only its time: off
            extra = {"reward": reward, "prompt_items": str(items), "trl_probes": change if side == "trl" else [],
                     "no_gc": True}
            if "value_mode" in options:  # the child passes the value model's folder with it
                extra["value_mode"] = options.pop("value_mode")
            extra["rlhflab_probes"] = options.pop("probes", [])
            r = run_child(side, assets, "full 1 epoch", 1, seed, out,
                          rlhflab_options=options, extra=extra, total_episodes=episodes, save_model=True)
            row = {"arm": arm, "reward": reward, "seed": seed, "episodes": episodes}
            if "failed" in r:
                print(f"  {arm:<24} seed {seed:2d}: FAILED {r['failed']} (see {out}/stderr.txt)", flush=True)
                continue
            row |= {"pass_rate": held_out_pass_rate(r["model_dir"], 1), "episodes_per_s": r["episodes"] / r["seconds"],
                    "loadavg_1min_after": r["loadavg_1min_after"]}
            shutil.rmtree(r["model_dir"], ignore_errors=True)  # ~the SFT model's size each; the rate is what is kept
            with results_file.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"  {arm:<24} {reward} seed {seed:2d}: pass rate {row['pass_rate']:.3f}, "
                  f"{row['episodes_per_s']:.0f} episodes/s", flush=True)


def welch(a: list[float], b: list[float]) -> tuple[float, float]:
    """Welch's t of mean(a) - mean(b) and its Welch-Satterthwaite degrees of freedom."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return float("nan"), float("nan")
    t = (statistics.mean(a) - statistics.mean(b)) / (va + vb) ** 0.5
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return t, df


def seeds_table(results: list[dict]) -> str:
    """Per (arm, reward): seeds, mean +- sd of the held-out pass rate, Welch t against TRL as shipped
    (same reward, the seeds both ran) and against rlhflab."""
    groups: dict[tuple[str, str], dict[int, float]] = {}
    for r in results:
        groups.setdefault((r["arm"], r["reward"]), {})[r["seed"]] = r["pass_rate"]
    rows = []
    for (arm, reward), by_seed in groups.items():
        rates = list(by_seed.values())
        cells = [arm, reward, str(len(rates)), f"{statistics.mean(rates):.3f} +- "
                 f"{statistics.stdev(rates) if len(rates) > 1 else float('nan'):.3f}"]
        for ref in ("TRL", "rlhflab"):
            other = groups.get((ref, reward), {})
            mine, theirs = list(by_seed.values()), list(other.values())
            if ref == arm or len(mine) < 2 or len(theirs) < 2:
                cells.append("-")
                continue
            t, df = welch(mine, theirs)
            cells.append(f"{statistics.mean(mine) - statistics.mean(theirs):+.3f} (t {t:+.2f}, df {df:.0f})")
        rows.append(cells)
    header = ["arm", "reward", "seeds", "held-out pass rate", "vs TRL", "vs rlhflab"]
    return (markdown_table(header, rows) + "\nheld-out = greedy pass rate on the suite's 300-prompt test split after "
            "the run (full fine-tune, 1 PPO epoch, batch 8, 1 thread); t = Welch's t")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="ppo,rollout,mfu,memory",
                        help="comma-separated: ppo, rollout, mfu, memory, seeds (not in the default)")
    parser.add_argument("--seeds", default="0-19", help="seeds part: seeds, 'A-B' or comma-separated")
    parser.add_argument("--arms", default="rlhflab,TRL", help=f"seeds part: any of {list(ARMS)}, comma-separated")
    parser.add_argument("--reward", default="model", choices=("model", "checker"),
                        help="seeds part: the benchmark's reward model on both sides, or the suite's checker")
    parser.add_argument("--results", default=None, help="seeds part: JSONL file runs are appended to (and "
                        "read back: a finished (arm, reward, seed) is not run again); default: a new run folder")
    parser.add_argument("--table", default=None, help="print the seeds table of a --results file and exit")
    parser.add_argument("--threads", default="1,2", help="thread counts to run, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"any of {list(CONFIGS)}, comma-separated")
    parser.add_argument("--episodes", type=int, default=SHARED["total_episodes"], help="episodes per PPO run")
    parser.add_argument("--sft_steps", type=int, default=600, help="steps of the cached `rlhflab sft` model")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        rlhflab_child(json.loads(Path(args.child).read_text()))
        return
    if args.table:
        print(seeds_table(read_results(Path(args.table))))
        return
    parts, threads_list = args.parts.split(","), [int(t) for t in args.threads.split(",")]
    print("\n".join(machine_lines(threads_list)), flush=True)
    assets = prepare(args.sft_steps, max(threads_list))
    print(f"assets: {json.dumps(assets.notes)}", flush=True)
    run_root = Path(tempfile.mkdtemp(prefix="ppo-vs-trl-", dir=CACHE))
    report = {}
    if "ppo" in parts or "seeds" in parts:
        if not TRL_PYTHON.exists():
            raise SystemExit(f"{TRL_PYTHON} not found: run the setup at the top of {__file__}")
    if "ppo" in parts:
        if not TRL_PYTHON.exists():
            raise SystemExit(f"{TRL_PYTHON} not found: run the setup at the top of {__file__}")
        print(settings_line(args.episodes), flush=True)
        results = benchmark(assets, args.configs.split(","), threads_list, args.repeats, run_root, args.episodes)
        (run_root / "ppo_results.json").write_text(json.dumps(results, indent=1))
        report["ppo"] = ppo_table(results, held_out_pass_rate(str(assets.sft), max(threads_list)), args.episodes)
        print("\n" + report["ppo"], flush=True)
    if "seeds" in parts:
        results_file = Path(args.results) if args.results else run_root / "seeds.jsonl"
        arms = args.arms.split(",")
        seeds_part(assets, arms, seed_list(args.seeds), args.reward, results_file, args.episodes)
        report["seeds"] = seeds_table([r for r in read_results(results_file) if r["arm"] in arms])
        print("\n" + report["seeds"], flush=True)
    if "rollout" in parts:
        report["rollout"] = rollout_part(assets, threads_list)
        print("\n" + report["rollout"], flush=True)
    if "mfu" in parts:
        report["mfu"] = mfu_part(assets, threads_list, run_root)
        print("\n" + report["mfu"], flush=True)
    if "memory" in parts:
        report["memory"] = memory_part(assets, min(threads_list), run_root)
        print("\n" + report["memory"], flush=True)
    (run_root / "report.json").write_text(json.dumps(report, indent=1))
    print(f"\nraw results: {run_root}")


if __name__ == "__main__":
    main()
