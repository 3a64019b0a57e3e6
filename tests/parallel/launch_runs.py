"""Several trainings in one torchrun launch, for tests/parallel: imports and process start-up are paid once.

    torchrun --standalone --nproc_per_node 2 tests/parallel/launch_runs.py JOBS.json

JOBS.json: [{"args": ["sft", "--output_dir", DIR, ...], "resume_at": N}, ...]. Each job trains to the end
as `rlhflab <args>` would (without the HTML report). With `resume_at`, rank 0 then keeps the finished run's
model/ and metrics.jsonl as model-uninterrupted/ and metrics-uninterrupted.jsonl, and the job resumes from
its checkpoint step-N and trains to the end again. Rank 0 writes the wall seconds to DIR/wall.json.
"""

import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from rlhflab import parallel  # noqa: E402
from rlhflab.config import STAGES, parse_config  # noqa: E402
from rlhflab.trainers import dpo, reward, sft  # noqa: E402

TRAINERS = {"sft": sft.train, "rm": reward.train, "dpo": dpo.train}


def train(args: list[str]) -> float:
    """Wall seconds of `rlhflab <args>`, run in this process."""
    started = time.time()
    TRAINERS[args[0]](parse_config(STAGES[args[0]], args[1:], prog=f"rlhflab {args[0]}"))
    return time.time() - started


def run_job(job: dict, world: parallel.World) -> None:
    args = job["args"]
    out = Path(args[args.index("--output_dir") + 1])
    walls = {"run": train(args)}
    if job.get("resume_at"):
        if world.is_main:
            shutil.copytree(out / "model", out / "model-uninterrupted")
            shutil.copy(out / "metrics.jsonl", out / "metrics-uninterrupted.jsonl")
        world.barrier()
        walls["resumed"] = train([*args, "--resume", str(out / "checkpoints" / f"step-{job['resume_at']}")])
    if world.is_main:
        (out / "wall.json").write_text(json.dumps(walls))


def run_jobs(jobs_file: str, run_one=None) -> None:
    """Every job of JOBS.json in one process group; `run_one(job, world)` (default: this file's run_job)."""
    world = parallel.init_world("cpu")
    for job in json.loads(Path(jobs_file).read_text()):
        (run_one or run_job)(job, world)
    parallel.shutdown_world()


def main(jobs_file: str) -> None:
    run_jobs(jobs_file)


if __name__ == "__main__":
    main(sys.argv[1])
