"""write_comparison: the overview numbers, overlaid curves and exactly the differing config keys."""

import re

import pytest

from rlhflab.errors import UserInputError
from rlhflab.report import write_comparison
from rlhflab.report.compare import config_differences

BASE = {"seed": 0, "learning_rate": 0.001, "batch_size": 64, "model": "", "schedule": {"warmup": 10, "kind": "cosine"}}


def diff_keys(text: str) -> list[str]:
    table = re.search(r'<table id="config-diff">(.*?)</table>', text, re.S)
    assert table, "no config-diff table"
    return re.findall(r'<th scope="row">([^<]*)</th>', table.group(1))


@pytest.fixture
def three_runs(tmp_path, make_run, metrics_rows):
    a = make_run(tmp_path / "a", config=BASE, metrics=metrics_rows(),
                 summary={"stage": "ppo", "validation_pass_rate": {"start": 0.4, "end": 0.55},
                          "final": {"objective/kl": 1.25}, "wall_time_s": {"ppo": 30.0}})
    b = make_run(tmp_path / "b", config={**BASE, "learning_rate": 0.002, "schedule": {"warmup": 20, "kind": "cosine"}},
                 metrics=metrics_rows(kl=lambda i: 0.2 * i),
                 summary={"stage": "ppo", "validation_pass_rate": {"start": 0.4, "end": 0.61},
                          "alarms": [{"name": "kl_spike", "step": 3, "reason": "r"}], "wall_time_s": {"ppo": 31.5}})
    c = make_run(tmp_path / "c", config={**BASE, "seed": 1, "extra": True}, metrics=metrics_rows(),
                 summary={"stage": "ppo"})
    return a, b, c


def test_comparison_lists_exactly_the_differing_config_keys(three_runs, tmp_path, checked):
    out = write_comparison(list(three_runs), tmp_path / "cmp.html")
    checked(out)
    keys = diff_keys(out.read_text())
    assert sorted(keys) == ["extra", "learning_rate", "schedule.warmup", "seed"]
    assert "batch_size" not in keys and "schedule.kind" not in keys


def test_config_differences_counts_a_missing_key_and_ignores_equal_ones():
    assert config_differences([{"x": 1, "y": [1, 2]}, {"x": 1, "y": [1, 2]}]) == []
    assert config_differences([{"x": 1}, {"x": 1.5}, {"x": 1}]) == ["x"]
    assert config_differences([{"x": 1}, {"x": 1, "z": None}]) == ["z"]


def test_identical_configs_say_so(tmp_path, make_run, checked):
    runs = [make_run(tmp_path / n, config=BASE, summary={"stage": "sft"}) for n in ("x", "y")]
    text = write_comparison(runs, tmp_path / "same.html").read_text()
    assert "The configs are identical." in text and 'id="config-diff"' not in text


def test_overview_table_has_final_pass_rate_kl_alarms_and_wall_time(three_runs, tmp_path, section_of):
    text = write_comparison(list(three_runs), tmp_path / "cmp.html").read_text()
    rows = {m[0]: m[1] for m in re.findall(r'<tr><th scope="row">(\w)</th>(.*?)</tr>', section_of(text, "Runs"))}
    cells = {name: re.findall(r"<td[^>]*>([^<]*)</td>", row) for name, row in rows.items()}
    assert cells["a"][1:5] == ["55.0% (held-out validation pass rate)", "1.25", "0", "30"]
    assert cells["b"][1:5] == ["61.0% (held-out validation pass rate)", "1.2", "1", "31.5"]  # KL: last metric row
    assert cells["c"][4] == "—"  # no wall time recorded


def test_curves_are_overlaid_one_panel_per_metric(three_runs, tmp_path, checked, section_of):
    out = write_comparison(list(three_runs), tmp_path / "cmp.html")
    curves = section_of(out.read_text(), "Curves, one line per run")
    alts = re.findall(r'<img src="data:image/png;base64,[^"]+" alt="([^"]+)"', curves)
    assert "KL to the reference (objective/kl)" in alts and len(alts) == len(set(alts))


def test_same_folder_names_are_told_apart(tmp_path, make_run):
    runs = [make_run(tmp_path / p / "run", config={**BASE, "seed": i}, summary={}) for i, p in enumerate(("p", "q"))]
    text = write_comparison(runs, tmp_path / "cmp.html").read_text()
    assert "<th>p/run</th>" in text and "<th>q/run</th>" in text


def test_a_bad_path_is_a_user_error(tmp_path, ppo_run):
    with pytest.raises(UserInputError, match="missing"):
        write_comparison([ppo_run, tmp_path / "missing"], tmp_path / "cmp.html")
    assert not (tmp_path / "cmp.html").exists()
