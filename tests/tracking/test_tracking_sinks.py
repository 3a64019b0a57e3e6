"""report_to backends: each gets the scalars metrics.jsonl gets, and is imported only when chosen."""

import builtins
import json
import math
import sys
import types

import pytest

from rlhflab.errors import UserInputError
from rlhflab.tracking import RunDir, sink_names

BACKEND_MODULES = ("wandb", "trackio", "tensorboard", "torch.utils.tensorboard")
ROWS = [({"loss/sft": 2.5, "tokens": 7, "flag": True, "note": "text"}, 1),
        ({"loss/sft": 1.25, "val/pass_rate": float("nan")}, 2)]


class Recorder:
    """Stands in for a backend: remembers every (scalars, step) it was given."""

    def __init__(self):
        self.logged: list[tuple[dict, int]] = []
        self.finished = False
        self.init_kwargs: dict = {}


def fake_wandb(rec: Recorder) -> types.ModuleType:
    module = types.ModuleType("wandb")

    class Run:
        def log(self, metrics, step):
            rec.logged.append((dict(metrics), step))

        def finish(self):
            rec.finished = True

    def init(**kwargs):
        rec.init_kwargs = kwargs
        return Run()

    module.init = init
    return module


def fake_trackio(rec: Recorder) -> types.ModuleType:
    module = types.ModuleType("trackio")

    class Run:  # trackio.init returns the run; the sink logs to it, not to trackio's "current run"
        def log(self, metrics, step):
            rec.logged.append((dict(metrics), step))

        def finish(self):
            rec.finished = True

    def init(**kwargs):
        rec.init_kwargs = kwargs
        return Run()

    module.init = init
    return module


def fake_tensorboard(rec: Recorder) -> types.ModuleType:
    module = types.ModuleType("torch.utils.tensorboard")

    class SummaryWriter:
        def __init__(self, log_dir):
            rec.init_kwargs = {"log_dir": log_dir}
            self.rows: dict[int, dict] = {}

        def add_scalar(self, key, value, step):
            if not rec.logged or rec.logged[-1][1] != step:
                rec.logged.append(({}, step))
            rec.logged[-1][0][key] = value

        def close(self):
            rec.finished = True

    module.SummaryWriter = SummaryWriter
    return module


FAKES = {"wandb": fake_wandb, "trackio": fake_trackio, "tensorboard": fake_tensorboard}


def install(monkeypatch, name: str) -> Recorder:
    rec = Recorder()
    module = FAKES[name](rec)
    if name == "tensorboard":
        monkeypatch.setitem(sys.modules, "tensorboard", types.ModuleType("tensorboard"))
        monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    else:
        monkeypatch.setitem(sys.modules, name, module)
    return rec


def jsonl_scalars(path) -> list[tuple[dict, int]]:
    """metrics.jsonl rows as (numeric values, step); "nan" strings back to floats."""
    out = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        step = row.pop("step")
        values = {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) or v in ("nan", "inf", "-inf")}
        out.append((values, step))
    return out


def same(a: list[tuple[dict, int]], b: list[tuple[dict, int]]) -> bool:
    canon = lambda rows: [({k: "nan" if math.isnan(v) else v for k, v in d.items()}, s) for d, s in rows]  # noqa: E731
    return canon(a) == canon(b)


@pytest.mark.parametrize("name", sorted(FAKES))
def test_chosen_backend_receives_the_scalars_of_metrics_jsonl(tmp_path, monkeypatch, name):
    rec = install(monkeypatch, name)
    run = RunDir(tmp_path / "run", report_to=f"none, {name}")
    for metrics, step in ROWS:
        run.log(metrics, step=step)
    run.close()
    expected = jsonl_scalars(tmp_path / "run" / "metrics.jsonl")
    assert expected[0][0] == {"loss/sft": 2.5, "tokens": 7.0, "flag": 1.0}
    assert math.isnan(expected[1][0]["val/pass_rate"])
    assert same(rec.logged, expected) and rec.finished


def test_every_chosen_backend_gets_the_rows_and_run_names_follow_the_folder(tmp_path, monkeypatch):
    recs = {name: install(monkeypatch, name) for name in ("wandb", "trackio")}
    run = RunDir(tmp_path / "ppo-a", report_to="wandb,trackio,wandb")  # a repeated name opens one sink
    run.log({"objective/kl": 0.5}, step=3)
    run.close()
    for rec in recs.values():
        assert rec.logged == [({"objective/kl": 0.5}, 3)]
    assert recs["wandb"].init_kwargs["name"] == "ppo-a" and recs["trackio"].init_kwargs["name"] == "ppo-a"


def test_nothing_is_imported_when_no_backend_is_chosen(tmp_path, monkeypatch):
    imported = []
    real_import = builtins.__import__

    def spy(name, *args, **kwargs):
        if name.split(".")[0] in ("wandb", "trackio", "tensorboard") or name == "torch.utils.tensorboard":
            imported.append(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", spy)
    for report_to in ("none", "", " none "):
        run = RunDir(tmp_path / f"run{len(report_to)}", report_to=report_to)
        run.log({"loss/sft": 1.0}, step=1)
        run.close()
    assert imported == []
    assert not any(m in sys.modules for m in ("wandb", "trackio"))


def test_missing_package_is_a_clear_error_with_the_pip_command_and_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "trackio", raising=False)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(UserInputError, match=r"pip install trackio"):
        RunDir(tmp_path / "run", report_to="trackio")
    assert not (tmp_path / "run").exists()


def test_unknown_backend_suggests_the_closest():
    with pytest.raises(UserInputError, match="did you mean 'tensorboard'"):
        sink_names("none,tensorbord")
    assert sink_names("none") == [] and sink_names("") == []


def test_json_files_stay_strict_json_when_a_value_is_not_finite(tmp_path):
    run = RunDir(tmp_path / "run")
    summary = run.update_summary(rm_diagnosis={"point_biserial": math.nan, "answers": 3}, best=[math.inf, 1.0])
    assert math.isnan(summary["rm_diagnosis"]["point_biserial"])  # the caller keeps its float
    text = (run.path / "summary.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    loaded = json.loads(text, parse_constant=lambda name: pytest.fail(f"bare {name} in summary.json"))
    assert loaded["rm_diagnosis"] == {"point_biserial": "nan", "answers": 3} and loaded["best"] == ["inf", 1.0]
