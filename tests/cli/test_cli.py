"""The CLI end to end on a tiny budget, as a user runs it."""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhflab.cli import main

TINY_DEMO = [
    "--max_steps", "4", "--batch_size", "8", "--eval_every", "0", "--sft_examples", "64",
    "--num_train_prompts", "22", "--num_validation_prompts", "11", "--num_test_prompts", "11",
    "--hidden_size", "32", "--num_layers", "1", "--intermediate_size", "64", "--max_new_tokens", "8",
    "--progress", "false", "--threads", "1", "--rm_pair_prompts", "44", "--rm_epochs", "2",
]


def rlhflab(*args, cwd=None):
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.run([sys.executable, "-m", "rlhflab.cli", *args], capture_output=True, text=True, env=env, cwd=cwd)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "run"
    ppo_yaml = out.parent / "ppo_tiny.yaml"
    ppo_yaml.write_text("batch_size: 8\nnum_mini_batches: 2\nresponse_length: 8\neval_prompts: 4\n")
    # --threads 0 (all cores, the default) on a CPU: with >= 2 cores the checker's PPO runs beside the RM's stages
    proc = rlhflab("demo", "--out", str(out), *TINY_DEMO, "--ppo_total_episodes", "16", "--ppo_config", str(ppo_yaml),
                   "--threads", "0", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    return out, proc


def test_demo_prints_the_pass_rate_table_and_writes_a_full_run_folder(demo_run):
    out, proc = demo_run
    assert "test pass rate (greedy)" in proc.stdout and "overall" in proc.stdout and "ppo_rm" in proc.stdout
    assert "RM score" in proc.stdout and "correlation with pass/fail" in proc.stdout
    for name in ("config.yaml", "metrics.jsonl", "samples.jsonl", "versions.json", "summary.json"):
        assert (out / name).is_file(), name
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["test_pass_rate"]) == {"sft", "ppo", "ppo_rm"} and set(summary["kl_to_reference"]) == {"ppo", "ppo_rm"}
    assert set(summary["test_rm_score"]) == {"sft", "ppo", "ppo_rm"}
    assert {"test_accuracy", "margin", "pass_fail_correlation"} <= set(summary["rm"])
    for name in ("ppo", "ppo_rm"):  # each RL model's gain over SFT, paired over the 11 test prompts, is printed
        versus = summary["test_vs_sft"][name]
        assert versus["n"] == 11 and versus["low"] <= versus["difference"] <= versus["high"]
        assert f"{name} vs sft: {100 * versus['difference']:+.1f} pts [" in proc.stdout
    assert summary["test_tables"]["sft"]["intervals"]["overall"]["n"] == 11
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 33 and {"stage", "prompt", "answer", "passed", "reason"} <= set(samples[0])
    for stage in ("sft", "ppo", "ppo_rm"):
        passed = [s["passed"] for s in samples if s["stage"] == stage]
        assert sum(passed) / 11 == pytest.approx(summary["test_pass_rate"][stage])
    for stage in ("ppo", "ppo_rm"):
        rows = [json.loads(line) for line in (out / stage / "metrics.jsonl").read_text().splitlines()]
        assert any("objective/kl" in r for r in rows) and any("val/pass_rate" in r for r in rows)
    ppo_rm = json.loads((out / "ppo_rm" / "summary.json").read_text())
    assert ppo_rm["reward"] == "model" and ppo_rm["reward_normalisation"]["calibration_answers"] == 22
    assert (out / "rm" / "model" / "model.safetensors").is_file() and (out / "rm_diagnosis" / "worst_cases.md").is_file()
    for line in (out / "sft" / "metrics.jsonl").read_text().splitlines():
        assert "step" in json.loads(line)
    versions = json.loads((out / "versions.json").read_text())
    assert {"python", "torch", "transformers", "peft", "rlhflab", "platform", "cpu"} <= set(versions)
    # saving a model imports deepspeed (through accelerate); its CPU accelerator warning is not DeepSpeed in use
    for log in (proc.stdout, proc.stderr, *(p.read_text() for p in out.glob("*.log"))):
        assert "Setting accelerator to CPU" not in log


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="stages run side by side only on >= 2 cores")
def test_the_checker_ppo_ran_beside_as_configured_and_gives_the_same_model_as_here(demo_run, tmp_path):
    from safetensors.torch import load_file

    from rlhflab.config import PPOConfig, read_yaml_config
    from rlhflab.trainers import ppo

    out, proc = demo_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["side_by_side"]["ppo"] > 0 and summary["cpu_time_s"]["ppo"] > 0  # the child's CPU is counted
    assert f"ppo {summary['side_by_side']['ppo']:.0f} s beside rm_diagnosis and ppo_rm (" in proc.stdout  # own seconds
    assert "val/pass_rate" in (out / "ppo" / "metrics.jsonl").read_text() and (out / "ppo.log").is_file()
    fields = read_yaml_config(str(out / "ppo.yaml"), PPOConfig)
    assert fields["threads"] == 1 and fields["value_mode"] == "separate" and fields["output_dir"] == str(out / "ppo")
    threads = torch.get_num_threads()
    try:
        again = ppo.train(PPOConfig(**{**fields, "output_dir": str(tmp_path / "ppo")}))
    finally:
        torch.set_num_threads(threads)  # the stage set one thread for this process
    theirs, ours = load_file(out / "ppo" / "model" / "model.safetensors"), load_file(again.model_dir / "model.safetensors")
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="SFT and the RM train in 2 processes only on >= 2 cores")
def test_sft_and_the_reward_model_trained_in_two_ddp_processes(demo_run):
    out, proc = demo_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stage_processes"] == 2 and "trained in 2 processes" in proc.stdout
    assert (out / "sft.log").is_file() and not (out / "rm.log").exists()  # one launch for both (rlhflab chain)
    for stage in ("sft", "rm"):
        ran = json.loads((out / stage / "summary.json").read_text())["parallel"]
        assert (ran["strategy"], ran["world_size"]) == ("ddp", 2), stage
        ran_with = yaml.safe_load((out / f"{stage}.yaml").read_text())
        assert ran_with["threads"] == 1 and ran_with["write_report"] is False
        assert not (out / stage / "report.html").exists()  # as in one process: the demo's report covers it
        assert summary["cpu_time_s"][stage] > summary["wall_time_s"][stage] * 0.5  # the children's CPU is counted


def test_demo_with_one_thread_runs_the_checker_ppo_in_this_process(tmp_path):
    out, ppo_yaml = tmp_path / "run", tmp_path / "ppo.yaml"
    ppo_yaml.write_text("batch_size: 8\nresponse_length: 8\neval_prompts: 4\n")
    proc = rlhflab("demo", "--out", str(out), *TINY_DEMO, "--ppo_total_episodes", "16", "--run_rm", "false",
                   "--ppo_config", str(ppo_yaml))  # TINY_DEMO: --threads 1
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["test_pass_rate"]) == {"sft", "ppo"} and summary["side_by_side"] == {}
    assert f"ppo {summary['wall_time_s']['ppo']:.0f} s; CPU" in proc.stdout  # ran here: its part of the split
    assert "Setting accelerator to CPU" not in proc.stdout + proc.stderr  # SFT and PPO saved models in this process
    assert not (out / "ppo.log").exists() and (out / "ppo" / "model" / "model.safetensors").is_file()
    assert summary["stage_processes"] == 1 and not (out / "sft.log").exists()  # one thread asked: SFT ran here


def test_demo_model_folder_loads_with_plain_transformers(demo_run):
    out, _ = demo_run
    model_dir = out / "sft" / "model"
    assert (model_dir / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert model.config.hidden_size == 32 and tokenizer.eos_token_id is not None


def test_effective_config_round_trips_through_config_flag(demo_run, tmp_path):
    out, _ = demo_run
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["max_steps"] == 4 and config["hidden_size"] == 32
    from rlhflab.config import DemoConfig, parse_config

    again = parse_config(DemoConfig, ["--config", str(out / "config.yaml")], prog="rlhflab demo")
    assert again.max_steps == 4 and again.output_dir == str(out)


def test_eval_command_on_the_demo_model(demo_run, tmp_path, capsys):
    out, _ = demo_run
    code = main(["eval", "--model", str(out / "sft" / "model"), "--split", "validation",
                 "--num_train_prompts", "22", "--num_validation_prompts", "11", "--num_test_prompts", "11",
                 "--max_new_tokens", "8", "--out", str(tmp_path / "ev"), "--progress", "false"])
    assert code == 0
    assert "validation pass rate" in capsys.readouterr().out
    summary = json.loads((tmp_path / "ev" / "summary.json").read_text())
    assert summary["split"] == "validation" and sum(summary["pass_rate"]["counts"].values()) == 11
    assert (tmp_path / "ev" / "report.html").is_file()


def test_refuses_to_overwrite_a_run_folder(demo_run, capsys):
    out, _ = demo_run
    assert main(["demo", "--out", str(out), *TINY_DEMO]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--overwrite" in err


def test_unknown_key_is_an_error_with_a_suggestion(tmp_path, capsys):
    assert main(["sft", "--max_step", "3"]) == 2
    assert "did you mean 'max_steps'" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("learning_rat: 0.1\n")
    assert main(["sft", "--config", str(bad)]) == 2
    assert "did you mean 'learning_rate'" in capsys.readouterr().err


@pytest.mark.parametrize("flags, named", [(["--ppo_total_episodes", "16"], "--ppo_total_episodes"),
                                          (["--rm_diagnosis_samples", "0"], "--rm_diagnosis_samples"),
                                          (["--stage_processes", "-1"], "--stage_processes"),
                                          (["--rm_frozen_layers", "6"], "--rm_frozen_layers"),
                                          (["--rm_extra_layers", "-1"], "--rm_extra_layers"),
                                          (["--rm_prompt_rows_together", "-1"], "--rm_prompt_rows_together")])
def test_a_bad_later_stage_value_is_refused_before_sft_naming_the_demo_flag(tmp_path, capsys, flags, named):
    out = tmp_path / "run"
    assert main(["demo", "--out", str(out), *flags]) == 2
    assert named in capsys.readouterr().err
    assert not out.exists()  # nothing trained, nothing written


def test_a_given_model_whose_trunk_cannot_grow_is_refused_before_sft(tmp_path, capsys, opt_model_dir):
    # the demo's reward model grows two layers by default; an OPT model has none of the layouts that can
    out = tmp_path / "run"
    assert main(["demo", "--out", str(out), "--model", opt_model_dir]) == 2
    err = capsys.readouterr().err
    assert "--rm_extra_layers" in err and "configs/rm_shallow.yaml" in err and opt_model_dir in err
    assert not out.exists()


def test_a_given_model_without_a_config_is_refused_before_sft_naming_it(tmp_path, capsys):
    out, missing = tmp_path / "run", str(tmp_path / "no-such-model")
    assert main(["demo", "--out", str(out), "--model", missing]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and missing in err
    assert not out.exists()


@pytest.fixture
def opt_model_dir(tmp_path):
    """An OPT model with the suite's tokenizer, saved as an HF folder."""
    from transformers import OPTConfig, OPTForCausalLM

    from rlhflab import models, tasks

    tokenizer = models.build_tokenizer(tasks.template_corpus(), vocab_size=256)
    opt = OPTForCausalLM(OPTConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                                   num_attention_heads=2, word_embed_proj_dim=16))
    models.save_model_folder(tmp_path / "opt", opt, tokenizer)
    return str(tmp_path / "opt")


def test_unknown_stage_suggests_the_closest(capsys):
    assert main(["demoo"]) == 2
    assert "did you mean 'demo'" in capsys.readouterr().err


def test_version_is_the_installed_one_and_the_package_s_own(monkeypatch, capsys):
    import importlib.metadata

    from rlhflab import __version__

    proc = rlhflab("--version")
    assert proc.returncode == 0 and proc.stdout == f"rlhflab {importlib.metadata.version('rlhflab')}\n"
    assert proc.stdout == f"rlhflab {__version__}\n"  # pyproject.toml and __init__ agree

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)  # a source tree on PYTHONPATH
    assert main(["-V"]) == 0 and capsys.readouterr().out == f"rlhflab {__version__}\n"


def test_stage_help_lists_fields_with_defaults():
    proc = rlhflab("sft", "--help")
    assert proc.returncode == 0
    assert "--learning_rate" in proc.stdout and "(default: 0.002)" in proc.stdout


def test_tasks_export_writes_trl_columns(tmp_path, capsys):
    assert main(["tasks", "export", "--out", str(tmp_path / "suite"), "--sft_examples", "50",
                 "--pair_kinds", "wrong_case,fenced_json"]) == 0
    pairs = [json.loads(l) for l in (tmp_path / "suite" / "train" / "pairs.jsonl").read_text().splitlines()]
    assert pairs and {p["violation"] for p in pairs} <= {"wrong_case", "fenced_json"}
    assert {"prompt", "chosen", "rejected", "family", "violation"} <= set(pairs[0])
    sft = (tmp_path / "suite" / "train" / "sft.jsonl").read_text().splitlines()
    assert len(sft) == 50 and {"prompt", "completion"} <= set(json.loads(sft[0]))
    prompts = json.loads((tmp_path / "suite" / "test" / "prompts.jsonl").read_text().splitlines()[0])
    assert {"prompt", "family"} <= set(prompts)


def test_tasks_export_rejects_unknown_violation_kind(tmp_path, capsys):
    assert main(["tasks", "export", "--out", str(tmp_path / "s"), "--pair_kinds", "wrong_cse"]) == 2
    assert "did you mean 'wrong_case'" in capsys.readouterr().err


def test_sft_reports_bad_rows_with_line_numbers_in_strict_mode(tmp_path, capsys):
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"prompt": "a\\n", "completion": "b"}\n{"prompt": "x"\n{"prompt": "", "completion": "c"}\n')
    code = main(["sft", "--train_file", str(bad), "--strict", "--out", str(tmp_path / "r"), *TINY_DEMO[:4]])
    assert code == 2
    err = capsys.readouterr().err
    assert "train.jsonl:2" in err and "train.jsonl:3" in err


def test_bad_data_leaves_no_run_folder_behind(tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"prompt": "", "completion": "c"}\n')
    assert main(["sft", "--train_file", str(bad), "--out", str(tmp_path / "r"), *TINY_DEMO[:4]]) == 2
    assert not (tmp_path / "r").exists()


def test_ppo_command_on_the_demo_model(demo_run, tmp_path, capsys):
    out, _ = demo_run
    code = main(["ppo", "--model", str(out / "sft" / "model"), "--out", str(tmp_path / "ppo"), "--batch_size", "8",
                 "--total_episodes", "16", "--response_length", "6", "--eval_prompts", "4",
                 "--num_train_prompts", "22", "--num_validation_prompts", "11", "--num_test_prompts", "11",
                 "--lora_r", "4", "--value_mode", "lora_adapter", "--progress", "false", "--threads", "1"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "validation pass rate" in printed and "episodes/s" in printed
    for name in ("model/model.safetensors", "adapter/adapter_config.json", "value/value_head.safetensors",
                 "config.yaml", "summary.json", "samples.jsonl"):
        assert (tmp_path / "ppo" / name).is_file(), name
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "ppo" / "model").config.hidden_size == 32


def test_ppo_refuses_impossible_settings(tmp_path, capsys):
    assert main(["ppo", "--model", str(tmp_path), "--value_mode", "lora_adapter"]) == 2
    assert "--lora_r" in capsys.readouterr().err
    assert main(["ppo", "--model", str(tmp_path), "--batch_size", "10", "--num_mini_batches", "3"]) == 2
    assert "divisible" in capsys.readouterr().err


def test_rm_command_on_the_demo_model(demo_run, tmp_path, capsys):
    out, _ = demo_run
    code = main(["rm", "--model", str(out / "sft" / "model"), "--out", str(tmp_path / "rm"),
                 "--num_train_prompts", "22", "--num_validation_prompts", "11", "--num_test_prompts", "11",
                 "--batch_size", "8", "--progress", "false", "--threads", "1"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "test: pairwise accuracy" in printed
    summary = json.loads((tmp_path / "rm" / "summary.json").read_text())
    assert {"train", "validation", "test"} == set(summary["pairs"])
    assert (tmp_path / "rm" / "model" / "model.safetensors").is_file()


def test_rm_diagnose_command(demo_run, tmp_path, capsys):
    out, _ = demo_run
    assert main(["rm", "--model", str(out / "sft" / "model"), "--out", str(tmp_path / "rm"), "--num_train_prompts", "22",
                 "--num_validation_prompts", "11", "--num_test_prompts", "11", "--progress", "false"]) == 0
    code = main(["rm", "diagnose", "--reward-model", str(tmp_path / "rm" / "model"), "--policy",
                 str(out / "sft" / "model"), "--out", str(tmp_path / "diag"), "--num_train_prompts", "22",
                 "--num_validation_prompts", "11", "--num_test_prompts", "11", "--max_new_tokens", "8",
                 "--progress", "false"])
    assert code == 0
    assert "point-biserial" in capsys.readouterr().out
    summary = json.loads((tmp_path / "diag" / "summary.json").read_text())
    assert summary["rm_diagnosis"]["answers"] == 22
    assert (tmp_path / "diag" / "worst_cases.md").is_file() and (tmp_path / "diag" / "report.html").is_file()


def test_chain_runs_stages_in_turn_the_later_reading_what_the_earlier_saved(demo_run, tmp_path, capsys):
    out, _ = demo_run
    tiny = ["--num_train_prompts", "22", "--num_validation_prompts", "11", "--num_test_prompts", "11",
            "--progress", "false"]
    code = main(["chain", "rm", "--model", str(out / "sft" / "model"), "--out", str(tmp_path / "rm"), *tiny,
                 "then", "rm", "diagnose", "--reward-model", str(tmp_path / "rm" / "model"), "--policy",
                 str(out / "sft" / "model"), "--out", str(tmp_path / "diag"), "--max_new_tokens", "8", *tiny])
    assert code == 0
    printed = capsys.readouterr().out
    assert "test: pairwise accuracy" in printed and "point-biserial" in printed  # each stage's own printout
    assert json.loads((tmp_path / "diag" / "summary.json").read_text())["rm_diagnosis"]["answers"] == 22


@pytest.mark.parametrize("argv, named", [(["sft", "--max_steps", "1", "then", "rm", "--num_epoch", "2"],
                                          "did you mean 'num_epochs'"),
                                         (["sft", "then"], "an empty stage"),
                                         (["sft", "then", "demo"], "rlhflab demo cannot run in a chain")])
def test_chain_refuses_a_bad_stage_before_the_first_runs(tmp_path, capsys, argv, named):
    out = tmp_path / "sft"
    assert main(["chain", *argv[:1], "--out", str(out), *argv[1:]]) == 2
    assert named in capsys.readouterr().err
    assert not out.exists()  # the first stage never started


def test_demo_refuses_a_bad_later_stage_config_before_training(tmp_path, capsys):
    bad = tmp_path / "ppo.yaml"
    bad.write_text("stop_on_alarms: reward_hackin\n")
    out = tmp_path / "run"
    assert main(["demo", "--out", str(out), *TINY_DEMO, "--ppo_config", str(bad)]) == 2
    assert "reward_hackin" in capsys.readouterr().err
    assert not (out / "sft").exists()  # nothing trained
    rm_bad = tmp_path / "rm.yaml"
    rm_bad.write_text("num_epoch: 2\n")
    assert main(["demo", "--out", str(tmp_path / "run2"), *TINY_DEMO, "--rm_config", str(rm_bad)]) == 2
    assert "did you mean 'num_epochs'" in capsys.readouterr().err


def test_a_stage_without_multi_process_support_is_refused_under_a_launch(monkeypatch, capsys):
    """Under torchrun with 2 processes, `rlhflab eval` (one process only) would run twice into one folder."""
    from rlhflab import cli

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert cli.main(["eval", "--model", "nowhere"]) == 2
    err = capsys.readouterr().err
    assert "rlhflab eval runs in one process, but this launch started 2 (WORLD_SIZE=2)" in err
    assert "sft" in err and "dpo" in err  # the stages that do run multi-process are named


def test_write_report_false_leaves_the_report_out(demo_run, tmp_path, capsys):
    out, _ = demo_run
    code = main(["eval", "--model", str(out / "sft" / "model"), "--split", "validation", "--num_train_prompts", "22",
                 "--num_validation_prompts", "11", "--num_test_prompts", "11", "--max_new_tokens", "8",
                 "--out", str(tmp_path / "ev"), "--progress", "false", "--write_report", "false"])
    assert code == 0 and "report:" not in capsys.readouterr().out
    assert (tmp_path / "ev" / "summary.json").is_file() and not (tmp_path / "ev" / "report.html").exists()
