"""Resume notices when what it reads again changed: the data file, the model folder, a reward function's file, the
versions (rlhflab/checkpoint/fingerprints.py); refused with the differences listed unless --allow_config_change,
which records them in summary.json."""

import json
import shutil

from runcheck import SUITE, train
from safetensors.torch import load_file, save_file

from rlhflab import tasks
from rlhflab.checkpoint.fingerprints import fingerprint_changes, fingerprints
from rlhflab.cli import main
from rlhflab.config import GRPOConfig


def sft_on_files(model, data, out) -> list[str]:
    return ["sft", "--model", str(model), "--train_file", str(data), "--output_dir", str(out), "--max_steps", "4",
            "--save_every", "2", "--batch_size", "4", "--eval_every", "0", "--eval_prompts", "4",
            "--max_new_tokens", "4", *SUITE]


def test_changed_data_model_and_versions_are_refused_on_resume_unless_allowed(policy_dir, tmp_path, capsys):
    model, data, out = tmp_path / "model", tmp_path / "train.jsonl", tmp_path / "run"
    shutil.copytree(policy_dir, model)
    rows = [{"prompt": i.prompt, "completion": i.reference} for i in tasks.sample_items("train", 8, seed=3)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = sft_on_files(model, data, out)
    train(args)
    recorded = json.loads((out / "fingerprints.json").read_text())
    assert recorded["train_file"].startswith(f"{data}: {data.stat().st_size} bytes, sha256 ")
    assert "model/model.safetensors" in recorded and "version torch" in recorded
    # the same size, other content: one row's answer edited in place, one weight nudged, another torch recorded
    data.write_text(data.read_text().replace(rows[0]["completion"], rows[0]["completion"][::-1], 1))
    weights = load_file(str(model / "model.safetensors"))
    name = sorted(weights)[0]
    weights[name] = weights[name] + 0.01
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    recorded["version torch"] = "1.0.0"
    (out / "fingerprints.json").write_text(json.dumps(recorded))
    before = (out / "metrics.jsonl").read_text()

    assert main([*args, "--resume", str(out / "checkpoints" / "step-2")]) == 2
    err = capsys.readouterr().err
    assert "what the run reads changed since it started" in err and "--allow_config_change" in err
    for changed in ("train_file: ", "model/model.safetensors: ", "version torch: 1.0.0 -> "):
        assert changed in err
    assert "model/config.json" not in err  # what did not change is not listed
    assert (out / "metrics.jsonl").read_text() == before  # refused before touching anything

    train([*args, "--resume", str(out / "checkpoints" / "step-2"), "--allow_config_change", "true"])
    resume = json.loads((out / "summary.json").read_text())["resumes"][-1]
    assert resume["config_changes"] == {}
    assert set(resume["input_changes"]) == {"train_file", "model/model.safetensors", "version torch"}
    assert resume["input_changes"]["version torch"]["was"] == "1.0.0"
    assert json.loads((out / "fingerprints.json").read_text())["version torch"] != "1.0.0"  # the new ones recorded


def test_a_changed_reward_function_file_and_a_hub_id_are_fingerprinted(tmp_path):
    source = tmp_path / "rewards.py"
    source.write_text("def short(prompts, completions, **kw):\n    return [-len(c) for c in completions]\n")
    cfg = GRPOConfig(reward_fn=f"{source}:short", reward_model="org/some-reward-model", verifier="checker")
    was = fingerprints(cfg)
    assert was["reward_model"] == "hub id org/some-reward-model"  # not a local path: its id, nothing downloaded
    assert not any(k.startswith("verifier") for k in was)  # the built-in checker is rlhflab's own (its version)
    source.write_text(source.read_text().replace("-len(c)", "len(c)"))
    changes = fingerprint_changes(was, fingerprints(cfg))
    assert list(changes) == [f"reward_fn {source}:short"]
    assert changes[f"reward_fn {source}:short"]["now"].startswith(f"{source}: ")
