"""The run folder across processes: rank 0 writes it, the other ranks follow with the same path.

Only rank 0 creates the folder, writes config.yaml, metrics.jsonl, samples.jsonl, summary.json,
checkpoints and the model; the other ranks hold a `FollowerRun` whose writes do nothing, so a trainer
calls `run.log(...)` on every rank without asking which one it is. A checkpoint records the layout
that wrote it (`parallel.Layout.describe()`); `check_layout` says whether a resume can read it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Iterable

from rlhflab.errors import UserInputError
from rlhflab.parallel import Layout
from rlhflab.tracking import RunDir

log = logging.getLogger("rlhflab")

ONE_PROCESS = {"strategy": "none", "world_size": 1, "sharded_state": False}  # checkpoints written before issue 15


class FollowerRun(RunDir):
    """A rank other than 0: the run folder's path, and writes that do nothing (rank 0 makes them)."""

    def __init__(self, path: str | Path):  # noqa: super().__init__ would create the folder
        self.path = Path(path)
        self._sinks = []
        self.started = time.time()

    def write_json(self, name: str, payload: Any) -> Path:
        return self.path / name

    def write_versions(self, seed: int | None = None) -> None:
        pass

    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def add_samples(self, rows: Iterable[dict[str, Any]]) -> None:
        pass

    def update_summary(self, **fields: Any) -> dict[str, Any]:
        return dict(fields)


def check_layout(saved: dict | None, layout: Layout, where: str) -> None:
    """Refuse a resume that cannot read the checkpoint's state; say so when the world size changes.

    Whole-model checkpoints (one process, DDP) hold every weight and moment: any world size reads them,
    and the updates that follow equal the single-process ones (up to float rounding). Sharded ones
    (FSDP2) hold one file of shards per rank: resume them with the same processes and strategy."""
    saved = saved or ONE_PROCESS
    now = layout.describe()
    if saved["sharded_state"] or now["sharded_state"]:
        same = saved["strategy"] == now["strategy"] and saved["world_size"] == now["world_size"]
        if not same:
            raise UserInputError(
                f"the checkpoint was written by {saved['world_size']} process(es) with parallel_strategy "
                f"{saved['strategy']}; this run has {now['world_size']} with {now['strategy']}, and a sharded "
                "(fsdp2) checkpoint is read back only by the layout that wrote it", where,
                f"resume with torchrun --nproc_per_node {saved['world_size']} (or accelerate launch --num_processes "
                f"{saved['world_size']}) and --parallel_strategy {saved['strategy']}"
                if saved["world_size"] > 1 else "resume in one process (plain rlhflab), as the run was written")
    elif saved["world_size"] != now["world_size"]:
        log.warning("resuming a checkpoint of %d process(es) with %d: the whole model and optimiser state are in "
                    "it, batch sizes are global, so the run continues with the same updates up to float rounding",
                    saved["world_size"], now["world_size"])
