"""Token log-probs at a real vocabulary: full logits vs the two chunked forms in rlhflab.core.logprobs (not run by CI).

    python benchmarks/logprob_chunks.py                    # Qwen2.5-0.5B's head: 2,048 positions, H 896, V 151,936
    python benchmarks/logprob_chunks.py --positions 512 --chunks 128,512

One forward + backward of sum(w * logprobs) per form, float32, 1 thread, in this process (fresh peak per form via
a child process each, so one form's freed memory does not hide the next one's peak). Prints seconds (median of
--repeats) and each child's peak RSS.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402


def run_one(form: str, positions: int, hidden_size: int, vocab: int, chunk: int, repeats: int, dtype: str,
            frozen: bool) -> dict:
    import statistics
    import time

    import torch

    from rlhflab.core.logprobs import chunked_head_logprobs, recomputed_head_logprobs, selective_log_softmax

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(positions, hidden_size, generator=g).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=g) * 0.02).requires_grad_(not frozen)
    tokens = torch.randint(0, vocab, (positions,), generator=g)
    w = torch.randn(positions, generator=g)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")

    def step():
        with autocast:
            if form == "full":
                logprobs = selective_log_softmax(torch.nn.functional.linear(hidden, weight), tokens)
            elif form == "chunked":
                logprobs, _ = chunked_head_logprobs(hidden, weight, tokens, chunk=chunk,
                                                    compute_dtype=torch.bfloat16 if dtype == "bf16" else None)
            else:
                logprobs, _ = recomputed_head_logprobs(hidden, lambda h: torch.nn.functional.linear(h, weight),
                                                       tokens, chunk=chunk)
        (w * logprobs).sum().backward()
        hidden.grad = weight.grad = None

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    return {"form": form, "chunk": chunk, "dtype": dtype, "head": "frozen" if frozen else "trained",
            "seconds": statistics.median(times), "peak_mib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, default=2048)
    parser.add_argument("--hidden_size", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunks", default="256,1024")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--heads", default="trained,frozen", help="trained (full fine-tuning) and / or frozen (LoRA)")
    parser.add_argument("--child", default="")
    args = parser.parse_args()
    if args.child:
        form, chunk, dtype, head = args.child.split(":")
        print(json.dumps(run_one(form, args.positions, args.hidden_size, args.vocab, int(chunk), args.repeats, dtype,
                                 head == "frozen")))
        return
    rows = []
    print("| dtype | head | form | chunk | seconds | peak RSS MiB |\n| --- | --- | --- | --- | --- | --- |")
    plan = [("full", 0)] + [(f, int(c)) for c in args.chunks.split(",") for f in ("chunked", "recomputed")]
    for dtype, head, (form, chunk) in [(d, h, p) for d in args.dtypes.split(",") for h in args.heads.split(",")
                                       for p in plan]:
        out = subprocess.run([sys.executable, __file__, "--child", f"{form}:{chunk}:{dtype}:{head}",
                              "--positions", str(args.positions), "--hidden_size", str(args.hidden_size),
                              "--vocab", str(args.vocab), "--repeats", str(args.repeats)],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"| {r['dtype']} | {r['head']} | {r['form']} | {r['chunk'] or '-'} | {r['seconds']:.2f} | "
              f"{r['peak_mib']:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
