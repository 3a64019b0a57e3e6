"""The rows benchmarks/gpu_check.py measures, and how one row is run and measured (in a child process of it).

A row is one stage run on the randomly initialised model: SFT or DPO steps, GRPO or PPO updates; full
fine-tuning or LoRA; float32, bf16 or fp16 mixed precision; with or without gradient checkpointing; per
generation backend for the online stages. Each row trains through the stage's own `train(cfg)` (the code a
user runs) and is measured from its metrics.jsonl, the first step or update left out (CUDA warm-up).
"""

from __future__ import annotations

import gc
import itertools
import json
import random
import resource
import shutil
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

PAD, EOS = "<|pad|>", "<|endoftext|>"
METHODS = ("sft", "dpo", "grpo", "ppo")
ONLINE = ("grpo", "ppo")
# (tuning, precision, gradient checkpointing), the headline first: a row cut by the time budget is a later one
VARIANTS = (("lora", "bf16", True), ("full", "bf16", True), ("full", "fp32", True), ("full", "bf16", False),
            ("full", "fp16", True))
FP16_METHODS = ("sft", "grpo")  # the loss scaler is one code path (models/precision.py): one offline, one online
AUTOCAST = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}
HALF_BASE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # a LoRA base is stored as it computes


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
    batch_size: int  # sequences per SFT step, responses per GRPO / PPO update (GRPO: prompts x num_generations)
    dpo_pairs: int  # pairs per DPO step (2 sequences each)
    prompt_tokens: int  # every prompt has exactly this many tokens
    response_length: int  # tokens of every completion, chosen, rejected and generated response
    offline_steps: int  # SFT / DPO optimiser steps per row
    online_updates: int  # GRPO / PPO updates per row
    lora_r: int
    num_generations: int  # GRPO's group


QWEN25_05B = Shape(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936)
FULL = Setting("cuda", batch_size=64, dpo_pairs=32, prompt_tokens=64, response_length=64, offline_steps=6,
               online_updates=3, lora_r=16, num_generations=8)
SMOKE_SHAPE = Shape(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, vocab=600)
SMOKE = Setting("cpu", batch_size=8, dpo_pairs=4, prompt_tokens=8, response_length=6, offline_steps=3,
                online_updates=2, lora_r=4, num_generations=4)


@dataclass(frozen=True)
class Row:
    method: str  # sft, dpo, grpo, ppo
    tuning: str  # full, lora
    precision: str  # fp32, bf16, fp16
    checkpointing: bool
    backend: str = "lean"  # generation backend (online stages); "" for SFT / DPO

    @property
    def key(self) -> str:
        return "-".join([self.method, self.tuning, self.precision, "gc" if self.checkpointing else "nogc",
                         self.backend])

    @classmethod
    def from_key(cls, key: str) -> Row:
        method, tuning, precision, gc_flag, backend = key.split("-")
        return cls(method, tuning, precision, gc_flag == "gc", backend)

    def fields(self) -> dict:
        return {"method": self.method, "tuning": self.tuning, "precision": self.precision,
                "checkpointing": self.checkpointing, "backend": self.backend}


def planned_rows(methods: list[str], backends: list[str], device: str) -> tuple[list[Row], list[str]]:
    """Every row to measure, in order, and a line for each kind left out here (fp16 autocast needs CUDA)."""
    rows, left_out = [], []
    for method in methods:
        for backend in (backends if method in ONLINE else [""]):
            variants = VARIANTS if backend in ("lean", "") else VARIANTS[:1]  # other backends: the headline row
            for tuning, precision, checkpointing in variants:
                if precision == "fp16" and method not in FP16_METHODS:
                    continue
                if precision == "fp16" and device != "cuda":
                    left_out.append(f"{method} fp16: autocast in fp16 needs a CUDA device")
                    continue
                rows.append(Row(method, tuning, precision, checkpointing, backend))
    return rows, left_out


# --- the model, its tokenizer, the data --------------------------------------------------------------


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
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD, eos_token=EOS)
    assert len(fast) == vocab_size, (len(fast), vocab_size)
    return fast


def build_model_folder(folder: Path, shape: Shape) -> int:
    """A randomly initialised Qwen2 of `shape` in bf16 with the byte tokenizer, saved as an HF folder, built on
    the CPU (the parent process never holds GPU memory that the rows' figures would include); its parameters."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config
    from transformers.utils import logging as hf_logging

    from rlhflab.models import save_model_folder

    hf_logging.disable_progress_bar()  # "Writing model shards" on stderr
    config = Qwen2Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=4096, rope_theta=1e6,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    save_model_folder(folder, model, byte_tokenizer(shape.vocab))
    return sum(p.numel() for p in model.parameters())


def write_data(work: Path, setting: Setting) -> None:
    """TRL-format files of letters (one token each): prompts.jsonl (prompt-only), sft(-val).jsonl
    (prompt-completion), pairs(-val).jsonl (prompt, chosen, rejected), enough for every step of a row."""
    rng = random.Random(0)
    text = lambda n: "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))  # noqa: E731
    prompt, answer = setting.prompt_tokens, setting.response_length
    count = lambda per_step, steps: per_step * (steps + 1)  # noqa: E731

    def write(name: str, rows: int, columns: dict[str, int]) -> None:
        lines = (json.dumps({column: text(n) for column, n in columns.items()}) + "\n" for _ in range(rows))
        (work / name).write_text("".join(lines))

    write("prompts.jsonl", max(64, setting.batch_size), {"prompt": prompt})
    write("sft.jsonl", count(setting.batch_size, setting.offline_steps), {"prompt": prompt, "completion": answer})
    write("sft-val.jsonl", 8, {"prompt": prompt, "completion": answer})
    write("pairs.jsonl", count(setting.dpo_pairs, setting.offline_steps),
          {"prompt": prompt, "chosen": answer, "rejected": answer})
    write("pairs-val.jsonl", 8, {"prompt": prompt, "chosen": answer, "rejected": answer})


def answer_length_reward(prompts, completions, rows=None) -> list[float]:
    return [float(len(c) % 7) for c in completions]


# --- FLOPs and the measured peak ------------------------------------------------------------------


def training_flops(shape: Shape, rows: int, prompt: int, response: int, passes: int, lora: bool) -> float:
    """Model FLOPs of `passes` forward + backward passes over `rows` sequences of prompt + response tokens.

    Forward per token: 2 x the trunk's linear weights (q, k, v, o, gate, up, down), 2 x 2 x L x hidden per
    layer for attention scores and values (L = prompt + response, causal half not subtracted), and the LM head
    (2 x hidden x vocab) on the response positions only, where the training forward runs it. Backward:
    gradients of the activations cost the linear forward again and attention's twice (it has no weights:
    dQ, dK, dP and dV are four matmuls against its two); gradients of the weights the linear part again,
    except for frozen weights (LoRA: the adapters' own FLOPs, r x (in + out) per adapted matrix, are < 1 %
    and left out). Checkpointing's recomputed forward is not model work and is not counted; GRPO's and DPO's
    shared-prompt forwards compute less than this: the figure stays the model's."""
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

    n, repeats = (8192, 20) if device == "cuda" else (256, 20)
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


class DeviceMemoryPeak:
    """The most device memory in use (`torch.cuda.mem_get_info`: total - free, so the CUDA context, the caching
    allocator's reserve and a vLLM engine's pool count too), sampled every 10 ms on a thread while entered."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()

    def _sample(self) -> None:
        import torch

        while not self._stop.is_set():
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            self._stop.wait(0.01)

    def __enter__(self) -> DeviceMemoryPeak:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# --- one row ---------------------------------------------------------------------------------------------


def row_config(row: Row, work: Path, setting: Setting):
    """The stage's config for `row`: the same fields a user would set on the command line."""
    from rlhflab.config import DPOConfig, GRPOConfig, PPOConfig, SFTConfig

    lora = row.tuning == "lora"
    r = setting.lora_r if lora else 0
    common = dict(model=str(work / "model"), device=setting.device,
                  dtype=HALF_BASE[row.precision] if lora else "float32", mixed_precision=AUTOCAST[row.precision],
                  gradient_checkpointing=row.checkpointing, lora_r=r, lora_alpha=2 * r,
                  output_dir=str(work / "runs" / row.key), overwrite=True, progress=False, save_every=-1,
                  write_report=False, log_every=1, max_prompt_tokens=setting.prompt_tokens,
                  threads=1 if setting.device == "cpu" else 0)
    offline = dict(max_steps=setting.offline_steps, max_length=setting.prompt_tokens + setting.response_length + 8,
                   eval_every=0, warmup_steps=0, learning_rate=1e-5)
    if row.method == "sft":
        return SFTConfig(train_file=str(work / "sft.jsonl"), validation_file=str(work / "sft-val.jsonl"),
                         batch_size=setting.batch_size, **offline, **common)
    if row.method == "dpo":
        return DPOConfig(train_file=str(work / "pairs.jsonl"), validation_file=str(work / "pairs-val.jsonl"),
                         batch_size=setting.dpo_pairs, **offline, **common)
    online = dict(train_file=str(work / "prompts.jsonl"), batch_size=setting.batch_size,
                  response_length=setting.response_length, max_new_tokens=setting.response_length,
                  total_episodes=setting.batch_size * setting.online_updates, eval_every=0, eval_prompts=4,
                  sample_prompts=1, console_samples=0, missing_eos_penalty=0.0,
                  reuse_rollout_forward=False,  # every training forward inside the training phase (MFU)
                  generation_backend=row.backend)
    if row.method == "ppo":
        return PPOConfig(**online, **common)  # 2 epochs x 2 minibatches, value head on the trunk
    return GRPOConfig(num_generations=setting.num_generations, **online, **common)


def run_row(row: Row, work: Path, setting: Setting, shape: Shape) -> dict:
    """Train `row` through its stage's `train` and measure it from metrics.jsonl; its run folder is deleted."""
    import torch

    from rlhflab.trainers import dpo, grpo, ppo, sft

    cfg = row_config(row, work, setting)
    trainer = {"sft": sft, "dpo": dpo, "grpo": grpo, "ppo": ppo}[row.method]
    cuda = setting.device == "cuda"
    memory = DeviceMemoryPeak() if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    try:
        with memory or nullcontext():
            if row.method in ONLINE:
                result = trainer.train(cfg, reward_fn=answer_length_reward)
            else:
                result = trainer.train(cfg)
        metrics = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    finally:
        shutil.rmtree(work / "runs" / row.key, ignore_errors=True)  # a full model folder is GBs; the disk is not
    measured = online_figures(metrics, cfg, setting, shape, row) if row.method in ONLINE else \
        offline_figures(metrics, setting, shape, row)
    # fp16's scaler state from the last row that has it (the last row of all may be an evaluation's)
    last = next((m for m in reversed(metrics) if "amp/scale" in m), {})
    return {**measured, "row_wall_s": time.perf_counter() - started,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
            "peak_device_bytes": memory.peak if cuda else None,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "amp_scale": last.get("amp/scale"), "amp_skipped_steps": last.get("amp/skipped_steps")}


def online_figures(metrics: list[dict], cfg, setting: Setting, shape: Shape, row: Row) -> dict:
    """GRPO / PPO: episodes/s of whole updates, generated tokens/s of the generation phase, FLOP/s of training."""
    updates = [m for m in metrics if "time/training" in m][1:]  # the first pays the warm-up
    if not updates:
        raise RuntimeError(f"{row.key}: no update after the first in metrics.jsonl")
    generated = sum(m["response/length_mean"] * cfg.batch_size for m in updates)
    passes = cfg.num_ppo_epochs if row.method == "ppo" else cfg.num_iterations
    flops = training_flops(shape, cfg.batch_size, setting.prompt_tokens, setting.response_length, passes,
                           lora=row.tuning == "lora")
    return {"steps_measured": len(updates),
            "episodes_per_s": cfg.batch_size * len(updates) / sum(cfg.batch_size / m["eps"] for m in updates),
            "tokens_per_s": generated / sum(m["time/generation"] for m in updates),
            "train_flops_per_s": flops * len(updates) / sum(m["time/training"] for m in updates),
            "response_length_mean": sum(m["response/length_mean"] for m in updates) / len(updates)}


def offline_figures(metrics: list[dict], setting: Setting, shape: Shape, row: Row) -> dict:
    """SFT / DPO: sequences (SFT) or pairs (DPO) per second, their tokens per second, FLOP/s of the steps;
    a step's time is the wall time between two logged steps (log_every 1), the first step left out."""
    loss = "loss/sft" if row.method == "sft" else "loss"
    elapsed = [m["elapsed_s"] for m in metrics if loss in m and "elapsed_s" in m]
    if len(elapsed) < 2:
        raise RuntimeError(f"{row.key}: fewer than two logged steps in metrics.jsonl")
    seconds = elapsed[-1] - elapsed[0]
    steps = len(elapsed) - 1
    sequences = setting.batch_size if row.method == "sft" else 2 * setting.dpo_pairs
    per_step = setting.batch_size if row.method == "sft" else setting.dpo_pairs
    length = setting.prompt_tokens + setting.response_length
    flops = training_flops(shape, sequences, setting.prompt_tokens, setting.response_length, 1,
                           lora=row.tuning == "lora")
    return {"steps_measured": steps, "episodes_per_s": per_step * steps / seconds,
            "tokens_per_s": sequences * length * steps / seconds, "train_flops_per_s": flops * steps / seconds}


def run_rows(keys: list[str], work: Path, setting: Setting, shape: Shape, results: Path, deadline: float) -> None:
    """A child's rows in turn, each row's figures (or its error) appended to `results` as one JSON line as
    soon as it is done; rows that would not end before `deadline` (judged by the slowest row so far) are
    written as not run. Every row carries this process's measured bf16 and float32 matmul rates."""
    import torch

    cuda = setting.device == "cuda"
    device_name = torch.cuda.get_device_name(0) if cuda else "CPU"
    peaks = {"bf16": matmul_peak(setting.device, "bfloat16"), "fp32": matmul_peak(setting.device, "float32")}
    slowest = 0.0
    for key in keys:
        row = Row.from_key(key)
        line = {**row.fields(), "device": device_name, "matmul_peak_flops": peaks}
        if time.time() + 1.2 * slowest > deadline:
            line["error"] = "not run: the time budget (--budget_s) would be spent first"
        else:
            started = time.perf_counter()
            try:
                line.update(run_row(row, work, setting, shape))
            except Exception as e:  # an out-of-memory row, say: the next rows still run
                import traceback

                traceback.print_exc()
                line["error"] = f"{type(e).__name__}: {' '.join(str(e).split())}"[:240]
            slowest = max(slowest, time.perf_counter() - started)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        with results.open("a") as out:
            out.write(json.dumps(line) + "\n")
