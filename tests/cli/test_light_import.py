"""The CLI module loads without torch: `rlhflab --help` and `rlhflab report` must stay fast."""

import subprocess
import sys


def test_importing_the_cli_does_not_import_torch():
    code = "import sys, rlhflab.cli; assert 'torch' not in sys.modules, 'rlhflab.cli imported torch'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_interrupted_is_one_class_wherever_it_is_imported_from():
    from rlhflab.checkpoint import Interrupted as from_checkpoint
    from rlhflab.errors import Interrupted

    assert from_checkpoint is Interrupted
