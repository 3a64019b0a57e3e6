"""benchmarks/gpu_check.sh / gpu_check.py cannot rot unseen: the shell script's dry mode runs here end to end in an
interpreter that has what the GPU machine's python3 has and not datasets, vllm, deepspeed, trl or rlhflab itself
(the import path from src/, the CUDA test files collected, the CPU smoke benchmark: the same code as the GPU run,
tiny shapes, float32, each case in its own process, results written to --out), and the FLOP count is checked by
hand."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
# what the GPU machine's python3 lacks (issue 31), and rlhflab's own installation (the script must not need it)
ABSENT = ("datasets", "vllm", "deepspeed", "trl", "trackio", "playwright", "rlhflab", "__editable__")


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


def bare_python(folder: Path) -> Path:
    """A fresh virtualenv that sees this one's packages but none of ABSENT: each kept top-level entry of this
    environment's site-packages linked into one folder, which the new environment's only .pth file names (no
    other .pth file is read there, so rlhflab's editable install is not either)."""
    kept = folder / "site-packages"
    kept.mkdir(parents=True)
    paths = sysconfig.get_paths()
    for site in dict.fromkeys(Path(paths[key]).resolve() for key in ("purelib", "platlib")):
        for entry in site.iterdir():
            if entry.suffix == ".pth" or entry.name.lower().startswith(ABSENT) or (kept / entry.name).exists():
                continue
            (kept / entry.name).symlink_to(entry)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder / "venv")], check=True)
    site = next((folder / "venv" / "lib").glob("python*/site-packages"))
    (site / "kept.pth").write_text(f"{kept}\n")
    return folder / "venv" / "bin" / "python"


def test_the_dry_run_works_without_datasets_or_an_installed_rlhflab_and_writes_its_results(tmp_path):
    python = bare_python(tmp_path / "env")
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
    assert [(c["method"], c["backend"]) for c in results["cases"]] == [("ppo", "lean"), ("grpo", "lean")]
    table = (out / "table.md").read_text()
    rows = [line for line in table.splitlines() if re.match(r"\| (ppo|grpo) \| lean \|", line)]
    assert len(rows) == 2 and "vllm left out: no CUDA GPU" in table, table
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        episodes, tokens, mfu = float(cells[2]), float(cells[3]), float(cells[5].rstrip("%"))
        assert episodes > 0 and tokens > 0 and 0 < mfu < 100
    assert table.splitlines()[-1].startswith("wall ") and "gpu_check.sh: tests exit 0, benchmark exit 0" in log
