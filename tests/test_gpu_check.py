"""benchmarks/gpu_check.sh / gpu_check.py cannot rot unseen: the shell script's dry mode runs here end to end in an
interpreter that has what the GPU machine's python3 has and not datasets, vllm, deepspeed, trl or rlhflab itself
(the import path from src/, the CUDA test files collected, the CPU smoke benchmark: the same code as the GPU run,
tiny shapes, every stage's rows in a child process of their own, results written to --out), and the FLOP count,
the figures read from metrics.jsonl, the planned rows and the time budget are checked by hand."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from bare_env import RLHFLAB, bare_python

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
# what the GPU machine's python3 lacks (issue 31), and rlhflab's own installation (the script must not need it)
ABSENT = ("datasets", "vllm", "deepspeed", "trl", "trackio", "playwright", *RLHFLAB)


def load_script(name: str = "gpu_check_cases"):
    """benchmarks/NAME.py as a module (gpu_check.py imports gpu_check_cases from beside it)."""
    if str(SCRIPT.parent) not in sys.path:
        sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location(name, SCRIPT.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_training_flops_hand_worked_and_counting_every_matmul_weight_of_qwen25_05b():
    check = load_script()
    shape = check.Shape(hidden=4, layers=1, heads=2, kv_heads=1, intermediate=8, vocab=10)
    # trunk weights 2*16 (q, o) + 2*4*2 (k, v) + 3*32 (MLP) = 144; head 40; linear forward 2*144*2 + 2*40*2 = 736;
    # attention 2 tokens * 4 * 2 * 4 = 64, its backward twice that (dQ, dK, dP, dV); full: 2 * 736 + 3 * 64 + 736
    # weight gradients; LoRA: no weight gradients
    assert check.training_flops(shape, rows=1, prompt=1, response=1, passes=1, lora=False) == 2400
    assert check.training_flops(shape, rows=1, prompt=1, response=1, passes=3, lora=True) == 3 * 1664
    # Qwen2.5-0.5B has 494,032,768 parameters: 43,904 in norms and 27,648 in q/k/v biases, the rest matmul weights
    q = check.QWEN25_05B
    head, attention = q.hidden * q.vocab, q.layers * 4 * q.hidden  # one token; the head runs on 2 positions
    linear = (check.training_flops(q, rows=1, prompt=0, response=1, passes=1, lora=True) - 3 * attention) / 2
    trunk_and_head = (linear - 2 * 2 * head) / 2 + head
    assert trunk_and_head == 494_032_768 - 43_904 - 27_648


def test_byte_tokenizer_has_the_asked_vocabulary_and_one_token_per_byte():
    tokenizer = load_script().byte_tokenizer(600)
    assert len(tokenizer) == 600 and tokenizer.pad_token_id == 0 and tokenizer.eos_token_id == 1
    assert len(tokenizer("ab c")["input_ids"]) == 4
    assert isinstance(tokenizer.decode(list(range(2, 600))), str)  # every id decodes


def test_the_dry_run_works_without_datasets_or_an_installed_rlhflab_and_writes_its_results(tmp_path):
    python = bare_python(tmp_path / "env", ABSENT)
    probe = subprocess.run([str(python), "-c", "import importlib.util as u; "
                            "print([m for m in ('datasets', 'rlhflab', 'torch', 'peft') if u.find_spec(m)])"],
                           capture_output=True, text=True, cwd=tmp_path)
    assert probe.stdout.strip() == "['torch', 'peft']", probe.stderr  # the interpreter is as bare as claimed
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry", "--out", str(out)],
                          env={**env, "PYTHON": str(python)}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (out / "log.txt").read_text()
    assert f"rlhflab from {ROOT / 'src' / 'rlhflab' / '__init__.py'}" in log
    assert re.search(r"not installed here: datasets, vllm, deepspeed, trl", log)
    tests = (out / "tests.txt").read_text()
    assert "needs a CUDA GPU" in tests and " skipped" in tests and "error" not in tests.lower()
    results = json.loads((out / "results.json").read_text())
    variants = [("lora", "bf16", True), ("full", "bf16", True), ("full", "fp32", True), ("full", "bf16", False)]
    planned = [(m, *v, b) for m, b in (("sft", ""), ("dpo", ""), ("grpo", "lean"), ("ppo", "lean")) for v in variants]
    assert [(c["method"], c["tuning"], c["precision"], c["checkpointing"], c["backend"]) for c in results["cases"]] \
        == planned  # no fp16 on a CPU
    assert all("error" not in c for c in results["cases"]), [c.get("error") for c in results["cases"]]
    table = (out / "table.md").read_text()
    rows = [line for line in table.splitlines() if re.match(r"\| (sft|dpo|grpo|ppo) \|", line)]
    assert len(rows) == 16 and "vllm left out: no CUDA GPU" in table and "sft fp16: autocast in fp16 needs" in table
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        steps, episodes, tokens, mfu = int(cells[5]), float(cells[6]), float(cells[7]), float(cells[9].rstrip("%"))
        # MFU is printed to 0.1 %: on a busy 2-core machine a tiny CPU row can round to 0.0 %
        assert steps >= 1 and episodes > 0 and tokens > 0 and 0 <= mfu < 100 and float(cells[10]) > 0
    assert table.splitlines()[-1].startswith("wall ") and "gpu_check.sh: tests exit 0, benchmark exit 0" in log
    assert (out / "child-sft.log").is_file()


def test_planned_rows_fp16_only_on_cuda_for_sft_and_grpo_and_other_backends_get_the_headline_row():
    check = load_script()
    rows, left_out = check.planned_rows(["sft", "dpo", "grpo", "ppo"], ["lean", "vllm"], "cuda")
    keys = [r.key for r in rows]
    assert "sft-full-fp16-gc-" in keys and "grpo-full-fp16-gc-lean" in keys and not left_out
    assert not any(k.startswith(("dpo", "ppo")) and "fp16" in k for k in keys)
    assert [k for k in keys if k.endswith("vllm")] == ["grpo-lora-bf16-gc-vllm", "ppo-lora-bf16-gc-vllm"]
    assert len(keys) == 4 * 4 + 2 + 2 and all(check.Row.from_key(k).key == k for k in keys)
    _, left_out = check.planned_rows(["sft"], ["lean"], "cpu")
    assert left_out == ["sft fp16: autocast in fp16 needs a CUDA device"]


def test_figures_from_metrics_hand_worked():
    check = load_script()
    shape, setting = check.SMOKE_SHAPE, check.SMOKE  # SFT steps of 8 sequences of 8 + 6 tokens
    sft = check.Row("sft", "full", "fp32", True, "")
    metrics = [{"loss/sft": 1.0, "elapsed_s": 1.0}, {"loss/sft": 0.9, "elapsed_s": 3.0}, {"val/loss": 0.8},
               {"loss/sft": 0.8, "elapsed_s": 5.0}]
    figures = check.offline_figures(metrics, setting, shape, sft)  # steps 2 and 3: 4 s
    flops = check.training_flops(shape, 8, 8, 6, 1, lora=False)
    assert figures == {"steps_measured": 2, "episodes_per_s": 16 / 4, "tokens_per_s": 8 * 14 * 2 / 4,
                       "train_flops_per_s": flops * 2 / 4}
    dpo = check.offline_figures([{"loss": 1.0, "elapsed_s": 0.0}, {"loss": 1.0, "elapsed_s": 2.0}], setting, shape,
                                check.Row("dpo", "lora", "bf16", True, ""))  # 4 pairs = 8 sequences in 2 s
    assert dpo["episodes_per_s"] == 2 and dpo["train_flops_per_s"] == check.training_flops(shape, 8, 8, 6, 1, True) / 2

    class Cfg:
        batch_size, num_iterations = 8, 1

    updates = [{"time/training": 9.0, "eps": 1.0, "response/length_mean": 1, "time/generation": 9.0},
               {"time/training": 1.0, "eps": 4.0, "response/length_mean": 6, "time/generation": 0.5},
               {"time/training": 3.0, "eps": 2.0, "response/length_mean": 5, "time/generation": 1.5}]
    online = check.online_figures(updates, Cfg, setting, shape, check.Row("grpo", "full", "bf16", False, "lean"))
    assert online["steps_measured"] == 2 and online["episodes_per_s"] == 16 / (2 + 4)  # 8/4 s + 8/2 s
    assert online["tokens_per_s"] == (6 + 5) * 8 / 2.0 and online["response_length_mean"] == 5.5
    assert online["train_flops_per_s"] == check.training_flops(shape, 8, 8, 6, 1, False) * 2 / 4.0


def test_rows_past_the_deadline_are_written_as_not_run_without_training(tmp_path):
    check = load_script()
    results = tmp_path / "rows.jsonl"
    check.run_rows(["sft-full-fp32-gc-", "grpo-lora-bf16-gc-lean"], tmp_path, check.SMOKE, check.SMOKE_SHAPE,
                   results, deadline=0.0)
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(x["method"], x["error"].split(":")[0]) for x in lines] == [("sft", "not run"), ("grpo", "not run")]
    assert lines[0]["matmul_peak_flops"]["bf16"] > 0 and not (tmp_path / "runs").exists()
