"""Atomic checkpoints and exact resume (docs/reading-a-run.md "Checkpoints and resume").

Layer 2: trainers (layer 3) import it; it knows run folders and configs, never a trainer.
"""

from rlhflab.checkpoint.folder import (
    MARKER,
    atomic_folder,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify,
    weight_bytes,
)
from rlhflab.checkpoint.resume import Checkpointer, Resumed, config_changes, open_run
from rlhflab.checkpoint.signals import ABORTED_EXIT_CODE, EXIT_CODES, Interrupted, StopSignals
from rlhflab.checkpoint.state import load_optimiser, load_trainable_weights, restore_rng, rng_state, trainable_weights

__all__ = [
    "ABORTED_EXIT_CODE", "Checkpointer", "EXIT_CODES", "Interrupted", "MARKER", "Resumed", "StopSignals",
    "atomic_folder", "complete_checkpoints", "config_changes", "latest_checkpoint", "load_checkpoint", "load_optimiser",
    "load_trainable_weights",
    "open_run", "restore_rng", "rng_state", "save_checkpoint", "trainable_weights", "verify",
    "weight_bytes",
]
