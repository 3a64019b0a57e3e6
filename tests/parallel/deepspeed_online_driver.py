"""Online runs under DeepSpeed in one torchrun launch, for tests/parallel/test_deepspeed_online.py: the process
start and the imports (DeepSpeed's take seconds) are paid once.

    torchrun --standalone --nproc_per_node 2 tests/parallel/deepspeed_online_driver.py JOBS.json

JOBS.json: [{"args": ["ppo", "--output_dir", DIR, ...], "zero_stage": 2, "resume_at": N, "nan_at": K}, ...].
Each job trains as `rlhflab <args>` does (with the monitor, without the HTML report) at its ZeRO stage (set as
`accelerate launch` sets it: ACCELERATE_DEEPSPEED_ZERO_STAGE). With `resume_at` N, rank 0 then copies the
finished run's model/, value/ and metrics.jsonl to DIR-uninterrupted/ and the job resumes from its checkpoint
step-N. With `nan_at` K, the loss of the last micro-batch of the run's K-th minibatch is NaN (`poison_minibatch`).
"""

import importlib
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from rlhflab import parallel  # noqa: E402
from rlhflab.config import STAGES, parse_config  # noqa: E402
from rlhflab.eval import RunMonitor  # noqa: E402
from rlhflab.trainers.online import passes  # noqa: E402

KEPT = ("model", "adapter", "value", "metrics.jsonl")  # what a resume is compared on


def poison_minibatch(number: int):
    """A stand-in for `passes.micro_losses`: the loss of the last micro-batch of minibatch `number` (0-based,
    counted over the run) is NaN, on the process that trains that micro-batch. Every process sees every
    minibatch (each trains a block of its micro-batches), so all count alike."""
    real = passes.micro_losses
    seen = {"share": None, "count": -1}

    def micro_losses(algorithm, roles, batch, adv, idx, share, temperature, forward=None, part="all"):
        if share is not seen["share"]:  # a new StepShare: the next minibatch
            seen["share"], seen["count"] = share, seen["count"] + 1
        loss, stats = real(algorithm, roles, batch, adv, idx, share, temperature, forward, part)
        if seen["count"] == number and int(idx[-1]) == int(share.index[-1]):
            loss = loss * float("nan")
        return loss, stats

    return micro_losses


def train(args: list[str]) -> None:
    cfg = parse_config(STAGES[args[0]], args[1:], prog=f"rlhflab {args[0]}")
    importlib.import_module(f"rlhflab.trainers.{args[0]}").train(cfg, monitor=RunMonitor.from_config(cfg))


def run_job(job: dict, world: parallel.World) -> None:
    args = job["args"]
    out = Path(args[args.index("--output_dir") + 1])
    os.environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"] = str(job["zero_stage"])
    real = passes.micro_losses
    if job.get("nan_at") is not None:
        passes.micro_losses = poison_minibatch(job["nan_at"])
    try:
        train(args)
    finally:
        passes.micro_losses = real
    if job.get("resume_at"):
        if world.is_main:
            kept = out.parent / f"{out.name}-uninterrupted"
            kept.mkdir()
            for name in KEPT:
                if (out / name).is_dir():
                    shutil.copytree(out / name, kept / name)
                elif (out / name).exists():
                    shutil.copy(out / name, kept / name)
        world.barrier()
        train([*args, "--resume", str(out / "checkpoints" / f"step-{job['resume_at']}")])


def main(jobs_file: str) -> None:
    from launch_runs import run_jobs  # the sibling driver (its folder is on sys.path: torchrun runs this file)

    run_jobs(jobs_file, run_job)


if __name__ == "__main__":
    main(sys.argv[1])
