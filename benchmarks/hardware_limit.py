"""How far PPO is from what the CPU can do: fp32 matmul peak and model-FLOPs utilisation per phase.

Model FLOPs per episode (S = prompt + response tokens, N = parameters; the tied embedding
counts once, as the LM-head matmul; attention adds 2·L·S²·d per causal forward):
  generation  1 forward of S tokens             (prefill + one token at a time, KV cache)
  scoring     3 forwards: policy (+ shared value head), reference, reward model
  training    per PPO epoch 1 forward + backward = 3 forwards (full), ≈ 2 forwards (LoRA:
              no weight gradients for the frozen base); with one minibatch rlhflab reuses the
              scoring pass's policy forward as the first epoch's forward (reuse_rollout_forward),
              so one forward fewer is counted in training
MFU = those FLOPs / (phase wall time × measured fp32 matmul peak at the same thread count).
Useful FLOPs only: padding and rows that already ended are not counted.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

SIZE_25M = dict(hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1376)


def matmul_gflops(threads: int, n: int = 1024, seconds: float = 1.5) -> float:
    """Best fp32 (n x n) @ (n x n) throughput over ~`seconds`, in GFLOP/s."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - started) / 1e9)
    return best


def forward_flops(params: int, layers: int, hidden: int, seq: float) -> float:
    """One causal forward over `seq` tokens: 2·N·S matmul FLOPs + 2·L·S²·d attention."""
    return 2 * params * seq + 2 * layers * seq * seq * hidden


def phase_flops(params: int, layers: int, hidden: int, seq: float, epochs: int, lora: bool,
                reused_forward: bool = True) -> dict:
    """Model FLOPs per episode of each PPO phase."""
    fwd = forward_flops(params, layers, hidden, seq)
    return {"generation": fwd, "scoring": 3 * fwd,
            "training": (epochs * (2 if lora else 3) - (1 if reused_forward else 0)) * fwd}


def build_25m(folder: Path) -> tuple[Path, Path]:
    """A randomly initialised ~25M-parameter tiny Llama and a reward model of the same size."""
    from rlhflab import models, tasks

    policy_dir, rm_dir = folder / "policy", folder / "rm"
    if not (folder / "done").is_file():
        tokenizer = models.build_tokenizer(tasks.template_corpus(), vocab_size=384)
        model = models.build_tiny_model(tokenizer, **SIZE_25M, seed=0)
        models.save_model_folder(policy_dir, model, tokenizer)
        models.save_model_folder(rm_dir, models.build_reward_model_from_causal(model, tokenizer), tokenizer)
        (folder / "done").touch()
    return policy_dir, rm_dir


def mfu_rows(name: str, model_dir: str, run: dict, peak: float, epochs: int, lora: bool,
             prompt_tokens: float) -> list[list[str]]:
    """Rows of the MFU table for one rlhflab PPO run (its JSON line from ppo_vs_trl.run_child)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    from rlhflab import models

    params = models.count_parameters(models.load_causal_lm(model_dir))
    response = run["response_tokens"] / run["episodes"]
    flops = phase_flops(params, config["num_hidden_layers"], config["hidden_size"], prompt_tokens + response,
                        epochs, lora)
    rows = []
    for phase, seconds in run["phase_seconds"].items():
        achieved = flops[phase] * run["episodes"] / seconds / 1e9
        rows.append([name, f"{params / 1e6:.2f}M", str(run["threads"]), phase, f"{flops[phase] / 1e6:.1f}",
                     f"{seconds:.2f}", f"{achieved:.2f}", f"{peak:.1f}", f"{achieved / peak:.1%}"])
    return rows


MFU_COLUMNS = ["model", "params", "threads", "phase", "MFLOP/episode", "seconds", "GFLOP/s", "peak GFLOP/s", "MFU"]
