"""Shared fixtures. OMP_WAIT_POLICY must be set before torch is imported."""

import os
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


# Test files that start processes (the CLI in a subprocess, torchrun, an async generator, a browser, a venv):
# marked `processes`. `make test` runs the rest on both cores at once (pytest-xdist), then these one at a time,
# so they neither fight another worker for the cores nor race its clock-bound checks.
PROCESS_DIRS = ("parallel", "docs")
PROCESS_FILES = {
    "checkpoint/test_damage.py", "checkpoint/test_ownership.py", "checkpoint/test_resume.py",
    "checkpoint/test_signals.py", "checkpoint/test_write_failures.py", "cli/test_cli.py", "cli/test_light_import.py",
    "report/test_browser.py", "report/test_report_cli.py", "rewards/test_reward_faults.py", "test_compare.py",
    "test_gpu_check.py", "test_readme_walkthrough.py", "test_wheel.py", "tracking/test_tracking_real_backends.py",
    "trainers/test_async_generation.py", "trainers/test_dpo_resume.py", "trainers/test_online_resume.py",
}
TESTS = Path(__file__).parent


def starts_processes(path: Path) -> bool:
    relative = path.relative_to(TESTS)
    return relative.parts[0] in PROCESS_DIRS or relative.as_posix() in PROCESS_FILES


def pytest_collection_modifyitems(config, items):
    """Tests in files that start processes get the `processes` marker; tests marked `cuda` are skipped, with the
    reason, where torch sees no CUDA GPU."""
    for item in items:
        if starts_processes(Path(item.fspath)):
            item.add_marker(pytest.mark.processes)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and torch sees none (benchmarks/gpu_check.sh runs these on one)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
