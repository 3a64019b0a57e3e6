"""Memory of PPO in float32 vs bfloat16, per memory mode: peak RSS of a short run, each in its own
process, and the bytes of weights, gradients and AdamW state the roles hold (not run by CI).

    python benchmarks/precision_memory.py              # a ~10M-parameter tiny Llama, CPU
    python benchmarks/precision_memory.py --size 25m

With dtype=bfloat16 (models/precision.py): a LoRA run keeps its frozen base (policy, reference,
shared / adapter value trunk) in bf16 and trains float32 adapters and heads; whatever trains whole
weights (a policy without LoRA, a separate value model) is float32 whatever dtype says, so full
fine-tuning rows barely change, by design. Prints a markdown table.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from peak_rss import rss_mib  # noqa: E402

MODES = {
    "full, reference resident": {},
    "full, reference reloaded": {"reference_mode": "reload"},
    "full, separate value model": {"value_mode": "separate"},
    "LoRA r8, shared value head": {"lora_r": 8},
    "LoRA r8, separate value model": {"lora_r": 8, "value_mode": "separate"},
    "LoRA r8 + value adapter, one base": {"lora_r": 8, "value_mode": "lora_adapter"},
    "LoRA r8 + value adapter, merged generation": {"lora_r": 8, "value_mode": "lora_adapter",
                                                   "lora_merge_generation": True},
}
SIZES = {
    "10m": dict(hidden_size=384, num_layers=6, num_heads=6, intermediate_size=1024),
    "25m": dict(hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1536),
}
DTYPES = ("float32", "bfloat16")


def build_models(size: str, folder: Path) -> int:
    """The same weights saved twice, in float32 and in bf16 (as hub checkpoints are stored): each dtype
    row loads its own, so no run reads (and counts in its RSS) a file twice its weights' size."""
    import torch

    from rlhflab import models, tasks

    tokenizer = models.build_tokenizer(tasks.template_corpus(), vocab_size=384)
    model = models.build_tiny_model(tokenizer, **SIZES[size], seed=0)
    params = models.count_parameters(model)
    for dtype in DTYPES:
        models.save_model_folder(folder / dtype, model.to(getattr(torch, dtype)), tokenizer)
    return params


def config(mode: str, dtype: str, model_dir: str, updates: int, batch: int):
    from rlhflab.config import PPOConfig

    return PPOConfig(model=model_dir, dtype=dtype, batch_size=batch, num_mini_batches=2, response_length=24,
                     total_episodes=batch * updates, eval_every=0, eval_prompts=batch, sample_prompts=0,
                     console_samples=0, max_new_tokens=24, num_train_prompts=64, num_validation_prompts=16,
                     num_test_prompts=16, progress=False, threads=int(os.environ.get("BENCH_THREADS", "2")),
                     output_dir=tempfile.mkdtemp(prefix="ppo-prec-"), overwrite=True, **MODES[mode])


def held_bytes(cfg) -> dict:
    """MiB of the weights the roles keep resident, and of gradients + AdamW moments of what trains."""
    from rlhflab.trainers.online.setup import build_roles

    roles, _ = build_roles(cfg)
    modules = [m for m in (*roles.modules(), roles.reference) if m is not None]
    params = {id(p): p for m in modules for p in m.parameters()}.values()
    trainable = roles.trainable_parameters()
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.numel() * p.element_size() for p in trainable)
    adam = sum(2 * p.numel() * 4 for p in trainable)  # exp_avg, exp_avg_sq in float32
    return {"weights_mib": weights / 2**20, "train_state_mib": (grads + adam) / 2**20,
            "trainable": sum(p.numel() for p in trainable)}


def child(mode: str, dtype: str, model_dir: str, updates: int, batch: int) -> None:
    from rlhflab.trainers import ppo

    before = rss_mib()
    started = time.time()
    ppo.train(config(mode, dtype, model_dir, updates, batch))
    print(json.dumps({"rss_before_mib": before, "peak_rss_mib": rss_mib(), "seconds": time.time() - started}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="10m")
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model_dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.model_dir, args.updates, args.batch)
        return
    folder = Path(tempfile.mkdtemp(prefix="ppo-prec-model-"))
    params = build_models(args.size, folder)
    print(f"tiny Llama '{args.size}', {params / 1e6:.1f}M parameters, CPU, {os.environ.get('BENCH_THREADS', '2')} "
          f"threads; batch {args.batch}, {args.updates} updates, 24-token responses, 2 minibatches x 2 epochs\n")
    print("| mode | dtype | trainable | weights MiB | grads + AdamW MiB | peak RSS MiB | RSS before models | s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for mode in MODES:
        for dtype in DTYPES:
            held = held_bytes(config(mode, dtype, str(folder / dtype), args.updates, args.batch))
            cmd = [sys.executable, __file__, "--child", mode, dtype, "--model_dir", str(folder / dtype),
                   "--updates", str(args.updates), "--batch", str(args.batch)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"| {mode} | {dtype} | failed: {proc.stderr.strip().splitlines()[-1]} |")
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"| {mode} | {dtype} | {held['trainable'] / 1e6:.2f}M | {held['weights_mib']:.1f} | "
                  f"{held['train_state_mib']:.1f} | {r['peak_rss_mib']:.0f} | {r['rss_before_mib']:.0f} | "
                  f"{r['seconds']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
