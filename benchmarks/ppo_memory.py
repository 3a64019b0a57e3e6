"""Peak memory of each PPO memory mode, each in its own process (not run by CI).

    python benchmarks/ppo_memory.py --size demo --device cpu
    python benchmarks/ppo_memory.py --size 100m --device cuda

Modes (README "PPO memory modes"): full fine-tune with a resident reference copy;
(c) reference reloaded for each rollout's log-probs and freed; a separate value
model (stepped with the policy, or after it: one model's gradients at a time); (a) LoRA policy whose reference is the base with the adapter off;
(a+b) LoRA policy + a second LoRA adapter as the value model on the same frozen
base. Prints peak RSS (CPU) or peak allocated CUDA memory per mode, with the
process's memory before any model was loaded, on an identical workload.
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
    "full, reference reloaded (c)": {"reference_mode": "reload"},
    "full, separate value model": {"value_mode": "separate"},
    "full, separate value model stepped after the policy": {"value_mode": "separate", "value_step": "after_policy"},
    "LoRA r8, reference = adapter off (a)": {"lora_r": 8},
    "LoRA r8 + value adapter, one base (a+b)": {"lora_r": 8, "value_mode": "lora_adapter"},
}
SIZES = {
    "demo": dict(hidden_size=96, num_layers=3, num_heads=4, intermediate_size=256),
    "100m": dict(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=2560),
}




def build_model(size: str, folder: Path) -> int:
    from rlhflab import models, tasks

    tokenizer = models.build_tokenizer(tasks.template_corpus(), vocab_size=384)
    model = models.build_tiny_model(tokenizer, **SIZES[size], seed=0)
    models.save_model_folder(folder, model, tokenizer)
    return models.count_parameters(model)


def child(mode: str, model_dir: str, device: str, updates: int, batch: int) -> None:
    import torch

    from rlhflab.config import PPOConfig
    from rlhflab.trainers import ppo

    before = rss_mib()
    cfg = PPOConfig(model=model_dir, device=device, batch_size=batch, num_mini_batches=2, response_length=32,
                    total_episodes=batch * updates, eval_every=0, eval_prompts=batch, sample_prompts=0,
                    max_new_tokens=32, progress=False, threads=int(os.environ.get("BENCH_THREADS", "2")),
                    output_dir=tempfile.mkdtemp(prefix="ppo-mem-"), overwrite=True, **MODES[mode])
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    started = time.time()
    ppo.train(cfg)
    cuda_peak = torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else None
    print(json.dumps({"rss_before_models_mib": before, "peak_rss_mib": rss_mib(), "peak_cuda_mib": cuda_peak,
                      "seconds": time.time() - started}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="demo")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model_dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.model_dir, args.device, args.updates, args.batch)
        return
    folder = Path(tempfile.mkdtemp(prefix="ppo-mem-model-"))
    params = build_model(args.size, folder)
    print(f"model: tiny llama '{args.size}', {params / 1e6:.1f}M parameters; device {args.device}; "
          f"batch {args.batch}, {args.updates} updates, 32-token responses, 2 minibatches x 2 epochs")
    print(f"{'mode':<42} {'peak RSS MiB':>12} {'RSS before models':>18} {'peak CUDA MiB':>14} {'seconds':>8}")
    for mode in MODES:
        cmd = [sys.executable, __file__, "--child", mode, "--model_dir", str(folder), "--device", args.device,
               "--updates", str(args.updates), "--batch", str(args.batch)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{mode:<42} failed: {proc.stderr.strip().splitlines()[-1]}")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        cuda = f"{r['peak_cuda_mib']:.0f}" if r["peak_cuda_mib"] is not None else "-"
        print(f"{mode:<42} {r['peak_rss_mib']:>12.0f} {r['rss_before_models_mib']:>18.0f} {cuda:>14} {r['seconds']:>8.1f}")


if __name__ == "__main__":
    main()
