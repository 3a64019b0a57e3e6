"""Scale benchmark (issue 30, item 4): rlhflab against TRL on a randomly initialised Qwen2.5-0.5B-shaped model.

    export OMP_WAIT_POLICY=PASSIVE
    .venv/bin/python benchmarks/scale.py --size small --rows grpo-full-fp32-gc,ppo-full-fp32-gc   # quick check
    .venv/bin/python benchmarks/scale.py --size 0.5b                                             # every row
    .venv/bin/python benchmarks/scale.py --table benchmarks/.cache/scale-runs/RUN/results.json    # re-print

The model: Qwen2 with Qwen2.5-0.5B's shape (vocabulary 151,936, hidden 896, 24 layers, 14 heads, 2 key/value
heads, MLP 4,864, tied embeddings), random weights (seed 0), and a byte-level tokenizer with exactly 151,936
pieces (pad, EOS, the 256 byte symbols, byte pairs, byte triples; no merges, so every prompt character is one
token). Both are built here (no download) into benchmarks/.cache/scale-<size>/ and reused. PPO rows also get a
reward model and a value model of the same shape (Qwen2ForSequenceClassification, one label, seeds 1 and 2).

EOS (and pad) are never sampled, on both sides, by the weights themselves rather than by either library's
sampler: residual dimension 0 is a constant (every token's embedding has 0.1 there, and no layer writes to it:
row 0 of every o_proj and down_proj is zero), and EOS's and pad's tied embedding rows are -30,000 x e_0, so their
logits are -3,000 / rms(hidden) while every other logit is O(1). The build checks the margin (printed; it must be
> 30 nats at every position of a teacher-forced batch) and the runs check that every answer has the full length.
So both sides generate exactly --new_tokens tokens per answer (FACTS.md: a random model otherwise emits EOS now
and then). The tokenizer is checked too: rlhflab's loader and PreTrainedTokenizerFast (what the TRL children use;
AutoTokenizer picks Qwen2Tokenizer for a Qwen2 config, FACTS.md) give the same ids, 64 a prompt.

Rows (`--rows`, comma-separated; aliases all, headline, grpo, ppo): `grpo-{full,lora}-{fp32,bf16}[-gc][-tN]`
and `ppo-full-{fp32,bf16}[-gc][-tN]`: full fine-tuning or LoRA r 16 (alpha 32, all linear layers), float32 or
bf16 autocast over float32 master weights (`--bf16` on both sides), gradient checkpointing or not, N generated
tokens (default --new_tokens). GRPO: 4 prompts x 4 answers an update, 64-token prompts, beta 0.04, DAPO, one
pass, lr constant. PPO: 4 prompts, a separate value model and a reward model, one epoch, one minibatch, k1 KL in
the reward (0.05), vf_coef 0.1, whitened advantages, no critic warm-up.

Each run is a fresh process: `.venv/bin/rlhflab grpo|ppo ...` or the TRL child (benchmarks/scale_trl_grpo.py in
benchmarks/.venv-trl116 for TRL 1.16 GRPO, benchmarks/scale_trl_ppo.py in benchmarks/.venv-trl for TRL 1.12
PPO), rlhflab and TRL alternating, OMP_WAIT_POLICY=PASSIVE and the thread count fixed in every child. Each run
does --updates (default 2) updates: the AdamW state is allocated after the first update's peak (FACTS.md), so
the peak RSS is over all of them and the time is the last update's.
- peak RSS: the child's own VmHWM (peak_rss.py) at the end of its last update: rlhflab's is read from
  /proc/PID/status as soon as the last update's metrics line is written (the run is then stopped: its final
  evaluation and save are not measured; --finish_runs lets it end), TRL's by the child after trainer.train().
- seconds of the last update, split: rlhflab's own time/generation, time/scoring (the reference forward and, with
  reuse_rollout_forward, the policy forward whose graph training reuses) and time/training (backward, optimiser
  step); TRL GRPO: generation = its _generate_single_turn, scoring = the rest of _generate_and_score_completions
  (decoding, rewards, reference forward), training = the rest of the optimiser step (policy forward, backward,
  step); TRL PPO: generation = batch_generation, scoring = its no-grad forwards (reference, value, reward),
  training = the rest of the update (PPO epoch, its gc.collect calls included, as shipped).
A run whose RSS passes --max_rss_gb is killed and recorded as "over the memory limit" (the machine is shared:
better a recorded miss than the kernel's OOM killer choosing a victim).

results.json and results.md in --out are rewritten after every run, so a stopped benchmark keeps what it measured.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported, in the build child (FACTS.md)

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

from gpu_check_cases import byte_tokenizer  # noqa: E402  (the same 151,936-piece tokenizer as the GPU check)
from scale_table import results_table, summary_line, write_results  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CACHE = HERE / ".cache"
VENV_BIN = ROOT / ".venv" / "bin"
TRL116_PYTHON = HERE / ".venv-trl116" / "bin" / "python"
TRL112_PYTHON = HERE / ".venv-trl" / "bin" / "python"
REWARD_FN = HERE / "scale_reward.py"

RECIPE = "scale-v1"  # bump when the model / tokenizer / prompts recipe changes: the cache is rebuilt

SHAPES = {
    "0.5b": dict(vocab=151936, hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864),
    "small": dict(vocab=4096, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128),
}
PROMPT_TOKENS = 64
NUM_PROMPTS = 64
# identical on both sides
SETTINGS = dict(learning_rate=1e-6, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, weight_decay=0.0,
                max_grad_norm=1.0, lr_schedule="constant", temperature=1.0, lora_r=16, lora_alpha=32)
GRPO = dict(prompts=4, num_generations=4, beta=0.04, loss_type="dapo", num_iterations=1, epsilon=0.2,
            scale_rewards="group", importance_sampling_level="token")
PPO = dict(prompts=4, num_ppo_epochs=1, num_mini_batches=1, kl_coef=0.05, kl_estimator="k1", vf_coef=0.1,
           cliprange=0.2, cliprange_value=0.2, gamma=1.0, lam=0.95,
           # TRL 1.12's PPOTrainer never clips gradients (its loop calls backward and optimizer.step only;
           # max_grad_norm is read nowhere in it): rlhflab's PPO runs unclipped too, the same update
           max_grad_norm=0.0)
HEADLINE = ("grpo-full-fp32-gc", "grpo-full-bf16-gc")
ALL_ROWS = (
    "grpo-full-fp32", "grpo-full-fp32-gc", "grpo-full-bf16", "grpo-full-bf16-gc",
    "grpo-lora-fp32", "grpo-lora-fp32-gc", "grpo-lora-bf16", "grpo-lora-bf16-gc",
    "grpo-lora-fp32-gc-t512", "grpo-lora-bf16-gc-t512",
    "ppo-full-fp32-gc", "ppo-full-bf16-gc",
)
ROW_PATTERN = re.compile(r"^(grpo|ppo)-(full|lora)-(fp32|bf16)(-gc)?(?:-t(\d+))?$")


@dataclass(frozen=True)
class Row:
    name: str
    method: str  # grpo | ppo
    lora: bool
    bf16: bool
    gc: bool
    new_tokens: int


def parse_row(name: str, new_tokens: int) -> Row:
    m = ROW_PATTERN.match(name)
    if not m:
        raise SystemExit(f"unknown row {name!r}: expected grpo|ppo-full|lora-fp32|bf16[-gc][-tN], e.g. {ALL_ROWS[1]}")
    method, kind, precision, gc, tokens = m.groups()
    if method == "ppo" and kind == "lora":
        raise SystemExit("PPO rows are full fine-tuning only (issue 30 item 4)")
    return Row(name, method, kind == "lora", precision == "bf16", bool(gc), int(tokens) if tokens else new_tokens)


def row_names(spec: str) -> list[str]:
    aliases = {"all": ALL_ROWS, "headline": HEADLINE, "grpo": [r for r in ALL_ROWS if r.startswith("grpo")],
               "ppo": [r for r in ALL_ROWS if r.startswith("ppo")]}
    names = []
    for part in spec.split(","):
        for name in aliases.get(part.strip(), [part.strip()]):
            if name and name not in names:
                names.append(name)
    return names


# --- the model, its tokenizer and the prompts (built in a child: the driver never imports torch) ---------------


def qwen2_config(shape: dict, **extra):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                       num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                       num_key_value_heads=shape["kv_heads"], max_position_embeddings=4096, rope_theta=1e6,
                       rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1,
                       bos_token_id=None, **extra)


def never_emit(model, token_ids: list[int], offset: float = 0.1, scale: float = 3e4) -> None:
    """Make `token_ids` unsampleable (see the module docstring): residual dimension 0 constant `offset`, those
    tokens' tied embedding rows -scale x e_0."""
    import torch

    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        embed[:, 0] = offset
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0].zero_()
            layer.mlp.down_proj.weight[0].zero_()
        for t in token_ids:
            embed[t].zero_()
            embed[t, 0] = -scale


def eos_margin(model, prompt_ids: list[list[int]], new_tokens: int, banned: list[int]) -> float:
    """min over positions of (largest other logit - largest banned logit), teacher-forcing random answers."""
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.tensor(prompt_ids)
    answer = torch.randint(2, model.config.vocab_size, (ids.shape[0], new_tokens), generator=g)
    with torch.no_grad():
        logits = model(input_ids=torch.cat([ids, answer], dim=1)).logits.float()
    bad = logits[..., banned].amax(dim=-1)
    logits[..., banned] = float("-inf")
    return float((logits.amax(dim=-1) - bad).min())


def build(folder: Path, size: str, ppo: bool) -> dict:
    """Build (or reuse) the policy, tokenizer and prompts (and, with `ppo`, reward and value models)."""
    import random

    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2ForSequenceClassification
    from transformers.utils import logging as hf_logging

    from rlhflab.models import load_tokenizer

    hf_logging.disable_progress_bar()
    shape = SHAPES[size]
    folder.mkdir(parents=True, exist_ok=True)
    notes_file = folder / "build.json"
    notes = json.loads(notes_file.read_text()) if notes_file.is_file() else {}
    if notes.get("recipe") != RECIPE:
        notes = {"recipe": RECIPE, "shape": shape}
    policy_dir = folder / "policy"
    if "policy_params" not in notes:
        started = time.time()
        tokenizer = byte_tokenizer(shape["vocab"])
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(qwen2_config(shape), dtype=torch.float32)
        never_emit(model, [tokenizer.pad_token_id, tokenizer.eos_token_id])
        model.generation_config.eos_token_id, model.generation_config.pad_token_id = 1, 0
        model.save_pretrained(policy_dir)
        tokenizer.save_pretrained(policy_dir)
        # prompts: NUM_PROMPTS x PROMPT_TOKENS letters and spaces, one token each
        rng = random.Random(0)
        prompts = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(PROMPT_TOKENS))
                   for _ in range(NUM_PROMPTS)]
        (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        # both sides' tokenizers give the same ids, PROMPT_TOKENS a prompt
        ours = load_tokenizer(str(policy_dir))
        theirs = PreTrainedTokenizerFast.from_pretrained(str(policy_dir))
        ids = [ours(p, add_special_tokens=False)["input_ids"] for p in prompts]
        ids_default = [ours(p)["input_ids"] for p in prompts]
        assert ids == ids_default == [theirs(p)["input_ids"] for p in prompts], "the two tokenizers differ"
        assert all(len(i) == PROMPT_TOKENS for i in ids), sorted({len(i) for i in ids})
        assert ours.pad_token_id == 0 and ours.eos_token_id == 1 and len(ours) == shape["vocab"]
        (folder / "prompt_ids.json").write_text(json.dumps(ids))
        margin = eos_margin(model, ids[:4], 128, [0, 1])
        if margin < 30:
            raise SystemExit(f"EOS / pad logit margin only {margin:.1f} nats: the never_emit recipe does not hold")
        notes |= {"policy_params": sum(p.numel() for p in model.parameters()), "eos_margin_nats": round(margin, 1),
                  "tokenizer": f"{type(ours).__name__} (rlhflab) == PreTrainedTokenizerFast, {len(ours)} pieces",
                  "policy_seconds": round(time.time() - started, 1)}
        del model
        notes_file.write_text(json.dumps(notes, indent=1))
    for name, seed in (("reward", 1), ("value", 2)):
        if ppo and f"{name}_params" not in notes:
            torch.manual_seed(seed)
            model = Qwen2ForSequenceClassification(qwen2_config(shape, num_labels=1)).float()
            model.save_pretrained(folder / name)
            PreTrainedTokenizerFast.from_pretrained(str(policy_dir)).save_pretrained(folder / name)
            notes[f"{name}_params"] = sum(p.numel() for p in model.parameters())
            del model
            notes_file.write_text(json.dumps(notes, indent=1))
    return notes


def prepare(size: str, ppo: bool, threads: int) -> tuple[Path, dict]:
    folder = CACHE / f"scale-{size}"
    cmd = [str(VENV_BIN / "python"), __file__, "--build", str(folder), "--size", size] + (["--ppo"] if ppo else [])
    proc = subprocess.run(cmd, env=child_env(threads), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"building the model failed:\n{proc.stderr[-4000:]}")
    return folder, json.loads((folder / "build.json").read_text())


# --- one run ---------------------------------------------------------------------------------------------------


def child_env(threads: int) -> dict:
    env = dict(os.environ)
    env.update(OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               HF_HUB_DISABLE_TELEMETRY="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    return env


def proc_status(pid: int) -> dict:
    """VmHWM / VmRSS of a live process in MiB ({} once it is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v.split()[0]) / 1024 for k, v in (line.split(":", 1) for line in lines) if k in ("VmHWM", "VmRSS")}


def memory_limit_mib(args, wait_s: float = 30.0) -> float:
    """--max_rss_gb, lowered to what the machine has available now less 1 GiB (it is shared). The memory of a
    run that just ended comes back over some seconds: it is read until it stops rising (up to `wait_s`)."""
    deadline, last = time.monotonic() + wait_s, None
    while True:
        available = next((int(line.split()[1]) / 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                          if line.startswith("MemAvailable")), float("inf"))
        if available == float("inf") or (last is not None and available < last + 64) or time.monotonic() > deadline:
            return min(args.max_rss_gb * 1024, available - 1024)
        last = available
        time.sleep(1.0)


def rlhflab_command(row: Row, assets: Path, run: Path, args) -> list[str]:
    s, updates = SETTINGS, args.updates
    common = ["--model", str(assets / "policy"), "--train_file", str(assets / "prompts.jsonl"),
              "--output_dir", str(run), "--overwrite", "true", "--device", "cpu", "--dtype", "float32",
              "--threads", str(args.threads), "--seed", str(args.seed), "--no_progress", "--no_write_report",
              "--save_every", "0", "--log_every", "1", "--eval_every", "0", "--eval_prompts", "1",
              "--eval_batch_size", "1", "--max_new_tokens", "8", "--sample_prompts", "0", "--console_samples", "0",
              "--headroom_samples", "0", "--no_keep_best", "--max_prompt_tokens", str(PROMPT_TOKENS),
              "--response_length", str(row.new_tokens), "--temperature", str(s["temperature"]), "--top_k", "0",
              "--top_p", "1.0", "--missing_eos_penalty", "0", "--learning_rate", str(s["learning_rate"]),
              "--adam_beta1", str(s["adam_beta1"]), "--adam_beta2", str(s["adam_beta2"]),
              "--adam_eps", str(s["adam_eps"]), "--weight_decay", str(s["weight_decay"]),
              "--max_grad_norm", str(s["max_grad_norm"]), "--lr_schedule", s["lr_schedule"], "--warmup_steps", "0",
              "--gradient_accumulation_steps", "1", "--mixed_precision", "bf16" if row.bf16 else "no",
              "--gradient_checkpointing", str(row.gc).lower()]
    if row.lora:
        common += ["--lora_r", str(s["lora_r"]), "--lora_alpha", str(s["lora_alpha"]), "--lora_dropout", "0",
                   "--lora_target_modules", "all-linear"]
    if row.method == "grpo":
        g = GRPO
        batch = g["prompts"] * g["num_generations"]
        return [str(VENV_BIN / "rlhflab"), "grpo", *common, "--reward_fn", f"{REWARD_FN}:length_reward",
                "--batch_size", str(batch), "--num_generations", str(g["num_generations"]),
                "--total_episodes", str(batch * updates), "--num_mini_batches", "1",
                "--num_iterations", str(g["num_iterations"]), "--beta", str(g["beta"]), "--loss_type", g["loss_type"],
                "--epsilon", str(g["epsilon"]), "--epsilon_high", "0", "--scale_rewards", g["scale_rewards"],
                "--importance_sampling_level", g["importance_sampling_level"], *args.rlhflab_args.split()]
    p = PPO
    common[common.index("--max_grad_norm") + 1] = str(p["max_grad_norm"])
    return [str(VENV_BIN / "rlhflab"), "ppo", *common, "--reward", "model", "--reward_model", str(assets / "reward"),
            "--value_mode", "separate", "--value_model", str(assets / "value"), "--batch_size", str(p["prompts"]),
            "--total_episodes", str(p["prompts"] * updates), "--num_mini_batches", str(p["num_mini_batches"]),
            "--num_ppo_epochs", str(p["num_ppo_epochs"]), "--kl_coef", str(p["kl_coef"]),
            "--kl_estimator", p["kl_estimator"], "--vf_coef", str(p["vf_coef"]), "--cliprange", str(p["cliprange"]),
            "--cliprange_value", str(p["cliprange_value"]), "--gamma", str(p["gamma"]), "--lam", str(p["lam"]),
            "--whiten_rewards", "false", "--whiten_advantages", "true", "--value_warmup_rollouts", "0",
            "--value_head_learning_rate", "0", "--normalize_reward", "false", *args.rlhflab_args.split()]


def trl_spec(row: Row, assets: Path, run: Path, args) -> dict:
    return {"row": asdict(row), "model": str(assets / "policy"), "reward_model": str(assets / "reward"),
            "value_model": str(assets / "value"), "prompts": str(assets / "prompts.jsonl"),
            "prompt_ids": str(assets / "prompt_ids.json"), "reward_fn": str(REWARD_FN), "out": str(run),
            "threads": args.threads, "seed": args.seed, "updates": args.updates, "settings": SETTINGS,
            "grpo": GRPO, "ppo": PPO}


def update_rows(run: Path) -> list[dict]:
    file = run / "metrics.jsonl"
    if not file.is_file():
        return []
    rows = []
    for line in file.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if "time/generation" in row:
            rows.append(row)
    return rows


def supervise(cmd: list[str], env: dict, log: Path, limit_mib: float, timeout_s: float, done=None,
              stop_when_done: bool = True) -> dict:
    """Run `cmd` in its own process group, polling its memory; kill it past `limit_mib` or `timeout_s`.
    `done()` true: its VmHWM then is the measured peak, and (stop_when_done) it is stopped there."""
    started = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    result: dict = {"polled_peak_rss_mib": 0.0}
    status = None
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        mem = proc_status(proc.pid)
        result["polled_peak_rss_mib"] = max(result["polled_peak_rss_mib"], mem.get("VmHWM", 0.0))
        if done is not None and "done_peak_rss_mib" not in result and done():
            result["done_peak_rss_mib"] = mem.get("VmHWM", 0.0)
            result["done_seconds"] = time.time() - started
            if stop_when_done:
                os.killpg(proc.pid, signal.SIGKILL)
                result["stopped_after_measuring"] = True
        elif mem.get("VmRSS", 0.0) > limit_mib:
            os.killpg(proc.pid, signal.SIGKILL)
            result["failed"] = f"over the memory limit ({mem['VmRSS'] / 1024:.1f} GB RSS > {limit_mib / 1024:.1f} GB)"
        elif time.time() - started > timeout_s:
            os.killpg(proc.pid, signal.SIGKILL)
            result["failed"] = f"timed out after {timeout_s:.0f} s"
        time.sleep(0.2)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    result |= {"returncode": proc.returncode, "wall_seconds": time.time() - started,
               "ru_maxrss_mib": usage.ru_maxrss / 1024, "cpu_seconds": usage.ru_utime + usage.ru_stime}
    return result


def run_rlhflab(row: Row, assets: Path, run: Path, args) -> dict:
    if run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True)
    log = run.parent / f"{run.name}.log"
    cmd = rlhflab_command(row, assets, run, args)
    (run.parent / f"{run.name}.cmd").write_text(" ".join(cmd) + "\n")
    r = supervise(cmd, child_env(args.threads), log, memory_limit_mib(args), args.timeout_s,
                  done=lambda: len(update_rows(run)) >= args.updates, stop_when_done=not args.finish_runs)
    updates = update_rows(run)
    out = {"library": "rlhflab", **r, "updates_logged": len(updates)}
    if len(updates) < args.updates:
        out.setdefault("failed", f"exit {r['returncode']} after {len(updates)} updates: "
                       + (log.read_text().strip().splitlines() or ["(no output)"])[-1][-300:])
    else:
        out["peak_rss_mib"] = r.get("done_peak_rss_mib") or r["ru_maxrss_mib"]
        out["updates"] = [{"generation": u["time/generation"], "scoring": u["time/scoring"],
                           "training": u["time/training"],
                           "total": u["time/generation"] + u["time/scoring"] + u["time/training"],
                           "mean_length": u.get("completions/mean_length", u.get("response/length_mean"))}
                          for u in updates]
    if not args.keep_runs:  # at 0.5B a run folder holds GBs of checkpoint; keep the small files
        for name in ("metrics.jsonl", "config.yaml", "summary.json", "versions.json"):
            if (run / name).is_file():
                shutil.copy(run / name, run.parent / f"{run.name}.{name}")
        shutil.rmtree(run, ignore_errors=True)
    return out


def run_trl(row: Row, assets: Path, run: Path, args) -> dict:
    if run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True)
    spec_file = run.parent / f"{run.name}.spec.json"
    spec_file.write_text(json.dumps(trl_spec(row, assets, run, args), indent=1))
    python, child = ((TRL116_PYTHON, "scale_trl_grpo.py") if row.method == "grpo"
                     else (TRL112_PYTHON, "scale_trl_ppo.py"))
    log = run.parent / f"{run.name}.log"
    r = supervise([str(python), str(HERE / child), "--spec", str(spec_file)], child_env(args.threads), log,
                  memory_limit_mib(args), args.timeout_s)
    shutil.rmtree(run, ignore_errors=True)
    lines = [line for line in log.read_text().splitlines() if line.startswith('{"library"')]
    if r["returncode"] != 0 or not lines:
        tail = (log.read_text().strip().splitlines() or ["(no output)"])[-1][-300:]
        return {"library": "trl", **r, "failed": r.get("failed", f"exit {r['returncode']}: {tail}")}
    return {**r, **json.loads(lines[-1])}


def machine_lines(args, notes: dict) -> list[str]:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    dirty = " + uncommitted changes under src/" if git("status", "--porcelain", "--", "src") else ""
    versions = []
    for label, python, code in (
            ("rlhflab side", VENV_BIN / "python", "import rlhflab, torch, transformers, peft; print('rlhflab', "
             "rlhflab.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'peft', "
             "peft.__version__)"),
            ("TRL GRPO side", TRL116_PYTHON, "import trl, torch, transformers, peft, accelerate; print('trl', "
             "trl.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'peft', "
             "peft.__version__, 'accelerate', accelerate.__version__)"),
            ("TRL PPO side", TRL112_PYTHON, "import trl, torch, transformers, peft, accelerate; print('trl', "
             "trl.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'peft', "
             "peft.__version__, 'accelerate', accelerate.__version__)")):
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True) if python.exists() else None
        versions.append(f"{label}: " + (out.stdout.strip() if out and out.returncode == 0 else "not available"))
    mem = next((line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), "0")
    return [f"rlhflab commit {git('rev-parse', '--short', 'HEAD')}{dirty}",
            f"machine: {cpu}, {os.cpu_count()} CPUs, {int(mem) / 2**20:.1f} GiB RAM, {platform.system()} "
            f"{platform.release()}",
            f"threads {args.threads} (OMP_NUM_THREADS and torch.set_num_threads in every child), "
            f"OMP_WAIT_POLICY=PASSIVE in every child, memory limit {args.max_rss_gb} GB a run (or the available "
            f"memory less 1 GiB: {memory_limit_mib(args) / 1024:.1f} GB now)",
            *versions,
            f"model: random Qwen2 {json.dumps(notes['shape'])}, {notes['policy_params'] / 1e6:.1f}M parameters, "
            f"{notes['tokenizer']}; EOS / pad logit margin {notes['eos_margin_nats']} nats",
            f"work: {args.updates} updates a run; GRPO {GRPO['prompts']} prompts x {GRPO['num_generations']}, "
            f"{PROMPT_TOKENS}-token prompts; PPO {PPO['prompts']} prompts; settings {json.dumps(SETTINGS)} "
            f"GRPO {json.dumps(GRPO)} PPO {json.dumps(PPO)}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="all", help=f"comma-separated rows or all / headline / grpo / ppo; "
                        f"all = {','.join(ALL_ROWS)}")
    parser.add_argument("--size", choices=sorted(SHAPES), default="0.5b", help="0.5b, or small for a quick check")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every row on each side")
    parser.add_argument("--headline_repeats", type=int, default=3,
                        help=f"at least this many runs of the headline rows {HEADLINE}")
    parser.add_argument("--new_tokens", type=int, default=128, help="generated tokens of rows without -tN")
    parser.add_argument("--updates", type=int, default=2, help="updates a run (>= 2: AdamW state comes after the "
                        "first update's peak)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sides", default="rlhflab,trl", help="rlhflab, trl or both")
    parser.add_argument("--max_rss_gb", type=float, default=22.0, help="kill a run whose RSS passes this (or "
                        "the machine's available memory at the run's start less 1 GiB, if lower)")
    parser.add_argument("--timeout_s", type=float, default=7200.0, help="kill a run that takes longer")
    parser.add_argument("--finish_runs", action="store_true", help="let rlhflab runs end (final evaluation and "
                        "save) instead of stopping them once the last update is measured")
    parser.add_argument("--keep_runs", action="store_true", help="keep rlhflab's run folders (GBs at 0.5B)")
    parser.add_argument("--rlhflab_args", default="", help="extra flags for every rlhflab run (space-separated)")
    parser.add_argument("--out", default="", help="folder for results.json / results.md and the runs' logs; "
                        "default benchmarks/.cache/scale-runs/<size>-<time>")
    parser.add_argument("--table", default="", help="only print the table of results.json files (comma-separated)")
    parser.add_argument("--build", default="", help=argparse.SUPPRESS)
    parser.add_argument("--ppo", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build:
        print(json.dumps(build(Path(args.build), args.size, args.ppo)))
        return
    if args.table:
        print(results_table([r for f in args.table.split(",") for r in json.loads(Path(f).read_text())]))
        return
    if args.updates < 2:
        print("warning: with one update the AdamW state is allocated after the measured peak (FACTS.md)")
    rows = [parse_row(n, args.new_tokens) for n in row_names(args.rows)]
    sides = [s.strip() for s in args.sides.split(",")]
    needs = {"grpo": TRL116_PYTHON, "ppo": TRL112_PYTHON}
    missing = {str(needs[r.method]) for r in rows if "trl" in sides and not needs[r.method].exists()}
    if missing:
        raise SystemExit(f"missing TRL virtualenv(s) {sorted(missing)}: see benchmarks/README.md (scale.py)")
    out = Path(args.out) if args.out else CACHE / "scale-runs" / f"{args.size}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    assets, notes = prepare(args.size, any(r.method == "ppo" for r in rows), args.threads)
    header = machine_lines(args, notes) + [f"assets: {assets} (built or found, versions read: "
                                           f"{time.time() - started:.0f} s)"]
    print("\n".join(header), flush=True)
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else []
    most = max(args.repeats, args.headline_repeats)
    plan = [(rep, row) for rep in range(most) for row in rows
            if rep < (most if row.name in HEADLINE else args.repeats)]
    for n, (rep, row) in enumerate(plan):
        order = sides if n % 2 == 0 else sides[::-1]  # alternate who goes first
        for side in order:
            run = out / f"{row.name}-r{rep}-{side}"
            r = (run_rlhflab if side == "rlhflab" else run_trl)(row, assets, run, args)
            r |= {"row": row.name, "repeat": rep, "new_tokens": row.new_tokens, "library": r.get("library", side),
                  "loadavg_1min_after": os.getloadavg()[0]}
            print(f"  {row.name:<24} r{rep} {side:<7} {summary_line(r)}", flush=True)
            results.append(r)
            write_results(out, header, results)
    print("\n" + results_table(results), flush=True)
    print(f"\nresults: {out / 'results.json'}, {out / 'results.md'} ({time.time() - started:.0f} s in all)")


if __name__ == "__main__":
    main()
