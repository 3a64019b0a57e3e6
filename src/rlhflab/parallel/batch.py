"""Global batches, split by position: batch sizes in configs are global (DESIGN.md "Scale-out").

A step's global batch is the rows a single process would train on in that step; rank r takes the
r-th contiguous block of them. So a run draws the same data at any world size, and the update is the
single-process one when losses are normalised by global counts (`reduce.all_sum` of local counts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlhflab.errors import UserInputError
from rlhflab.parallel.world import World


def local_batch_size(global_size: int, world: World, field: str = "batch_size") -> int:
    """`global_size / world_size`; a UserInputError naming `field` when it does not divide."""
    if global_size % world.world_size:
        lower = max(world.world_size, global_size // world.world_size * world.world_size)
        raise UserInputError(
            f"{field} {global_size} does not divide over {world.world_size} processes (batch sizes are global: "
            f"each process takes {field} / {world.world_size})", f"--{field}",
            f"use a multiple of {world.world_size}, e.g. --{field} {lower} or {lower + world.world_size}")
    return global_size // world.world_size


@dataclass(frozen=True)
class Share:
    """This rank's rows of a global batch of `total` rows.

    Every rank gets the same number of rows, `len(positions)` = ceil(total / world size), so every rank
    runs the same number of forward and backward passes (DDP and FSDP2 need that: each one is a
    collective). When `total` does not divide (a last, partial batch), the last ranks' blocks are
    short and are topped up with repeats of position 0 that must carry zero weight: `real` says
    how many of `positions` are real (the first `real`)."""

    positions: list[int]  # indices into the global batch: the real ones, then padding repeats of 0
    real: int
    total: int

    @property
    def weight(self) -> float:
        """This rank's real rows as a share of the global batch (1.0 in one process)."""
        return self.real / self.total if self.total else 0.0


def share_of(total: int, world: World) -> Share:
    """Rank r's contiguous block of a global batch of `total` rows (see Share)."""
    size = math.ceil(total / world.world_size) if total else 0
    start = min(world.rank * size, total)
    end = min(start + size, total)
    real = list(range(start, end))
    return Share(real + [0] * (size - len(real)), len(real), total)


def take(rows: list, share: Share) -> list:
    """The rows of a global batch at this rank's positions (padding included)."""
    return [rows[i] for i in share.positions]
