"""Shared fixtures. OMP_WAIT_POLICY must be set before torch is imported."""

import os
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# one thread a worker under `-n 2` (two workers already fill the 2 cores: the in-process tests took 80 s instead
# of 84-87), two in a plain run
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))


# Test files that start processes (the CLI in a subprocess, torchrun, an async generator, a browser, a venv):
# marked `processes`, so `pytest -m "not processes"` is the quick in-process loop. `make test` runs every test on
# two workers (pytest-xdist): their wall-clock bounds leave room for a second worker's load (5x or more).
PROCESS_DIRS = ("parallel", "docs")
PROCESS_FILES = {
    "checkpoint/test_damage.py", "checkpoint/test_ownership.py", "checkpoint/test_resume.py",
    "checkpoint/test_signals.py", "checkpoint/test_write_failures.py", "cli/test_cli.py", "cli/test_light_import.py",
    "report/test_browser.py", "report/test_report_cli.py", "rewards/test_reward_faults.py", "test_compare.py",
    "test_gpu_check.py", "test_readme_walkthrough.py", "test_wheel.py", "tracking/test_tracking_real_backends.py",
    "trainers/test_async_generation.py", "trainers/test_dpo_resume.py", "trainers/test_online_resume.py",
}
# files whose tests share a costly module fixture (a torchrun launch, a demo run, a comparison, a wheel): one xdist
# worker runs each of them whole, so the fixture is paid once, not once per worker (pytest_xdist_make_scheduler)
SHARED_LAUNCH_FILES = {
    "parallel/test_two_processes.py", "parallel/test_online_ranks.py", "parallel/test_deepspeed.py",
    "parallel/test_deepspeed_online.py", "test_compare.py", "cli/test_cli.py", "report/test_browser.py",
    "test_wheel.py",
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
    # the long ones first (a stable sort: each file's tests stay together, in order): under `-n 2` the quick
    # in-process tests then fill the gaps at the end instead of a minute-long test running alone on one worker
    items.sort(key=lambda item: item.get_closest_marker("processes") is None)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and torch sees none (benchmarks/gpu_check.sh runs these on one)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def pytest_xdist_make_scheduler(config, log):
    """Under `-n N` (xdist's default `--dist load`): tests go to workers one by one, except that a file of
    SHARED_LAUNCH_FILES goes to one worker whole. (xdist's own `--dist loadgroup` cannot do it under pytest 9: it
    renames items through `item._nodeid`, which pytest 9 no longer reads.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureFilesWhole(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return file if file.removeprefix("tests/") in SHARED_LAUNCH_FILES else nodeid

    return SharedFixtureFilesWhole(config, log)
