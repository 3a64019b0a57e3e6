"""Same seed, same numbers: two tiny SFT runs give identical metrics and weights on CPU, and the run folder
records the seed and the settings that decide it (versions.json "determinism")."""

import json
import os

import pytest
import torch
from runcheck import assert_same_weights, metrics, sft_args, train


def determinism(run) -> dict:
    return json.loads((run / "versions.json").read_text())["determinism"]


def test_two_same_seed_sft_runs_give_identical_metrics_and_weights(tmp_path):
    train(sft_args(tmp_path / "a"))
    train(sft_args(tmp_path / "b"))
    rows = metrics(tmp_path / "a")
    assert rows and any("val/loss" in r for r in rows)
    assert rows == metrics(tmp_path / "b")
    assert_same_weights(tmp_path / "a", tmp_path / "b")
    train([*sft_args(tmp_path / "c"), "--seed", "4"])  # and another seed gives other weights (the seed is used)
    with pytest.raises(AssertionError, match="differs"):
        assert_same_weights(tmp_path / "a", tmp_path / "c")
    record = determinism(tmp_path / "a")
    assert record["seed"] == 3 and record["torch_threads"] == 1  # runcheck's --seed 3 --threads 1
    assert record["deterministic_algorithms"] is False
    assert {"omp_wait_policy", "cublas_workspace_config", "deterministic_warn_only"} <= set(record)
    assert ("cudnn" in record) == torch.cuda.is_available()


def test_deterministic_flag_turns_on_deterministic_kernels_and_records_them(tmp_path):
    had_cublas = "CUBLAS_WORKSPACE_CONFIG" in os.environ
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        train(sft_args(tmp_path / "plain"))  # first: the flag stays on for the rest of the process
        train([*sft_args(tmp_path / "det"), "--deterministic", "true"])
        record = determinism(tmp_path / "det")
        assert record["deterministic_algorithms"] is True and record["deterministic_warn_only"] is True
        assert record["cublas_workspace_config"] == os.environ["CUBLAS_WORKSPACE_CONFIG"]
        assert metrics(tmp_path / "det") == metrics(tmp_path / "plain")  # on CPU it changes no number
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        if not had_cublas:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
