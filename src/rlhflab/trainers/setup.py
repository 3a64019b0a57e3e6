"""What every trainer does before its loop: threads, seeds, models, optimiser."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import random
from pathlib import Path

import numpy as np
import torch
from transformers import get_scheduler

from rlhflab import models
from rlhflab.checkpoint import atomic_folder, weight_bytes
from rlhflab.sources.corpus import tokenizer_corpus
from rlhflab.models.precision import check_trainable_float32, float32_for_training

log = logging.getLogger("rlhflab")


def configure_threads(threads: int) -> int:
    """Fix torch's CPU thread count (0 = all cores) and return it.

    OMP_WAIT_POLICY=PASSIVE must be set before torch is imported; the CLI does it.
    On 2 vCPUs spin-waiting threads made small models 5-6x slower (FACTS.md).
    """
    count = threads if threads > 0 else (os.cpu_count() or 1)
    torch.set_num_threads(count)
    return count


def configure_allocator(mmap_threshold_mib: int) -> bool:
    """glibc only: serve every allocation of at least this many MiB by mmap (returned to the OS on
    free) instead of the heap. glibc's default threshold grows with the largest block freed (up to
    32 MiB), after which big, short-lived activation tensors come from a heap that keeps its high
    water mark: at ~25M parameters that was ~300 MiB of PPO's peak RSS (benchmarks/RESULTS.md).
    Process-wide; 0 leaves malloc alone. Returns whether it was applied."""
    if mmap_threshold_mib <= 0 or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_mmap_threshold = -3  # <malloc.h>; setting it also switches off the dynamic threshold
    return bool(libc.mallopt(m_mmap_threshold, int(mmap_threshold_mib) << 20))


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def stream_seed(name: str, *parts) -> int:
    """A seed of its own for the random stream `name` at `parts` (e.g. a run's seed and an update), apart from
    every other stream drawn from the same run seed."""
    digest = hashlib.sha256(":".join([name, *map(str, parts)]).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed python, numpy and torch; with `deterministic`, also ask torch for deterministic kernels.

    On CPU the same seed already gives bitwise-equal runs (tests/checkpoint). On CUDA,
    cuBLAS needs CUBLAS_WORKSPACE_CONFIG before its first handle for deterministic matmuls
    (PyTorch "Reproducibility" notes). warn_only: an op without a deterministic kernel
    warns instead of killing a long run. Never switched off here: a caller may have set it.
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def load_or_build_policy(cfg) -> tuple[torch.nn.Module, object]:
    """Load `cfg.model` with from_pretrained, or build the tiny default when it is empty; with `cfg.lora_r`,
    LoRA adapters on it (`add_lora`). Whatever trains is float32: whole weights loaded in bf16 / fp16 (asked
    for, or `dtype=auto` on a half checkpoint) are cast; a LoRA base stays in its dtype (models/precision.py)."""
    if cfg.model:
        tokenizer = models.load_tokenizer(cfg.tokenizer or cfg.model, trust_remote_code=cfg.trust_remote_code)
        model = models.load_causal_lm(cfg.model, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code)
        if cfg.lora_r > 0:
            return add_lora(model, cfg, f"SFT model {cfg.model}"), tokenizer
        return float32_for_training(model, f"SFT model {cfg.model}"), tokenizer
    tokenizer = models.build_tokenizer(tokenizer_corpus(cfg), vocab_size=cfg.vocab_size)
    model = models.build_tiny_model(
        tokenizer,
        arch=cfg.arch,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        seed=cfg.seed,
    )
    log.info("built tiny %s model: %s parameters", cfg.arch, f"{models.count_parameters(model):,}")
    return (add_lora(model, cfg, "tiny SFT model") if cfg.lora_r > 0 else model), tokenizer


def add_lora(model: torch.nn.Module, cfg, what: str) -> torch.nn.Module:
    """`cfg`'s LoRA fields (lora_r, lora_alpha, lora_dropout, lora_target_modules) applied to `model` with
    peft; the adapters are float32, a half-precision base stays half (`what` names the model in the log)."""
    targets = cfg.lora_target_modules
    targets = targets if targets == "all-linear" else [n.strip() for n in targets.split(",") if n.strip()]
    model = models.apply_lora(model, r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                              target_modules=targets)
    return float32_for_training(model, what)


def save_policy_folder(policy: torch.nn.Module, tokenizer, run_path, lora: bool):
    """RUN/model as an ordinary HF folder (LoRA merged, so plain transformers loads it) and, with LoRA, the
    adapter alone in RUN/adapter (peft's format); returns the model folder. Each folder is written whole or not
    at all (checkpoint.atomic_folder), model/ last: a failed write is a `WriteFailed` naming it."""
    run_path = Path(run_path)
    needed = weight_bytes(policy)
    if lora:
        with atomic_folder(run_path / "adapter", "the final adapter folder", run_path, needed) as tmp:
            policy.save_pretrained(str(tmp))
        policy = policy.merge_and_unload()
    with atomic_folder(run_path / "model", "the final model folder", run_path, needed) as tmp:
        models.save_model_folder(tmp, policy, tokenizer)
    return run_path / "model"


def make_optimizer(params, cfg, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW on the trainable parameters. `fused`: torch's one-kernel AdamW (same update, other rounding
    order): 0.6 ms instead of 3.5 ms a step for the demo model's 29 tensors on one CPU thread.
    Every trainable tensor must be float32 (models/precision.py: no in-place half-precision AdamW).
    `params` may also be torch param groups (dicts with "params" and e.g. their own "lr": PPO's critic)."""
    params = list(params)
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in groups]
    check_trainable_float32([p for g in groups for p in g["params"]])
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        **({"fused": True} if fused else {}),
    )


def make_scheduler(optimizer: torch.optim.Optimizer, cfg, total_steps: int):
    """Linear warmup then cosine / linear decay / constant, via transformers' schedules."""
    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[cfg.lr_schedule]
    return get_scheduler(name, optimizer, num_warmup_steps=min(cfg.warmup_steps, total_steps), num_training_steps=total_steps)
