"""What both libraries start from, built once and cached under benchmarks/.cache/ (not run by CI).

- SFT policy: `rlhflab sft` on the built-in suite (tiny Llama, tokenizer with pad != eos);
- reward model: `rlhflab rm` from that SFT model (Bradley-Terry on the suite's pairs);
- value model: the SFT trunk with a fresh scalar `score` head (a `*ForSequenceClassification`,
  which is what TRL's PPOTrainer wants; rlhflab can load it with `--value_mode separate`);
- prompts: the suite's train split as token ids (TRL's dataset is `input_ids` only).
A folder is reused when its `done` marker exists, so repeats skip the training.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(__file__).resolve().parent / ".cache"


@dataclass(frozen=True)
class Assets:
    sft: Path  # HF causal-LM folder (+ tokenizer)
    reward_model: Path  # LlamaForSequenceClassification, num_labels=1
    value_model: Path  # LlamaForSequenceClassification, num_labels=1, fresh head
    prompts: Path  # JSON list of token-id lists (train split)
    notes: dict  # how each was made, wall times


def child_env(threads: int) -> dict:
    """Environment of every child process: fixed threads, passive OpenMP waiting (FACTS.md)."""
    env = dict(os.environ)
    env.update(OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


def rlhflab_cli(args: list[str], threads: int) -> float:
    """Run `rlhflab ARGS` in its own process; returns its wall time."""
    started = time.time()
    cmd = [sys.executable, "-m", "rlhflab.cli", *args, "--threads", str(threads), "--progress", "false",
           "--overwrite", "true"]
    proc = subprocess.run(cmd, env=child_env(threads), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return time.time() - started


def build_sft(folder: Path, steps: int, threads: int) -> float:
    return rlhflab_cli(["sft", "--output_dir", str(folder), "--max_steps", str(steps), "--eval_every", "0",
                        "--save_every", "0", "--seed", "0"], threads)


def build_reward_model(folder: Path, sft_model: Path, threads: int) -> float:
    return rlhflab_cli(["rm", "--model", str(sft_model), "--output_dir", str(folder), "--save_every", "0",
                        "--seed", "0"], threads)


def build_value_model(folder: Path, sft_model: Path) -> None:
    from rlhflab import models

    tokenizer = models.load_tokenizer(str(sft_model))
    value = models.build_reward_model_from_causal(str(sft_model), tokenizer)  # SFT trunk + fresh `score`
    models.save_model_folder(folder, value, tokenizer)


def write_prompts(path: Path, sft_model: Path) -> dict:
    from rlhflab import data, models, tasks

    tokenizer = models.load_tokenizer(str(sft_model))
    items = tasks.build_splits(0)["train"]  # PPOConfig's defaults: split_seed 0, 400 train prompts
    ids = data.encode_prompts(tokenizer, [i.prompt for i in items])
    path.write_text(json.dumps(ids))
    return {"prompts": len(ids), "mean_prompt_tokens": sum(map(len, ids)) / len(ids)}


def prepare(sft_steps: int, threads: int, log=print) -> Assets:
    """Build (or reuse) the SFT model, reward model, value model and prompt ids."""
    root = CACHE / f"sft{sft_steps}"
    root.mkdir(parents=True, exist_ok=True)
    notes_file = root / "notes.json"
    notes = json.loads(notes_file.read_text()) if notes_file.is_file() else {}
    sft, rm = root / "sft", root / "rm"
    if not (sft / "done").is_file():
        log(f"building the SFT model: rlhflab sft --max_steps {sft_steps} ({threads} threads) ...")
        notes["sft_seconds"] = round(build_sft(sft, sft_steps, threads), 1)
        (sft / "done").touch()
    if not (rm / "done").is_file():
        log("building the reward model: rlhflab rm --model <sft> ...")
        notes["rm_seconds"] = round(build_reward_model(rm, sft / "model", threads), 1)
        (rm / "done").touch()
    if not (root / "value" / "done").is_file():
        build_value_model(root / "value", sft / "model")
        (root / "value" / "done").touch()
    notes |= write_prompts(root / "prompts.json", sft / "model")
    notes["sft_steps"] = sft_steps
    notes.pop("rm_summary", None)
    notes["rm_test_accuracy"] = json.loads((rm / "summary.json").read_text())["pairs"]["test"]["accuracy"]
    notes_file.write_text(json.dumps(notes, indent=1))
    return Assets(sft / "model", rm / "model", root / "value", root / "prompts.json", notes)
