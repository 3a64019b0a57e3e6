"""`rlhflab sweep`: a real tiny PPO sweep, and every refusal before any run starts."""

import contextlib
import io
import json

import pytest
import yaml

from rlhflab import models, tasks
from rlhflab.cli import main

TINY_PPO = {"batch_size": 8, "num_mini_batches": 2, "num_ppo_epochs": 1, "response_length": 6, "total_episodes": 16,
            "eval_every": 0, "eval_prompts": 4, "sample_prompts": 2, "console_samples": 0, "max_new_tokens": 6,
            "num_train_prompts": 22, "num_validation_prompts": 11, "num_test_prompts": 11, "progress": False,
            "threads": 1, "learning_rate": 1e-3}


@pytest.fixture(scope="module")
def base_yaml(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sweep")
    tokenizer = models.build_tokenizer(tasks.template_corpus(), vocab_size=256)
    model = models.build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64, seed=0)
    models.save_model_folder(folder / "policy", model, tokenizer)
    path = folder / "base.yaml"
    path.write_text(yaml.safe_dump({**TINY_PPO, "model": str(folder / "policy")}))
    return path


@pytest.fixture(scope="module")
def swept(base_yaml, tmp_path_factory):
    out = tmp_path_factory.mktemp("cliprange") / "sweep"
    stdout = io.StringIO()  # capsys is per test; this run is shared by the module's tests
    with contextlib.redirect_stdout(stdout):
        code = main(["sweep", "--stage", "ppo", "--config", str(base_yaml), "--vary", "cliprange=0.1,0.3",
                     "--out", str(out), "--seed", "3"])
    return code, out, stdout.getvalue()


def test_sweep_writes_one_run_per_value_differing_only_in_the_varied_field(swept):
    code, out, _ = swept
    assert code == 0
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["cliprange=0.1", "cliprange=0.3"]
    configs = [yaml.safe_load((out / name / "config.yaml").read_text()) for name in ("cliprange=0.1", "cliprange=0.3")]
    differing = {k for k in configs[0] if configs[0][k] != configs[1][k]}
    assert differing == {"cliprange", "output_dir"}
    assert [c["cliprange"] for c in configs] == [0.1, 0.3] and all(c["seed"] == 3 for c in configs)
    for name in ("cliprange=0.1", "cliprange=0.3"):
        assert (out / name / "summary.json").is_file() and (out / name / "report.html").is_file()


def test_sweep_writes_a_comparison_page_and_prints_the_table(swept):
    _, out, stdout = swept
    page = (out / "comparison.html").read_text()
    assert "cliprange=0.1" in page and "cliprange=0.3" in page and "config-diff" in page
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("cliprange"))
    assert all(h in lines[header] for h in ("saved val pass rate", "final KL", "alarms fired", "wall time (s)"))
    rows = lines[header + 2: header + 4]
    assert [r.split()[0] for r in rows] == ["0.1", "0.3"]
    table = json.loads((out / "sweep.json").read_text())
    assert table["field"] == "cliprange" and [r["value"] for r in table["runs"]] == ["0.1", "0.3"]
    for row, line in zip(table["runs"], rows):
        summary = json.loads((out / f"cliprange={row['value']}" / "summary.json").read_text())
        assert row["held_out"] == summary["validation_pass_rate"]["end"] and f"{row['held_out']:.1%}" in line
        assert row["final_kl"] == summary["final"]["objective/kl"] and row["alarms"] == []


@pytest.mark.parametrize("args, message", [
    (["--vary", "cliprange=0.1,0.2", "--vary", "kl_coef=0.01,0.1"], "one field at a time"),
    (["--vary", "cliprange=0.1,kl_coef=0.2"], "one field at a time"),
    (["--vary", "clip_range=0.1,0.2"], "did you mean 'cliprange'"),
    (["--vary", "cliprange=0.1,0.2,big"], "'big' is not a number"),
    (["--vary", "batch_size=8,16.5"], "'16.5' is not an int"),
    (["--vary", "reward=checker,modle"], "choose from auto, checker, model, combined, random"),
    (["--vary", "whiten_advantages=true,maybe"], "'maybe' is not a boolean"),
    (["--vary", "cliprange=0.2"], "two or more distinct values"),
    (["--vary", "cliprange=0.2,0.20"], "two or more distinct values"),
    (["--vary", "output_dir=a,b"], "output_dir cannot be varied"),
    (["--vary", "cliprange=0.1,0.2", "--cliprange", "0.3"], "both varied and fixed"),
    ([], "nothing to vary"),
    (["--vary", "batch_size=8,7"], "not divisible by num_mini_batches"),  # a run's own check, before any run
    (["--stage", "ppoo", "--vary", "cliprange=0.1,0.2"], "did you mean 'ppo'"),
    (["--vary", "cliprange=0.1,0.2", "--max_stepz", "3"], "unknown option"),
])
def test_refusals_exit_2_with_a_clear_message_and_run_nothing(base_yaml, tmp_path, capsys, args, message):
    out = tmp_path / "sweep"
    assert main(["sweep", "--config", str(base_yaml), "--out", str(out), *args]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_sft_sweep_plan_varies_an_sft_field(tmp_path):
    from rlhflab.sweep import plan_sweep

    plan = plan_sweep(["--stage", "sft", "--vary", "learning_rate=1e-3,3e-3", "--out", str(tmp_path / "s"),
                       "--max_steps", "5"])
    assert [c.learning_rate for c in plan.configs] == [1e-3, 3e-3] and {c.max_steps for c in plan.configs} == {5}
    assert [c.output_dir for c in plan.configs] == [str(tmp_path / "s" / "learning_rate=1e-3"),
                                                     str(tmp_path / "s" / "learning_rate=3e-3")]


def test_a_sweep_refuses_to_overwrite_runs_it_would_replace(base_yaml, tmp_path, capsys):
    held = tmp_path / "sweep" / "cliprange=0.2"
    held.mkdir(parents=True)
    (held / "config.yaml").write_text("seed: 0\n")
    assert main(["sweep", "--config", str(base_yaml), "--out", str(tmp_path / "sweep"),
                 "--vary", "cliprange=0.1,0.2"]) == 2
    assert "already holds a run" in capsys.readouterr().err and not (tmp_path / "sweep" / "cliprange=0.1").exists()
