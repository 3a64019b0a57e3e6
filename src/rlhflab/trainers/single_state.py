"""What an SFT or reward-model checkpoint holds: one model, its optimiser, schedule, RNGs, position.

The data order is not stored: both trainers draw it from a seeded `random.Random`, so a
resumed run replays the draws of the steps already done (microseconds) and continues
with the very next batch. `progress` is the trainer's own small dict (step, last stats).
"""

from __future__ import annotations

import torch

from rlhflab.checkpoint import Resumed, load_trainable_weights, restore_rng, rng_state, trainable_weights
from rlhflab.checkpoint.state import load_optimiser


def pack_single(model: torch.nn.Module, optimizer, scheduler, progress: dict) -> tuple[dict[str, torch.Tensor], dict]:
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng_state(),
             "progress": progress}
    return trainable_weights({"model": model}), state


def unpack_single(resumed: Resumed, model: torch.nn.Module, optimizer, scheduler) -> dict:
    """Put a checkpoint back into a freshly built model / optimiser / schedule; returns `progress`.

    The optimiser's hyperparameters stay those of the config (see `load_optimiser`)."""
    load_trainable_weights({"model": model}, resumed.weights, str(resumed.checkpoint / "model.safetensors"))
    load_optimiser(optimizer, scheduler, resumed.state, str(resumed.checkpoint / "state.safetensors"))
    restore_rng(resumed.state["rng"])
    return resumed.state["progress"]
