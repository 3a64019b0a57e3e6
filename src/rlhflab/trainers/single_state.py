"""What an SFT, reward-model or DPO checkpoint holds: one model, its optimiser, schedule, RNGs, position.

The data order is not stored: the trainers draw it from a seeded `random.Random`, so a
resumed run replays the draws of the steps already done (microseconds) and continues
with the very next batch. `progress` is the trainer's own small dict (step, last stats).

Several processes: rank 0 packs. Under DDP the model is whole on every rank, so its checkpoint is
the single-process one. Under FSDP2 the trainable weights and their AdamW moments are shards: every
rank writes its own into `step-N/sharded/` (torch.distributed.checkpoint; DeepSpeed: its own checkpoint of
its ZeRO slices) and reads them back.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlhflab import parallel
from rlhflab.checkpoint import Checkpointer, Resumed, load_trainable_weights, restore_rng, rng_state, trainable_weights
from rlhflab.checkpoint.folder import SHARDED
from rlhflab.checkpoint.state import load_optimiser
from rlhflab.tracking import RunDir


def pack_single(wrapped: parallel.Wrapped, optimizer, scheduler, progress: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(weights, state) of a checkpoint, on rank 0; no weights or moments when they are shards."""
    state = {"scheduler": scheduler.state_dict(), "rng": rng_state(), "progress": progress}
    if wrapped.layout.sharded:
        return {}, state
    return trainable_weights({"model": wrapped.model}), {**state, "optimizer": optimizer.state_dict()}


def unpack_single(resumed: Resumed, wrapped: parallel.Wrapped, optimizer, scheduler) -> dict:
    """Put a checkpoint back into a freshly built (and wrapped) model / optimiser / schedule; returns `progress`.

    The optimiser's hyperparameters stay those of the config (see `load_optimiser`)."""
    where = str(resumed.checkpoint / "state.safetensors")
    if wrapped.layout.sharded:
        shards = resumed.checkpoint / SHARDED
        load_optimiser(optimizer, scheduler, resumed.state, where,
                       load_moments=lambda: wrapped.load_sharded(optimizer, shards))
    else:
        load_trainable_weights({"model": wrapped.model}, resumed.weights, str(resumed.checkpoint / "model.safetensors"))
        load_optimiser(optimizer, scheduler, resumed.state, where)
    restore_rng(resumed.state["rng"])
    return resumed.state["progress"]


def checkpointer(run: RunDir, cfg, resumed: Resumed | None, wrapped: parallel.Wrapped, optimizer) -> Checkpointer:
    """The loop's Checkpointer for this layout (a resumed run's own checkpoint is on disk already)."""
    def write_shards(folder: Path) -> None:
        wrapped.save_sharded(optimizer, folder)

    return Checkpointer(run.path, cfg.save_every, cfg.keep_last_n, resumed.step if resumed is not None else None,
                        layout=wrapped.layout, write_shards=write_shards if wrapped.layout.sharded else None)
