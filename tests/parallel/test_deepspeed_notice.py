"""DeepSpeed's "Setting accelerator to CPU" warning (issue 32 item 5): silent when DeepSpeed is only imported by
accelerate on the way through `save_pretrained`, printed once `parallel_strategy deepspeed` is in use. Each case in
a fresh process: deepspeed warns once, at its import. A CLI run without it: tests/cli/test_cli.py (the demo)."""

import importlib.util
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="DeepSpeed warns only where it finds no GPU"),
]

NOTICE = "Setting accelerator to CPU"
SAVE = ("import sys, tempfile, torch, transformers\n"
        "model = transformers.LlamaForCausalLM(transformers.LlamaConfig(hidden_size=8, intermediate_size=16, "
        "num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, vocab_size=16))\n"
        "model.save_pretrained(tempfile.mkdtemp())  # accelerate's unwrap imports deepspeed here\n"
        "assert 'deepspeed' in sys.modules\n")
IN_USE = ("from rlhflab import parallel\n"
          "from rlhflab.parallel import wrap\n"
          "wrap._deepspeed(torch.nn.Linear(1, 1), parallel.SINGLE, wrap.Layout('deepspeed', parallel.SINGLE))\n")


def output_of(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def test_saving_a_model_without_deepspeed_in_use_prints_no_accelerator_warning():
    assert NOTICE not in output_of("import rlhflab.parallel\n" + SAVE)


def test_the_warning_is_printed_once_deepspeed_is_the_run_s_strategy():  # (and the test above can see it)
    assert NOTICE in output_of("import torch\n" + IN_USE + SAVE)
