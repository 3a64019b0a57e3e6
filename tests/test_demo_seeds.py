"""benchmarks/demo_seeds.py: its statistics by hand, and the whole script on demo folders written here
(running real demos takes minutes; `--smoke` is the script's tiny form for a person to try)."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "demo_seeds.py"


def load_script():
    spec = importlib.util.spec_from_file_location("demo_seeds", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["demo_seeds"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_mean_sd_and_t_interval_by_hand():
    s = load_script().spread([30.0, 40.0, 50.0])
    assert (s.mean, s.sd, s.n) == (40.0, 10.0, 3)
    half = 4.303 * 10.0 / math.sqrt(3)  # t(0.975, 2 df)
    assert s.low == pytest.approx(40.0 - half) and s.high == pytest.approx(40.0 + half)
    assert s.excludes_zero()
    assert not load_script().spread([-5.0, 10.0, 20.0]).excludes_zero()
    one = load_script().spread([7.0, math.nan])  # a missing value is left out, one value has no interval
    assert one.n == 1 and one.sd == 0.0 and math.isnan(one.low)


def fake_demo(folder: Path, seed: int) -> None:
    """The files demo_seeds reads from one demo run."""
    for stage, values in (("ppo", [0.1, 0.3, 0.5]), ("ppo_rm", [0.0, 0.2, 0.2])):
        (folder / stage).mkdir(parents=True)
        rows = [{"step": i, "val/explained_variance": v} for i, v in enumerate(values)] + [{"step": 9, "x": 1}]
        (folder / stage / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    summary = {"stage": "demo", "test_pass_rate": {"sft": 0.40, "ppo": 0.75 + 0.01 * seed, "ppo_rm": 0.70},
               "rm": {"test_accuracy": 0.95, "pass_fail_correlation": 0.80 + 0.01 * seed, "roc_auc": 0.97},
               "wall_time_s": {"sft": 100.0, "total": 250.0 + seed}, "cpu_time_s": {"sft": 150.0, "total": 380.0},
               "load_average_1min": {"start": 1.0, "end": 2.0}, "matmul_gflops": {"start": 50.0 + seed, "end": 48.0}}
    (folder / "summary.json").write_text(json.dumps(summary))


def test_the_script_reads_every_seed_and_replaces_its_section(tmp_path):
    script = load_script()
    for seed in (0, 1, 2):
        fake_demo(tmp_path / "runs" / f"seed-{seed}", seed)
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\nearlier text\n")
    args = ["--seeds", "0,1,2", "--out", str(tmp_path / "runs"), "--reuse", "--write", "--results", str(results)]
    script.main(args)
    rows = json.loads((tmp_path / "runs" / "headline.json").read_text())
    assert rows["1"]["gain/ppo"] == pytest.approx(36.0) and rows["2"]["gain/ppo_rm"] == pytest.approx(30.0)
    assert rows["0"]["explained_variance/ppo"] == pytest.approx(0.3)  # the mean of the run's last updates
    assert rows["0"]["clock/total"] == 250.0 and rows["0"]["cpu/total"] == 380.0 and rows["0"]["load/end"] == 2.0
    assert rows["2"]["gflops/start"] == 52.0
    text = results.read_text()
    assert text.startswith("# Results\n\nearlier text\n") and text.count(script.BEGIN) == 1
    gain = next(line for line in text.splitlines() if line.startswith("| `gain/ppo` "))
    assert "| +35.0 | +36.0 | +37.0 | +36.0 | 1.0 | +33.5 to +38.5 (excludes 0) |" in gain and "(excludes 0)" in gain
    speed = next(line for line in text.splitlines() if line.startswith("| `gflops/start` "))
    assert "| 50.0 | 51.0 | 52.0 | 51.0 |" in speed
    script.main(args)  # a second run replaces the section, keeps the rest
    assert results.read_text() == text
