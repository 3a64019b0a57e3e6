"""The one exception type for user mistakes, and the stop-signal exception the CLI turns into exit codes.

Every bad path, malformed row, unknown config key or oversized prompt raises
`UserInputError` with what was wrong, where, and what to do about it.
Torch-free on purpose: `rlhflab.cli` imports this, and `rlhflab report` / `--help` must not load torch.
"""

from __future__ import annotations

import signal
from pathlib import Path

# docs/reading-a-run.md "Checkpoints and resume": 130 SIGINT / 143 SIGTERM (step finished, checkpoint written);
# 4 a second signal while the first was handled (out at once, last complete checkpoint untouched).
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
ABORTED_EXIT_CODE = 4


class UserInputError(ValueError):
    """A mistake in something the user supplied (file, row, config key, model)."""

    def __init__(self, what: str, where: str | None = None, fix: str | None = None):
        self.what = what
        self.where = where
        self.fix = fix
        parts = [what if where is None else f"{where}: {what}"]
        if fix:
            parts.append(f"-> {fix}")
        super().__init__(" ".join(parts))


class StageFailed(RuntimeError):
    """A stage run in a child process (the demo's stages side by side) stopped; the message says where its log is."""


class Interrupted(Exception):
    """A stop signal arrived; the step in progress finished and `checkpoint` holds the run's state."""

    def __init__(self, signum: int, step: int, checkpoint: Path):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_code = EXIT_CODES.get(signum, 128 + signum)
        run = checkpoint.parent.parent
        super().__init__(f"{signal.Signals(signum).name} after step {step}: checkpoint {checkpoint}; "
                         f"continue with --resume latest --output_dir {run}")
