"""GPU readiness check (issues 15, 31): SFT and DPO steps, GRPO and PPO updates on a randomly initialised
Qwen2.5-0.5B-shaped model, full fine-tuning and LoRA, float32 / bf16 / fp16 mixed precision, with and without
gradient checkpointing, as a markdown table. No downloads: the model and its tokenizer are built here.

    bash benchmarks/gpu_check.sh             # on a CUDA machine: the CUDA-marked tests, then this script
    python benchmarks/gpu_check.py            # the benchmark alone (backends: lean, and vllm when installed)
    python benchmarks/gpu_check.py --smoke    # anywhere: tiny shapes, CPU, no fp16 (CI runs it)

Rows (benchmarks/gpu_check_cases.py): per stage, LoRA r 16 on a bf16 base with bf16 autocast and checkpointing
(the headline), then full fine-tuning in bf16 with checkpointing, in float32 with checkpointing, in bf16
without, and in fp16 with its loss scaler (SFT and GRPO); other generation backends (vllm when installed) get
the headline row. Each stage's rows run in one child process of their own (vLLM: one per row), each row
through the stage's own `train(cfg)`, measured from its metrics.jsonl with the first step left out:
- episodes/s: SFT sequences, DPO pairs, GRPO / PPO responses per second (online: of whole updates);
- tokens/s: SFT / DPO tokens trained on per second, GRPO / PPO tokens generated per second of generation;
- train TFLOP/s and MFU: model FLOPs (`training_flops`) per second of the training phase, against the bf16
  matmul rate measured in the same child process (8192^3 matmuls): the peak this GPU actually reaches;
- memory: the torch allocator's peak allocated and reserved, and the device's peak in use (mem_get_info,
  sampled: the CUDA context and a vLLM engine's pool count there); on CPU (--smoke) the process's peak RSS.
The model answers random-looking bytes and never EOS, so every response runs to the length cap: the shapes
are fixed and the figures compare rows at equal work. The reward is the answer's length in characters mod 7.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check_cases import (  # noqa: E402  (beside this script; the environment above comes first)
    FULL, METHODS, QWEN25_05B, SMOKE, SMOKE_SHAPE, Row, Setting, Shape, build_model_folder, planned_rows,
    run_rows, write_data,
)

GRACE_S = 30  # a child past its share of the budget by this much is stopped (its finished rows are kept)


def gib(value) -> str:
    return "" if value is None else f"{value / 2**30:.2f}"


def markdown_table(rows: list[dict], on_cpu: bool) -> str:
    memory = ["peak RSS GiB", "", ""] if on_cpu else ["allocated GiB", "reserved GiB", "device GiB (mem_get_info)"]
    columns = ["stage", "tuning", "precision", "checkpointing", "backend", "steps", "episodes/s", "tokens/s",
               "train TFLOP/s", "MFU (train, of bf16 peak)", *memory, "note"]
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * 5 + " ---: |" * 8 + " --- |"]
    for r in rows:
        cells = [r["method"], r["tuning"], r["precision"], "on" if r["checkpointing"] else "off", r["backend"] or "-"]
        if "error" in r:
            lines.append("| " + " | ".join(cells + [""] * 8 + [r["error"]]) + " |")
            continue
        notes = []
        if r.get("amp_scale") is not None:
            notes.append(f"loss scale {r['amp_scale']:g}, {r['amp_skipped_steps']} steps skipped")
        if r["backend"] not in ("lean", ""):
            notes.append("an engine's own pool is in the device column")
        memory_cells = ([gib(r["peak_rss_bytes"]), "", ""] if on_cpu else
                        [gib(r["peak_allocated_bytes"]), gib(r["peak_reserved_bytes"]), gib(r["peak_device_bytes"])])
        cells += [str(r["steps_measured"]), f"{r['episodes_per_s']:.1f}", f"{r['tokens_per_s']:.0f}",
                  f"{r['train_flops_per_s'] / 1e12:.3g}", f"{r['train_flops_per_s'] / r['matmul_peak_flops']['bf16']:.1%}",
                  *memory_cells, "; ".join(notes)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def backends_to_run(requested: str, device: str) -> tuple[list[str], str]:
    """The backends asked for that can run here, and a line on any left out."""
    from importlib.util import find_spec

    names = [b.strip() for b in requested.split(",") if b.strip()]
    if "vllm" in names and (device != "cuda" or find_spec("vllm") is None):
        names.remove("vllm")
        return names, "vllm left out: " + ("no CUDA GPU" if device != "cuda" else "not installed (pip install 'rlhflab[vllm]')")
    return names, ""


def child_groups(rows: list[Row]) -> list[list[Row]]:
    """One child process per stage for the lean backend (its rows in turn: one CUDA start, one import), one
    per row for any other backend (one vLLM engine per process)."""
    groups: dict[str, list[Row]] = {}
    for row in rows:
        groups.setdefault(row.method if row.backend in ("lean", "") else row.key, []).append(row)
    return list(groups.values())


def run_child(group: list[Row], work: Path, results: Path, log: Path, smoke: bool, soft_deadline: float,
              hard_deadline: float, on_row) -> tuple[int | None, str]:
    """Run `group`'s rows in a child process, calling `on_row(line)` as each row's line arrives in `results`;
    stop it at `hard_deadline`. Returns its exit status (None: stopped) and the last line of its log."""
    command = [sys.executable, __file__, "--child", ",".join(r.key for r in group), "--work", str(work),
               "--results", str(results), "--deadline", str(soft_deadline)] + (["--smoke"] if smoke else [])
    seen = 0
    with log.open("w") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        while True:
            status = child.poll()
            lines = results.read_text().splitlines() if results.is_file() else []
            for line in lines[seen:]:
                on_row(json.loads(line))
            seen = len(lines)
            if status is not None:
                break
            if time.time() > hard_deadline:
                child.kill()
                child.wait()
                status = None
                break
            time.sleep(1)
    tail = log.read_text().strip().splitlines()[-1:] or ["no output"]
    return status, tail[0][:160]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU, no fp16")
    parser.add_argument("--backends", default="lean,vllm", help="comma-separated: lean, hf, vllm")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated: sft, dpo, grpo, ppo")
    parser.add_argument("--budget_s", type=float, default=300, help="wall-clock budget: rows that no longer fit "
                                                                    "are listed as not run")
    parser.add_argument("--out", default="", help="folder for results.json, table.md and the children's logs, "
                                                  "rewritten after every row (a killed run keeps what it measured); "
                                                  "default: print only")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)  # row keys, run by the parent
    parser.add_argument("--work", default="", help=argparse.SUPPRESS)
    parser.add_argument("--results", default="", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shape, setting = (SMOKE_SHAPE, SMOKE) if args.smoke else (QWEN25_05B, FULL)
    if args.child:
        run_rows(args.child.split(","), Path(args.work), setting, shape, Path(args.results), args.deadline)
        return 0

    import torch

    if setting.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA GPU; run with --smoke for the CPU check", file=sys.stderr)
        return 2
    started = time.time()
    deadline = started + args.budget_s
    out = Path(args.out).resolve() if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    backends, left_out = backends_to_run(args.backends, setting.device)
    rows, left_out_rows = planned_rows([m.strip() for m in args.methods.split(",") if m.strip()], backends,
                                       setting.device)
    measured: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rlhflab-gpu-check-") as tmp:  # the model folder: GBs, not kept
        work = Path(tmp)
        params = build_model_folder(work / "model", shape)
        write_data(work, setting)
        header = header_lines(args.smoke, setting, shape, params, [left_out] * bool(left_out) + left_out_rows)
        print("\n".join(header), flush=True)
        logs = out or work

        def on_row(line: dict) -> None:
            row = Row(line["method"], line["tuning"], line["precision"], line["checkpointing"], line["backend"])
            measured[row.key] = line
            print(f"{row.key}: {line.get('error', 'measured')} ({time.time() - started:.0f} s in)", flush=True)
            if out is not None:  # what is measured so far survives a run killed later
                save_results(out, header, table_rows(rows, measured), setting.device == "cpu", time.time() - started)

        groups = child_groups(rows)
        for i, group in enumerate(groups):
            share = (deadline - time.time()) / (len(groups) - i)
            name = group[0].method if len(group) > 1 else group[0].key
            status, tail = run_child(group, work, work / f"rows-{name}.jsonl", logs / f"child-{name}.log",
                                     args.smoke, time.time() + share,
                                     min(deadline, time.time() + share + GRACE_S), on_row)
            for row in group:
                if row.key not in measured:
                    reason = (f"stopped past its share of the budget ({share:.0f} s)" if status is None
                              else f"its process ended (exit {status}) first: {tail}")
                    measured[row.key] = {**row.fields(), "error": reason}
    results = table_rows(rows, measured)
    wall = time.time() - started
    if out is not None:
        save_results(out, header, results, setting.device == "cpu", wall)
    print()
    print("\n".join(measured_lines(results) + [markdown_table(results, setting.device == "cpu")]))
    print(f"\nwall {wall:.0f} s")
    return 0 if all("error" not in r for r in results) else 1


def table_rows(rows: list[Row], measured: dict[str, dict]) -> list[dict]:
    """The planned rows in order: measured, failed, or not reached yet."""
    return [measured.get(row.key, {**row.fields(), "error": "not reached yet"}) for row in rows]


def header_lines(smoke: bool, setting: Setting, shape: Shape, params: int, left_out: list[str]) -> list[str]:
    """The table's preamble: versions, model, work per row (the device and matmul rates come with the rows)."""
    import torch
    import transformers

    lines = [f"## rlhflab GPU check{' (smoke)' if smoke else ''}", "",
             f"- torch {torch.__version__} (CUDA {torch.version.cuda}); transformers {transformers.__version__}",
             f"- model: random Qwen2, {params / 1e6:.3g}M parameters ({json.dumps(asdict(shape))}); full fine-tuning "
             f"trains float32 master weights; LoRA r {setting.lora_r} on a base stored in the autocast dtype",
             f"- per SFT step {setting.batch_size} sequences, per DPO step {setting.dpo_pairs} pairs, "
             f"{setting.offline_steps} steps; per GRPO / PPO update {setting.batch_size} responses of "
             f"{setting.response_length} tokens, {setting.online_updates} updates; prompts of {setting.prompt_tokens} "
             f"tokens, answers of {setting.response_length}; the first step / update not measured; PPO 2 epochs x 2 "
             f"minibatches with a value head on the trunk, GRPO groups of {setting.num_generations}, 1 pass"]
    return lines + [f"- left out: {line}" for line in left_out] + [""]


def measured_lines(rows: list[dict]) -> list[str]:
    """The preamble's lines that come from the children: the device and the bf16 matmul rates they measured."""
    devices = sorted({r["device"] for r in rows if "device" in r})
    peaks = [r["matmul_peak_flops"]["bf16"] for r in rows if "matmul_peak_flops" in r]
    if not peaks:
        return []
    return [f"- device: {', '.join(devices)}; bf16 matmul rate measured {min(peaks) / 1e12:.3g}-{max(peaks) / 1e12:.3g} "
            "TFLOP/s (each child process's own is its rows' MFU denominator)", ""]


def save_results(out: Path, header: list[str], rows: list[dict], on_cpu: bool, wall: float) -> None:
    """OUT/results.json (every row's measurements and the wall time so far) and OUT/table.md."""
    preamble = header + measured_lines(rows)
    (out / "results.json").write_text(json.dumps({"wall_s": wall, "header": preamble, "cases": rows}, indent=1))
    (out / "table.md").write_text("\n".join(preamble) + "\n" + markdown_table(rows, on_cpu) + f"\n\nwall {wall:.0f} s\n")


if __name__ == "__main__":
    sys.exit(main())
