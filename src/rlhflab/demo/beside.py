"""A stage in a second process, beside work this process goes on with.

At the demo's sizes a PPO stage keeps about one CPU core busy whatever its thread count (the
decode steps and small matmuls do not spread over threads), so on a 2-core machine two
independent PPO stages side by side, one thread each, take about the time of the longer one.
The stage runs through its own CLI command from its effective config written as YAML, so it
is the run `rlhflab <stage> --config RUN/<stage>.yaml` gives; its output goes to a log file
beside its run folder. The child has its own session: a Ctrl-C at the terminal reaches only
this process, which then stops the child once (a second signal would make it skip its checkpoint).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from rlhflab.config import write_config
from rlhflab.errors import StageFailed
from rlhflab.tracking import RunResult

STOP_GRACE_S = 120  # a stopped child finishes its step and writes a checkpoint; then it is killed


class StageBeside:
    """`rlhflab <command> --config <yaml>` started now in a child process. Use as a context manager: leaving
    the block before `wait()` returned (an error, a signal) stops the child."""

    def __init__(self, command: str, cfg, log_path: Path):
        self.command, self.cfg, self.log_path = command, cfg, log_path
        self.cpu_seconds = 0.0  # the child's own user + system CPU, known after wait()
        config_path = log_path.with_suffix(".yaml")
        write_config(cfg, config_path)
        env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        with log_path.open("w") as log:  # the child holds its own copy of the handle
            self.process = subprocess.Popen([sys.executable, "-m", "rlhflab", command, "--config", str(config_path)],
                                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def __enter__(self) -> StageBeside:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait(self) -> RunResult:
        """Wait for the child; its RunResult, or StageFailed naming its log and how to go on."""
        _, status, usage = os.wait4(self.process.pid, 0)
        self.process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        self.cpu_seconds = usage.ru_utime + usage.ru_stime
        if self.process.returncode != 0:
            raise StageFailed(self.failure())
        run_dir = Path(self.cfg.output_dir)
        summary = json.loads((run_dir / "summary.json").read_text())
        model_dir = summary.get("model_dir")
        return RunResult(run_dir, summary, Path(model_dir) if model_dir else None)

    def failure(self) -> str:
        code, run_dir = self.process.returncode, self.cfg.output_dir
        tail = "\n".join(self.log_path.read_text().splitlines()[-15:])
        if code in (130, 143):  # SIGINT / SIGTERM: it finished its step and wrote a checkpoint
            return (f"rlhflab {self.command} (run beside the others) was stopped and wrote a checkpoint; continue it "
                    f"with: rlhflab {self.command} --resume latest --output_dir {run_dir}")
        return (f"rlhflab {self.command} (run beside the others in a second process) stopped with exit code {code}; "
                f"its log {self.log_path} ends:\n{tail}\nrerun the demo with --stages_side_by_side false to run it "
                "in this process instead")

    def stop(self) -> None:
        """End a child that is still running (this process is failing); what it wrote stays on disk."""
        if self.process.returncode is not None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
