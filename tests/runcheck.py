"""Helpers for tests that run the CLI in a subprocess, signal it, and compare run folders."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rlhflab.config import STAGES, parse_config
from rlhflab.eval import RunMonitor
from rlhflab.trainers import ppo, reward, sft

WALL_CLOCK = ("eps", "tokens_per_s", "elapsed_s")

SUITE = ["--num_train_prompts", "22", "--num_validation_prompts", "11", "--num_test_prompts", "11",
         "--progress", "false", "--threads", "1", "--seed", "3"]


FATAL_MARKS = ("Traceback", "Error", "terminate called", "what():", "Fatal Python error", "Segmentation fault")


def launch_failure(done: subprocess.CompletedProcess, keep: int = 5000) -> str:
    """What a failed subprocess printed that says why: the lines that name an error or a C++ abort
    (wherever they are: torchrun's closing summary would push them out of a plain tail), then the tail."""
    text = (done.stdout or "") + (done.stderr or "")
    marked = [line for line in text.splitlines() if any(mark in line for mark in FATAL_MARKS)]
    return (f"exit {done.returncode}; lines naming the failure:\n" + "\n".join(marked[:60])
            + f"\n--- last {keep} characters ---\n" + text[-keep:])


def ppo_args(policy_dir, out):
    return ["ppo", "--model", policy_dir, "--output_dir", str(out), "--batch_size", "8", "--num_mini_batches", "2",
            "--response_length", "6", "--max_new_tokens", "6", "--total_episodes", "48", "--eval_every", "3",
            "--eval_prompts", "4", "--sample_prompts", "2", "--learning_rate", "1e-3", "--save_every", "2",
            "--adaptive_kl", "true", "--kl_target", "0.5", "--kl_horizon", "100", "--lora_r", "4",
            "--value_mode", "lora_adapter", "--stop_on_alarms", "", *SUITE]


def sft_args(out):
    return ["sft", "--output_dir", str(out), "--hidden_size", "32", "--num_layers", "1", "--intermediate_size", "64",
            "--sft_examples", "64", "--batch_size", "8", "--max_steps", "16", "--eval_every", "5",
            "--eval_prompts", "4", "--max_new_tokens", "6", "--log_every", "1", "--save_every", "3",
            "--group_by_length", "2", "--gradient_accumulation_steps", "1", *SUITE]  # one loss call per step


def rm_args(policy_dir, out):
    return ["rm", "--model", policy_dir, "--output_dir", str(out), "--pairs_per_prompt", "2", "--batch_size", "4",
            "--num_epochs", "2", "--log_every", "1", "--save_every", "3",
            "--average_weights", "0.8", *SUITE]  # steps 5-22 averaged: a resume at 6 must carry the mean


def train(args: list[str]):
    """What `rlhflab <stage> ARGS` does, in-process and without the HTML report (seconds saved per run)."""
    cfg = parse_config(STAGES[args[0]], args[1:], prog=f"rlhflab {args[0]}")
    if args[0] == "ppo":
        return ppo.train(cfg, monitor=RunMonitor.from_config(cfg))
    return {"sft": sft.train, "rm": reward.train}[args[0]](cfg)


def metrics(run: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock fields (they differ between any two runs)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK and not k.startswith("time/")} for r in rows]


def assert_same_weights(a: Path, b: Path) -> None:
    """Every safetensors file under model/ (and value/) is bitwise equal in both runs."""
    files = sorted(p.relative_to(a) for p in a.rglob("*.safetensors") if "checkpoints" not in p.parts)
    assert files, f"no weights under {a}"
    for rel in files:
        left, right = load_file(str(a / rel)), load_file(str(b / rel))
        assert left.keys() == right.keys(), rel
        for key in left:
            assert left[key].equal(right[key]), f"{rel}: {key} differs"


def start_cli(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "rlhflab.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Poll until `path` exists; fail if the process ends first."""
    deadline = time.time() + timeout
    while not path.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended (code {proc.returncode}) before {path} appeared:\n{err[-3000:]}")
        assert time.time() < deadline, f"{path} did not appear in {timeout} s"
        time.sleep(0.01)


def kill_after(path: Path, proc: subprocess.Popen, signum: int = signal.SIGKILL) -> tuple[int, str]:
    """Send `signum` as soon as `path` exists; returns (exit code, stderr)."""
    wait_for(path, proc)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err
