"""`rlhflab report`, the report written at the end of each training command, and no torch import."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlhflab.cli import main, runs_as_flag
from rlhflab.tracking import RunResult


def test_report_command_writes_report_html_and_prints_its_path(ppo_run, capsys):
    assert main(["report", str(ppo_run)]) == 0
    assert capsys.readouterr().out.strip() == str(ppo_run / "report.html")
    assert (ppo_run / "report.html").is_file()


def test_several_runs_give_a_comparison_in_the_current_folder(ppo_run, tmp_path, make_run, monkeypatch, capsys):
    other = make_run(tmp_path / "other", config={"seed": 8}, summary={"stage": "ppo"})
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(ppo_run), str(other)]) == 0
    assert (tmp_path / "comparison.html").is_file() and "comparison.html" in capsys.readouterr().out
    assert main(["report", "--out", str(tmp_path / "x" / "c.html"), str(ppo_run), str(other)]) == 0
    assert (tmp_path / "x" / "c.html").is_file() and not (ppo_run / "report.html").exists()


@pytest.mark.parametrize("make_bad", [lambda p: p / "missing", lambda p: p])
def test_missing_or_non_run_folder_exits_2_naming_the_path(tmp_path, make_bad, capsys):
    bad = make_bad(tmp_path)
    assert main(["report", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "config.yaml" in err and "metrics.jsonl" in err


def test_no_folder_exits_2_with_usage(capsys):
    assert main(["report"]) == 2
    assert "rlhflab report RUN_DIR" in capsys.readouterr().err


def test_report_help_works(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["report", "--help"])
    assert exit_info.value.code == 0
    assert "--out" in capsys.readouterr().out


def test_positional_folders_become_the_runs_field():
    assert runs_as_flag(["a", "b", "--out", "f"]) == ["--runs", "a", "b", "--out", "f"]
    assert runs_as_flag(["--out", "f", "a"]) == ["--runs", "a", "--out", "f"]
    assert runs_as_flag(["--runs", "a"]) == ["--runs", "a"]


def _fake_result(run_dir: Path, stage: str) -> RunResult:
    summaries = {
        "sft": {"validation": {"val/pass_rate": 0.5}},
        "ppo": {"validation_pass_rate": {"start": 0.4, "end": 0.5}, "final": {"objective/kl": 0.1, "eps": 9.0}},
        "rm": {"pairs": {"test": {"accuracy": 0.8, "margin": 1.0, "pairs": 10}}},
        "demo": {"test_tables": {"sft": {"overall": 0.5, "per_family": {"f": 0.5}, "counts": {"f": 2}}},
                 "decoding": "greedy", "kl_to_reference": {}, "wall_time_s": {"total": 1.0}},
    }
    (run_dir / "summary.json").write_text("{}")
    return RunResult(run_dir, summaries[stage], run_dir / "model")


@pytest.mark.parametrize(("stage", "module", "attr"), [
    ("sft", "rlhflab.trainers.sft", "train"), ("ppo", "rlhflab.trainers.ppo", "train"),
    ("rm", "rlhflab.trainers.reward", "train"), ("demo", "rlhflab.demo", "run_demo"),
])
def test_training_commands_end_with_their_report(stage, module, attr, tmp_path, monkeypatch, capsys):
    __import__(module)
    run_dir = tmp_path / stage
    run_dir.mkdir()
    monkeypatch.setattr(sys.modules[module], attr, lambda cfg, **kw: _fake_result(run_dir, stage))
    assert main([stage, "--out", str(run_dir)]) == 0
    assert f"report: {run_dir / 'report.html'}" in capsys.readouterr().out
    assert (run_dir / "report.html").is_file()


def test_a_failing_report_does_not_fail_a_finished_run(tmp_path, monkeypatch, caplog, capsys):
    import rlhflab.report
    import rlhflab.trainers.sft

    run_dir = tmp_path / "sft"
    run_dir.mkdir()
    monkeypatch.setattr(rlhflab.trainers.sft, "train", lambda cfg, **kw: _fake_result(run_dir, "sft"))
    monkeypatch.setattr(rlhflab.report, "write_report", lambda path: 1 / 0)
    assert main(["sft", "--out", str(run_dir)]) == 0
    assert "report not written (ZeroDivisionError" in caplog.text and f"rlhflab report {run_dir}" in caplog.text


def test_writing_reports_never_imports_torch(ppo_run, tmp_path, make_run):
    other = make_run(tmp_path / "other", config={"seed": 1}, summary={})
    code = textwrap.dedent(f"""
        import sys
        import rlhflab.report
        from rlhflab.report import write_comparison, write_report
        write_report({str(ppo_run)!r})
        write_comparison([{str(ppo_run)!r}, {str(other)!r}], {str(tmp_path / "c.html")!r})
        assert "torch" not in sys.modules, "rlhflab.report imported torch"
    """)
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert (ppo_run / "report.html").is_file() and (tmp_path / "c.html").is_file()


def test_runs_can_come_from_a_yaml_config(ppo_run, tmp_path, capsys):
    good = tmp_path / "report.yaml"
    good.write_text(f"runs: [{ppo_run}]\nout: {tmp_path / 'r.html'}\n")
    assert main(["report", "--config", str(good)]) == 0
    assert (tmp_path / "r.html").is_file()
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"runs: {ppo_run}\n")
    assert main(["report", "--config", str(bad)]) == 2
    assert "'runs' should be a list of strings" in capsys.readouterr().err
