"""GPU readiness check (issue 15): PPO and GRPO with LoRA on a randomly initialised Qwen2.5-0.5B-shaped model
in bf16, per generation backend, as a markdown table. No downloads: the model and its tokenizer are built here.

    bash benchmarks/gpu_check.sh             # on a CUDA machine: the CUDA-marked tests, then this script
    python benchmarks/gpu_check.py            # the benchmark alone (backends: lean, and vllm when installed)
    python benchmarks/gpu_check.py --smoke    # anywhere: tiny shapes, float32, CPU, 2 updates (CI runs it)

What is measured, per (method, backend), each in its own process (a clean peak-memory count, one vLLM
engine per process), over the updates after the first (the first pays CUDA warm-up and the engine's first
weight copy; the engine itself starts in the run's first evaluation, outside the updates):
- episodes/s: responses per second of whole updates (generate, score, train);
- gen tokens/s: generated tokens per second of the generation phase;
- train TFLOP/s and MFU: model FLOPs of the training phase (`training_flops`) per second of it, against the
  bf16 matmul rate measured in this script (8192^3 matmuls): the peak this GPU actually reaches;
- peak memory: the torch allocator's peak on the GPU (a vLLM engine's own pool comes on top: its budget is
  vllm_gpu_memory_utilization of the GPU); on CPU (--smoke) the process's peak RSS.
The model answers random-looking bytes and never EOS, so every response runs to the length cap: the shapes
are fixed and the figures compare backends at equal work. The reward is the answer's length in characters mod 7.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PAD, EOS = "<|pad|>", "<|endoftext|>"


@dataclass(frozen=True)
class Shape:
    """A Qwen2 decoder's sizes."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


@dataclass(frozen=True)
class Setting:
    device: str
    dtype: str
    batch_size: int  # responses per update (GRPO: prompts x num_generations)
    prompt_tokens: int  # every prompt has exactly this many tokens
    response_length: int
    updates: int
    lora_r: int
    num_generations: int  # GRPO's group
    case_timeout_s: int


QWEN25_05B = Shape(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936)
FULL = Setting("cuda", "bfloat16", batch_size=64, prompt_tokens=64, response_length=64, updates=6, lora_r=16,
               num_generations=8, case_timeout_s=150)
SMOKE_SHAPE = Shape(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, vocab=600)
SMOKE = Setting("cpu", "float32", batch_size=8, prompt_tokens=8, response_length=6, updates=2, lora_r=4,
                num_generations=4, case_timeout_s=120)
METHODS = ("ppo", "grpo")


# --- the model, its tokenizer, the prompts -------------------------------------------------------


def byte_tokenizer(vocab_size: int):
    """A byte-level tokenizer with exactly `vocab_size` pieces and no merges: <|pad|>, <|endoftext|>, the 256
    byte symbols, then byte pairs and triples. Text encodes one byte per token (prompt lengths are exact) and
    every id a model with this vocabulary samples decodes to bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {PAD: 0, EOS: 1}
    for piece in itertools.chain(symbols, ("".join(p) for n in (2, 3) for p in itertools.product(symbols, repeat=n))):
        if len(vocab) >= vocab_size:
            break
        vocab[piece] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([PAD, EOS])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD, eos_token=EOS)


def build_model_folder(folder: Path, shape: Shape, setting: Setting) -> int:
    """A randomly initialised Qwen2 of `shape` with the byte tokenizer, saved as an HF folder; its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlhflab.models import save_model_folder

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" on stderr
    tokenizer = byte_tokenizer(shape.vocab)
    config = Qwen2Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=4096, rope_theta=1e6,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    with torch.device(setting.device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, setting.dtype))
    save_model_folder(folder, model, tokenizer)
    return sum(p.numel() for p in model.parameters())


def write_prompts(path: Path, count: int, length: int) -> None:
    """`count` prompts of `length` letters (one token each with the byte tokenizer), TRL's prompt-only format."""
    import random

    rng = random.Random(0)
    rows = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(length)) for _ in range(count)]
    path.write_text("".join(json.dumps({"prompt": r}) + "\n" for r in rows))


def answer_length_reward(prompts, completions, rows=None) -> list[float]:
    return [float(len(c) % 7) for c in completions]


# --- FLOPs and the measured peak -------------------------------------------------------------------


def training_flops(shape: Shape, rows: int, prompt: int, response: int, passes: int, lora: bool) -> float:
    """Model FLOPs of `passes` forward + backward passes over `rows` sequences of prompt + response tokens.

    Forward per token: 2 x the trunk's linear weights (q, k, v, o, gate, up, down), 2 x 2 x L x hidden per
    layer for attention scores and values (L = prompt + response, causal half not subtracted), and the LM head
    (2 x hidden x vocab) on the response positions only, where the training forward runs it. Backward:
    gradients of the activations cost the linear forward again and attention's twice (it has no weights:
    dQ, dK, dP and dV are four matmuls against its two); gradients of the weights the linear part again,
    except for frozen weights (LoRA: the adapters' own FLOPs, r x (in + out) per adapted matrix, are < 1 %
    and left out). GRPO's shared-prompt forward computes less than this; the figure stays the model's."""
    length = prompt + response
    head_dim = shape.hidden // shape.heads
    trunk = shape.layers * (2 * shape.hidden * shape.hidden + 2 * shape.hidden * shape.kv_heads * head_dim
                            + 3 * shape.hidden * shape.intermediate)  # weights of q, o, k, v and the MLP
    head = shape.hidden * shape.vocab
    linear = rows * (2 * trunk * length + 2 * head * (response + 1))
    attention = rows * length * shape.layers * 4 * length * shape.hidden
    weight_grads = 0 if lora else linear
    return passes * (2 * linear + 3 * attention + weight_grads)


def matmul_peak(device: str, dtype: str) -> float:
    """FLOP/s of repeated square matmuls in `dtype`: the rate this device actually reaches (CUDA: 8192^3)."""
    import torch

    n, repeats = (8192, 50) if device == "cuda" else (256, 20)
    a = torch.randn(n, n, device=device, dtype=getattr(torch, dtype))
    b = torch.randn(n, n, device=device, dtype=getattr(torch, dtype))
    for _ in range(3):
        a @ b
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync()
    return 2 * n**3 * repeats / (time.perf_counter() - started)


# --- one case, in its own process --------------------------------------------------------------------


def case_config(method: str, backend: str, work: Path, setting: Setting):
    from rlhflab.config import GRPOConfig, PPOConfig

    common = dict(model=str(work / "model"), train_file=str(work / "prompts.jsonl"), device=setting.device,
                  dtype=setting.dtype, lora_r=setting.lora_r, lora_alpha=2 * setting.lora_r,
                  batch_size=setting.batch_size, response_length=setting.response_length,
                  max_new_tokens=setting.response_length, max_prompt_tokens=setting.prompt_tokens,
                  total_episodes=setting.batch_size * setting.updates, eval_every=0, eval_prompts=8,
                  sample_prompts=2, console_samples=0, save_every=0, progress=False, missing_eos_penalty=0.0,
                  reuse_rollout_forward=False,  # every training forward inside the training phase (MFU)
                  generation_backend=backend, output_dir=str(work / f"run-{method}-{backend}"), overwrite=True,
                  threads=1 if setting.device == "cpu" else 0)
    if method == "ppo":
        return PPOConfig(**common)  # 2 epochs x 2 minibatches, value head on the trunk
    return GRPOConfig(num_generations=setting.num_generations, **common)


def run_case(method: str, backend: str, work: Path, setting: Setting, shape: Shape) -> dict:
    """Train one (method, backend) and measure it (see the module docstring)."""
    import resource

    import torch

    from rlhflab.trainers import grpo, ppo

    cfg = case_config(method, backend, work, setting)
    cuda = setting.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    result = {"ppo": ppo, "grpo": grpo}[method].train(cfg, reward_fn=answer_length_reward)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in rows if "time/training" in r][1:]  # the first pays the warm-up
    seconds = sum(cfg.batch_size / r["eps"] for r in updates)
    generated = sum(r["response/length_mean"] * cfg.batch_size for r in updates)
    passes = cfg.num_ppo_epochs if method == "ppo" else cfg.num_iterations
    flops = training_flops(shape, cfg.batch_size, setting.prompt_tokens, setting.response_length, passes, lora=True)
    peak_memory = (torch.cuda.max_memory_allocated() if cuda
                   else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {
        "method": method, "backend": backend, "updates_measured": len(updates),
        "episodes_per_s": cfg.batch_size * len(updates) / seconds,
        "gen_tokens_per_s": generated / sum(r["time/generation"] for r in updates),
        "train_flops_per_s": flops * len(updates) / sum(r["time/training"] for r in updates),
        "response_length_mean": sum(r["response/length_mean"] for r in updates) / len(updates),
        "peak_memory_bytes": peak_memory,
        "engine_budget_bytes": (cfg.vllm_gpu_memory_utilization * torch.cuda.get_device_properties(0).total_memory
                                if backend == "vllm" else 0),
    }


# --- the table -------------------------------------------------------------------------------------------


def markdown_table(results: list[dict], peak: float, on_cpu: bool) -> str:
    memory = "peak RSS" if on_cpu else "peak GPU memory (torch)"
    lines = [f"| method | backend | episodes/s | gen tokens/s | train TFLOP/s | MFU (train) | {memory} | note |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['method']} | {r['backend']} | | | | | | {r['error']} |")
            continue
        note = f"engine budget {r['engine_budget_bytes'] / 2**30:.1f} GiB on top" if r["engine_budget_bytes"] else ""
        lines.append(f"| {r['method']} | {r['backend']} | {r['episodes_per_s']:.1f} | {r['gen_tokens_per_s']:.0f} | "
                     f"{r['train_flops_per_s'] / 1e12:.3g} | {r['train_flops_per_s'] / peak:.1%} | "
                     f"{r['peak_memory_bytes'] / 2**30:.2f} GiB | {note} |")
    return "\n".join(lines)


def backends_to_run(requested: str, device: str) -> tuple[list[str], str]:
    """The backends asked for that can run here, and a line on any left out."""
    from importlib.util import find_spec

    names = [b.strip() for b in requested.split(",") if b.strip()]
    if "vllm" in names and (device != "cuda" or find_spec("vllm") is None):
        names.remove("vllm")
        return names, "vllm left out: " + ("no CUDA GPU" if device != "cuda" else "not installed (pip install 'rlhflab[vllm]')")
    return names, ""


def spawn_case(method: str, backend: str, work: Path, smoke: bool, timeout: float) -> dict:
    """Run one case in a fresh process (`--case`), return its measurements or the reason it has none."""
    if timeout < 20:
        return {"method": method, "backend": backend, "error": "not run: the time budget (--budget_s) is spent"}
    timeout = int(timeout)
    out = work / f"case-{method}-{backend}.json"
    command = [sys.executable, __file__, "--case", f"{method}:{backend}", "--work", str(work)] + (["--smoke"] if smoke else [])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"method": method, "backend": backend, "error": f"timed out after {timeout} s"}
    if done.returncode != 0 or not out.is_file():
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        print(done.stderr[-4000:], file=sys.stderr)
        return {"method": method, "backend": backend, "error": f"failed (exit {done.returncode}): {last[0][:160]}"}
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, float32, CPU, 2 updates")
    parser.add_argument("--backends", default="lean,vllm", help="comma-separated: lean, hf, vllm")
    parser.add_argument("--budget_s", type=float, default=300, help="wall-clock budget: cases that no longer fit "
                                                                    "are listed as not run")
    parser.add_argument("--out", default="", help="folder for results.json and table.md, rewritten after every "
                                                  "case (a killed run keeps what it measured); default: print only")
    parser.add_argument("--case", default="", help=argparse.SUPPRESS)  # METHOD:BACKEND, run by the parent
    parser.add_argument("--work", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shape, setting = (SMOKE_SHAPE, SMOKE) if args.smoke else (QWEN25_05B, FULL)
    if args.case:
        method, backend = args.case.split(":")
        measured = run_case(method, backend, Path(args.work), setting, shape)
        (Path(args.work) / f"case-{method}-{backend}.json").write_text(json.dumps(measured))
        return 0

    import torch

    if setting.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA GPU; run with --smoke for the CPU check", file=sys.stderr)
        return 2
    started = time.time()
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    on_cpu = setting.device == "cpu"
    with tempfile.TemporaryDirectory(prefix="rlhflab-gpu-check-") as tmp:  # the model folder: GBs, not kept
        work = Path(tmp)
        params = build_model_folder(work / "model", shape, setting)
        write_prompts(work / "prompts.jsonl", count=max(64, setting.batch_size), length=setting.prompt_tokens)
        peak = matmul_peak(setting.device, setting.dtype)
        backends, left_out = backends_to_run(args.backends, setting.device)
        header = header_lines(torch, args.smoke, setting, shape, params, peak, left_out)
        print("\n".join(header), flush=True)
        deadline = started + args.budget_s
        results = []
        for backend in backends:
            for method in METHODS:
                results.append(spawn_case(method, backend, work, args.smoke,
                                          min(setting.case_timeout_s, deadline - time.time())))
                print(f"case {method} / {backend}: {results[-1].get('error', 'measured')} "
                      f"({time.time() - started:.0f} s in)", flush=True)
                if out is not None:  # what is measured so far survives a run killed later
                    save_results(out, header, results, peak, on_cpu, time.time() - started)
    print()
    print(markdown_table(results, peak, on_cpu))
    print(f"\nwall {time.time() - started:.0f} s")
    return 0 if all("error" not in r for r in results) else 1


def header_lines(torch, smoke: bool, setting: Setting, shape: Shape, params: int, peak: float,
                 left_out: str) -> list[str]:
    """The table's preamble: device, versions, model, work per update."""
    import transformers

    device = torch.cuda.get_device_name(0) if setting.device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    lines = [f"## rlhflab GPU check{' (smoke)' if smoke else ''}", "",
             f"- device: {device}; torch {torch.__version__} (CUDA {torch.version.cuda}); transformers "
             f"{transformers.__version__}; measured {setting.dtype} matmul peak {peak / 1e12:.1f} TFLOP/s",
             f"- model: random Qwen2, {params / 1e6:.3g}M parameters ({json.dumps(asdict(shape))}), {setting.dtype}, "
             f"LoRA r {setting.lora_r}",
             f"- per update: {setting.batch_size} responses of {setting.response_length} tokens to "
             f"{setting.prompt_tokens}-token prompts; {setting.updates} updates, the first not measured; PPO 2 epochs "
             f"x 2 minibatches with a value head on the trunk, GRPO groups of {setting.num_generations}, 1 pass"]
    return lines + ([f"- {left_out}"] if left_out else []) + [""]


def save_results(out: Path, header: list[str], results: list[dict], peak: float, on_cpu: bool, wall: float) -> None:
    """OUT/results.json (every case's measurements, the matmul peak, the wall time so far) and OUT/table.md."""
    (out / "results.json").write_text(json.dumps({"matmul_peak_flops": peak, "wall_s": wall, "header": header,
                                                  "cases": results}, indent=1))
    (out / "table.md").write_text("\n".join(header) + "\n" + markdown_table(results, peak, on_cpu)
                                  + f"\n\nwall {wall:.0f} s\n")


if __name__ == "__main__":
    sys.exit(main())
