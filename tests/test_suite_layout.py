"""tests/conftest.py marks the test files that start processes (`-m "not processes"` is the quick loop): a file that
starts processes must be among those marked, and each file it sends to one xdist worker whole must exist."""

import re
from pathlib import Path

from conftest import SHARED_LAUNCH_FILES, TESTS, starts_processes  # noqa: F401 - the hook's own definitions

# what a test file calls to start another process: the CLI or python in a subprocess, torchrun, a launcher
# helper, the asynchronous generator (a spawned process), a browser, a venv
STARTS = re.compile(r"subprocess|start_cli|torch\.distributed\.run|launch\(|async_generation=True|"
                    r"multiprocessing|playwright|bare_python|async_generation\", \"true\"|-async")
# files the pattern flags that start nothing: each of their asynchronous runs takes its rollouts from a stand-in
# `async_rollouts`, never a spawned generator
IN_PROCESS = {"trainers/test_online_loop_unit2.py"}


def test_every_test_file_that_starts_processes_is_marked():
    unmarked = [path.relative_to(TESTS).as_posix() for path in sorted(TESTS.rglob("test_*.py"))
                if path.name != Path(__file__).name and STARTS.search(path.read_text()) and not starts_processes(path)]
    assert sorted(set(unmarked) - IN_PROCESS) == [], f"add these to PROCESS_FILES in tests/conftest.py: {unmarked}"
    assert sorted(IN_PROCESS - set(unmarked)) == []  # each exemption still needed


def test_every_file_kept_on_one_worker_exists_and_starts_processes():
    named = {name: TESTS / name for name in SHARED_LAUNCH_FILES}
    assert [name for name, path in named.items() if not path.is_file() or not starts_processes(path)] == []
