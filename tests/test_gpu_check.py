"""benchmarks/gpu_check.py cannot rot unseen: its CPU smoke mode runs here end to end (the same code as the
GPU run, tiny shapes, float32, each case in its own process), and its FLOP count is checked by hand."""

import importlib.util
import re
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up there
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


def test_smoke_mode_runs_every_case_and_prints_the_table(capsys):
    check = load_script()
    assert check.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"\| (ppo|grpo) \| lean \|", line)]
    assert len(rows) == 2, out
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        episodes, tokens, mfu = float(cells[2]), float(cells[3]), float(cells[5].rstrip("%"))
        assert episodes > 0 and tokens > 0 and 0 < mfu < 100
    assert "vllm left out: no CUDA GPU" in out
