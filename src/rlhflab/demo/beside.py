"""A stage in a second process, beside work this process goes on with.

At the demo's sizes a PPO stage keeps about one CPU core busy whatever its thread count (the
decode steps and small matmuls do not spread over threads), so on a 2-core machine two
independent PPO stages side by side, one thread each, take about the time of the longer one.
The stage runs through its own CLI command from its effective config written as YAML, so it
is the run `rlhflab <stage> --config RUN/<stage>.yaml` gives; its output goes to a log file
beside its run folder. The child has its own session: a Ctrl-C at the terminal reaches only
this process, which then stops the child once (a second signal would make it skip its checkpoint).

With `then`, the child runs several stages one after another (`rlhflab chain`): the demo's SFT and reward model
share one start-up (~9 s of torchrun, imports and process group a launch).

With `processes` > 1 the child is `torchrun --standalone --nproc_per_node N -m rlhflab <stage>`: the
stage's own multi-process training (DDP), the run one process gives up to float summation order. At
the demo's sizes two threads in one process barely beat one (an SFT step of the demo model: 186 ms at two
threads against 156 at one, PASSIVE OpenMP threads sleep and wake around every small op), two processes of
one thread each take 107 ms.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from rlhflab.config import write_config
from rlhflab.errors import WRITE_FAILED_EXIT_CODE, StageFailed
from rlhflab.tracking import RunResult

STOP_GRACE_S = 120  # a stopped child finishes its step and writes a checkpoint; then it is killed


class StageBeside:
    """`rlhflab <command> --config <yaml>` started now in a child process; with `then` more stages after it in the
    same child (`rlhflab chain`: one start-up and, under torchrun, one process group for all). Each stage's config
    goes to RUN/<command>.yaml beside the log. Use as a context manager: leaving the block before `wait()`
    returned (an error, a signal) stops the child."""

    def __init__(self, command: str, cfg, log_path: Path, processes: int = 1, then: tuple = ()):
        self.stages = [(command, cfg), *then]
        self.log_path, self.processes = log_path, processes
        self.cpu_seconds = 0.0  # the child's own user + system CPU (its torchrun workers' too), known after wait()
        words = []
        for name, stage_cfg in self.stages:
            config_path = log_path.parent / f"{name}.yaml"
            write_config(stage_cfg, config_path)
            words += [*(["then"] if words else []), name, "--config", str(config_path)]
        env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                    str(processes)] if processes > 1 else [sys.executable]
        argv = [*(["chain"] if then else []), *words]
        with log_path.open("w") as log:  # the child holds its own copy of the handle
            self.process = subprocess.Popen([*launcher, "-m", "rlhflab", *argv], stdout=log,
                                            stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def __enter__(self) -> StageBeside:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait(self) -> RunResult:
        """Wait for the child; the first stage's RunResult (`wait_all`: every stage's)."""
        return self.wait_all()[0]

    def wait_all(self) -> list[RunResult]:
        """Wait for the child; each stage's RunResult, or StageFailed naming its log and how to go on."""
        _, status, usage = os.wait4(self.process.pid, 0)
        self.process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        self.cpu_seconds = usage.ru_utime + usage.ru_stime
        if self.process.returncode != 0:
            written = self.write_failure()  # a full disk in the child: its one line, and the CLI's exit code
            raise StageFailed(written, WRITE_FAILED_EXIT_CODE) if written else StageFailed(self.failure())
        return [finished_run(Path(cfg.output_dir)) for _, cfg in self.stages]

    def stopped_stage(self) -> tuple[str, object]:
        """The first stage without a finished run folder: the one that stopped."""
        for name, cfg in self.stages:
            summary = Path(cfg.output_dir) / "summary.json"
            if not summary.is_file() or "model_dir" not in json.loads(summary.read_text()):
                return name, cfg
        return self.stages[-1]

    def write_failure(self) -> str | None:
        """The child's 'write failed' message (it names the run folder and the command that resumes it), if any:
        under torchrun the exit code says only that a process failed."""
        said = [line for line in self.log_path.read_text().splitlines() if ": write failed: " in line]
        return f"{said[-1].split(': write failed: ', 1)[1]} (in the stage beside this one)" if said else None

    def failure(self) -> str:
        code = self.process.returncode
        command, cfg = self.stopped_stage()
        tail = "\n".join(self.log_path.read_text().splitlines()[-15:])
        if code in (130, 143):  # SIGINT / SIGTERM: it finished its step and wrote a checkpoint
            launch = "" if self.processes == 1 else f"torchrun --nproc_per_node {self.processes} -m "
            return (f"rlhflab {command} (run in {self.processes} process(es) beside this one) was stopped and "
                    f"wrote a checkpoint; continue it with: {launch}rlhflab {command} --resume latest "
                    f"--output_dir {cfg.output_dir}")
        where, flag = (("in a second process", "--stages_side_by_side false") if self.processes == 1 else
                       (f"in {self.processes} processes; torchrun exits 1 whichever process failed or was "
                        "stopped, the log names it", "--stage_processes 1"))
        return (f"rlhflab {command} (run {where}) stopped with exit code {code}; its log {self.log_path} "
                f"ends:\n{tail}\nrerun the demo with {flag} to run it in this process instead")

    def stop(self) -> None:
        """End a child that is still running (this process is failing); what it wrote stays on disk."""
        if self.process.returncode is not None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:  # the whole session: torchrun and the processes it started
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def finished_run(run_dir: Path) -> RunResult:
    """The RunResult of a stage a child process finished (its summary.json)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    model_dir = summary.get("model_dir")
    return RunResult(run_dir, summary, Path(model_dir) if model_dir else None)
