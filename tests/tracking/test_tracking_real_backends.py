"""report_to with the real backends of the test extra, read back with their own readers:
TensorBoard's EventAccumulator, and trackio's local SQLite store through trackio's API."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

from rlhflab.tracking import RunDir

ROWS = [({"loss/rm": 0.75, "rm/accuracy": 0.5, "skipped": False, "note": "text"}, 1),
        ({"loss/rm": 0.5, "rm/accuracy": 1.0, "grad_norm": float("nan")}, 2),
        ({"loss/rm": 0.25}, 5)]


def test_tensorboard_event_files_hold_each_scalar_at_its_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = RunDir(tmp_path / "run", report_to="tensorboard")
    for metrics, step in ROWS:
        run.log(metrics, step=step)
    run.close()
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["grad_norm", "loss/rm", "rm/accuracy", "skipped"]  # no text
    assert [(e.step, e.value) for e in events.Scalars("loss/rm")] == [(1, 0.75), (2, 0.5), (5, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("rm/accuracy")] == [(1, 0.5), (2, 1.0)]
    assert [(e.step, e.value) for e in events.Scalars("skipped")] == [(1, 0.0)]
    [nan] = events.Scalars("grad_norm")
    assert nan.step == 2 and math.isnan(nan.value)


# trackio reads TRACKIO_DIR once, when it is first imported: a fresh interpreter keeps the store in
# tmp_path whatever this process imported before. Two run folders stay open at once, closed out of order.
TRACKIO_RUN = textwrap.dedent("""
    import json, sys
    from rlhflab.tracking import RunDir
    first = RunDir(sys.argv[1] + "/first", report_to="trackio")
    second = RunDir(sys.argv[1] + "/second", report_to="trackio")
    for metrics, step in json.loads(sys.argv[2]):
        first.log(metrics, step=step)
        second.log({"objective/kl": step / 10}, step=step)
    second.close()
    first.close()
    from trackio.api import Api
    from trackio.sqlite_storage import SQLiteStorage
    logs = {run.name: SQLiteStorage.get_logs("rlhflab-test", run.name, run_id=run.id) for run in Api().runs("rlhflab-test")}
    print("LOGS=" + json.dumps(logs))
""")


def test_trackio_writes_locally_and_reads_back_each_run_folders_scalars(tmp_path):
    if importlib.util.find_spec("trackio") is None:  # not imported here: see TRACKIO_RUN
        pytest.skip("trackio not installed: pip install trackio (or pip install -e '.[test]')")
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "TRACKIO_PROJECT": "rlhflab-test",
           "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run([sys.executable, "-c", TRACKIO_RUN, str(tmp_path), json.dumps(ROWS)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [line for line in done.stdout.splitlines() if line.startswith("LOGS=")]
    logs = json.loads(line.removeprefix("LOGS="))
    assert sorted(logs) == ["first", "second"]
    first = [({k: v for k, v in row.items() if k not in ("step", "timestamp")}, row["step"]) for row in logs["first"]]
    assert first[0] == ({"loss/rm": 0.75, "rm/accuracy": 0.5, "skipped": 0.0}, 1)
    assert first[1][1] == 2 and first[1][0]["loss/rm"] == 0.5 and math.isnan(first[1][0]["grad_norm"])
    assert first[2] == ({"loss/rm": 0.25}, 5)
    assert [(row["step"], row["objective/kl"]) for row in logs["second"]] == [(1, 0.1), (2, 0.2), (5, 0.5)]
    assert any(p.suffix == ".db" for p in (tmp_path / "trackio").iterdir())  # local SQLite, no server
