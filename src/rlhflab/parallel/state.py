"""Sharded model and optimiser state through torch.distributed.checkpoint (DCP), and whole-model gathers.

Under FSDP2 each rank holds shards; a checkpoint's `sharded/` folder is written by every rank at once
(`save_sharded`, DCP's own format: one file per rank plus `.metadata`) and read back the same way.
Only trainable parameters and their optimiser state are saved (frozen weights come back from the model
folder the run starts from, as in every other checkpoint). Every function here is a collective.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

_TRAINABLE = StateDictOptions(ignore_frozen_params=True)


def full_model_state(model: nn.Module, every_rank: bool = False) -> dict[str, torch.Tensor]:
    """The whole state dict, on the CPU of rank 0 (other ranks get {}): the shards all-gathered.
    `every_rank`: on every rank, on the model's device (e.g. for every rank to generate from)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=not every_rank))


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Every rank writes its shards of the trainable weights and their optimiser state into `folder`."""
    import torch.distributed.checkpoint as dcp

    model_state, optimizer_state = get_state_dict(model, optimizer, options=_TRAINABLE)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder))


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Read `save_sharded`'s folder back into a model and optimiser wrapped the same way."""
    import torch.distributed.checkpoint as dcp

    model_state, optimizer_state = get_state_dict(model, optimizer, options=_TRAINABLE)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(folder))
    # not strict: the frozen weights (a LoRA base) are not in the checkpoint; dcp.load above already refused a
    # checkpoint that lacks any trainable one
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))
