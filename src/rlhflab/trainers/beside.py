"""A stage in a second process, beside work this process goes on with.

At the demo's sizes a PPO stage keeps about one CPU core busy whatever its thread count (the
decode steps and small matmuls do not spread over threads), so on a 2-core machine two
independent PPO stages side by side, one thread each, take about the time of the longer one.
The stage runs through its own CLI command from its effective config written as YAML, so it
is exactly the run `rlhflab <stage> --config RUN/<stage>.yaml` would give; its output goes to a
log file beside its run folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from rlhflab.config import write_config
from rlhflab.errors import UserInputError
from rlhflab.tracking import RunResult


class StageBeside:
    """`rlhflab <command> --config <yaml>` started now in a child process; `wait()` gives its RunResult."""

    def __init__(self, command: str, cfg, log_path: Path):
        self.cfg, self.log_path = cfg, log_path
        config_path = log_path.with_suffix(".yaml")
        write_config(cfg, config_path)
        env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        with log_path.open("w") as log:  # the child holds its own copy of the handle
            self.process = subprocess.Popen([sys.executable, "-m", "rlhflab", command, "--config", str(config_path)],
                                            stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait(self) -> RunResult:
        if self.process.wait() != 0:
            tail = self.log_path.read_text().splitlines()[-15:]
            raise UserInputError(f"the stage run beside the others stopped with exit code {self.process.returncode}:\n"
                                 + "\n".join(tail), str(self.log_path),
                                 "read the whole log there; rerun without running stages side by side to see it live")
        run_dir = Path(self.cfg.output_dir)
        summary = json.loads((run_dir / "summary.json").read_text())
        model_dir = summary.get("model_dir")
        return RunResult(run_dir, summary, Path(model_dir) if model_dir else None)

    def stop(self) -> None:
        """End the child (this process is failing); what it wrote stays on disk."""
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait()
