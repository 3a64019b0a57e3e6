"""`rlhflab ARGS` under torchrun, with rank 1 killed (SIGKILL, as the out-of-memory killer does) in the middle of
the sharded save of checkpoint step-STEP (tests/parallel/test_two_processes.py):

    torchrun --standalone --nproc_per_node 2 tests/parallel/kill_in_save_driver.py STEP sft --output_dir RUN ...

Rank 1 dies right after its own shard file is written (torch.distributed.checkpoint's FileSystemWriter), so
`.tmp-step-STEP/sharded/` holds a shard but neither the metadata rank 0 writes once every rank reported, nor
the checkpoint's marker. Every other step, and every other rank, runs as `rlhflab ARGS` runs.
"""

import os
import signal
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from torch.distributed.checkpoint import filesystem  # noqa: E402

from rlhflab.cli import main  # noqa: E402


def kill_rank_1_after_its_shard(step: int) -> None:
    write_data = filesystem._FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        written = write_data(self, plan, planner)
        if os.environ["RANK"] == "1" and f".tmp-step-{step}" in str(self.path):
            written.wait()  # its shard is on disk
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    filesystem._FileSystemWriter.write_data = write_then_die


if __name__ == "__main__":
    kill_rank_1_after_its_shard(int(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
