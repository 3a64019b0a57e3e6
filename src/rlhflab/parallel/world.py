"""Who this process is among the run's processes, and the few process-level collectives.

    torchrun --nproc_per_node 2 -m rlhflab sft ...       # or: accelerate launch -m rlhflab sft ...

Both launchers start one process per device with RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE /
MASTER_ADDR / MASTER_PORT in the environment; `init_world` reads them and joins the process group
(nccl on CUDA, gloo on CPU). Without them (plain `rlhflab sft`) the world is one process, no process
group exists, and every collective here and in `reduce` returns its input unchanged.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import pickle
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from rlhflab.errors import UserInputError
from rlhflab.parallel.peers import record_peers

log = logging.getLogger("rlhflab")
T = TypeVar("T")

# A rank waits this long in a collective while rank 0 alone evaluates or writes (torch's default for
# gloo is 30 min; a long held-out evaluation of a big model may need more).
COLLECTIVE_TIMEOUT = timedelta(minutes=int(os.environ.get("RLHFLAB_COLLECTIVE_TIMEOUT_MIN", "60")))
FAIL_AT = "RLHFLAB_FAIL_AT"  # test hook: "RANK:STEP" raises on that rank after that step (see fail_if_asked)


@dataclass(frozen=True)
class World:
    """This process's place in the run. One process: rank 0 of 1, no process group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None  # "gloo", "nccl", or None for one process

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes the run folder, checkpoints, report and model."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def describe(self) -> dict:
        return {"world_size": self.world_size, "backend": self.backend, "device": str(self.device)}

    # --- process-level collectives (no-ops in one process) -----------------------------------

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def broadcast(self, value: T) -> T:
        """Rank 0's `value` on every rank (any picklable object)."""
        if not self.distributed:
            return value
        box = [value if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def from_main(self, compute: Callable[[], T]) -> T:
        """`compute()` run on rank 0 only, its result (or its exception) on every rank.

        For what only rank 0 may do (open the run folder, evaluate, write): the other ranks wait in
        the broadcast, and an exception on rank 0 is raised on every rank, so none is left waiting
        in a later collective."""
        if not self.distributed:
            return compute()
        if not self.is_main:
            outcome = self.broadcast(None)
        else:
            try:
                outcome = ("ok", compute())
            except BaseException as err:  # noqa: BLE001 - re-raised below, after the others heard of it
                self.broadcast(("error", _portable(err)))
                raise
            self.broadcast(outcome)
        if outcome[0] == "error":
            raise outcome[1]
        return outcome[1]

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on any rank (a stop signal, a time budget spent)."""
        return bool(self.max(int(flag)))

    def max(self, value: int) -> int:
        """The largest integer any rank holds."""
        if not self.distributed:
            return value
        box = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return int(box.item())

    def check_same(self, value: Any, what: str) -> None:
        """Raise on every rank when the ranks built different `value`s (data, tokenizer vocabulary):
        each rank builds its own copy of the data, and a difference would train a silently wrong model."""
        if not self.distributed:
            return
        digest = hashlib.sha256(pickle.dumps(value, protocol=4)).hexdigest()
        digests = [None] * self.world_size
        dist.all_gather_object(digests, digest)
        if len(set(digests)) > 1:
            differ = [r for r, d in enumerate(digests) if d != digests[0]]
            raise RuntimeError(f"{what} differs between ranks (rank 0 vs ranks {differ}): every rank must build "
                               "the same from the same config; check that data files and models are the same on "
                               "every node")

    def threads(self, requested: int) -> int:
        """CPU threads for this process: `requested`, or (0) the machine's cores shared by its local ranks."""
        if requested > 0:
            return requested
        return max(1, (os.cpu_count() or 1) // self.local_world_size)


SINGLE = World()


def _portable(err: BaseException) -> BaseException:
    """`err` as it can cross to the other ranks (pickled), else a RuntimeError with its message."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001 - any unpicklable exception is replaced, never lost
        return RuntimeError(f"on rank 0: {type(err).__name__}: {err}")


def launched_ranks() -> tuple[int, int, int, int]:
    """(rank, world size, local rank, local world size) from the launcher's environment; (0, 1, 0, 1) without."""
    env = os.environ
    size = int(env.get("WORLD_SIZE", "1"))
    return int(env.get("RANK", "0")), size, int(env.get("LOCAL_RANK", "0")), int(env.get("LOCAL_WORLD_SIZE", size))


def process_device(name: str, local_rank: int, distributed: bool) -> torch.device:
    """'auto' -> cuda:<local rank> when CUDA is there, else cpu; 'cuda' -> cuda:<local rank> when distributed."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and distributed:
        return torch.device("cuda", local_rank)
    return torch.device(name)


def init_world(device: str = "auto") -> World:
    """The World of this process, joining the process group on first call (later calls reuse it)."""
    rank, size, local_rank, local_size = launched_ranks()
    where = process_device(device, local_rank, size > 1)
    if size == 1:
        return World(device=where)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    backend = "nccl" if where.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
        log.info("process group: rank %d of %d (%s, %s)", rank, size, backend, where)
    elif dist.get_world_size() != size:
        raise UserInputError(f"a process group of {dist.get_world_size()} exists, the launcher says {size}",
                             "WORLD_SIZE", "launch with torchrun / accelerate launch only")
    record_peers()  # once: so that a rank whose peer dies can name it (peers.py)
    return World(rank, size, local_rank, local_size, where, dist.get_backend())


def barrier_if_joined() -> None:
    """Wait for every process of the group this one joined, if any (between stages run in one launch)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def shutdown_world(finished: bool = True) -> None:
    """Leave the process group (the CLI's last act; torch warns about a group left open).

    After a finished run every rank first waits for the others (no rank closes its connections while a peer's
    last collective is in flight; `finished=False` after an error, where a peer may wait elsewhere), and the
    wrappers still holding the group through reference cycles (DDP's reducer, FSDP's hooks) are collected while
    the interpreter is whole: a gloo group torn down during interpreter shutdown can abort the process (SIGABRT,
    "terminate called without an active exception") after all its work was written."""
    if dist.is_available() and dist.is_initialized():
        if finished:
            dist.barrier()
        gc.collect()
        dist.destroy_process_group()


def fail_if_asked(world: World, step: int) -> None:
    """Test hook (tests/parallel): with RLHFLAB_FAIL_AT=RANK:STEP this rank raises after that step, so a
    test can check that one rank's exception ends every rank with its message."""
    spec = os.environ.get(FAIL_AT)
    if not spec:
        return
    rank, at = (int(part) for part in spec.split(":"))
    if world.rank == rank and step == at:
        raise RuntimeError(f"deliberate failure on rank {rank} after step {step} ({FAIL_AT}={spec})")
