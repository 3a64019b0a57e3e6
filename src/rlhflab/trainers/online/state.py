"""What an online run's checkpoint holds, and how a resumed run puts it back.

Weights: every trainable tensor of the roles (the full policy, or its LoRA adapters;
the value head / value model / value adapter); the frozen base and reference come back
from `cfg.model`. State: AdamW and LR schedule, the algorithm's own (PPO's KL controller,
REINFORCE's moving baseline), the RNGs (global ones and the loop's `order` / `sampler`
generators), the loop's position (update, episode, the rest of the shuffled prompt order),
the wall-time split `max_seconds` reads, the last metrics the summary needs, and the
monitor's side (alarms, the rows it saw, the best policy so far).

Several processes: rank 0 packs. DDP holds the whole model on every rank, so its checkpoint is the
single-process one. FSDP2 holds shards: the trainable weights and their AdamW moments are written by
every rank into `step-N/sharded/` (torch.distributed.checkpoint) and read back the same way; DeepSpeed
writes its own checkpoint of its ZeRO slices there (`Wrapped.save_sharded` / `load_sharded`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlhflab.checkpoint import Resumed, load_trainable_weights, restore_rng, rng_state, trainable_weights
from rlhflab.checkpoint.folder import SHARDED
from rlhflab.checkpoint.state import load_optimiser
from rlhflab.rollout.roles import PolicyRoles
from rlhflab.trainers.online.monitor import RunWatch


@dataclass
class Progress:
    """The loop's counters and the rows the final summary reads."""

    update: int = 0
    episode: int = 0
    order: list[int] = field(default_factory=list)  # prompt indices not yet drawn from the current pass
    first: dict = field(default_factory=dict)  # the step-0 evaluation
    last_eval: dict = field(default_factory=dict)
    last: dict = field(default_factory=dict)  # the last update's metrics
    finished: bool = False  # the loop ended (all updates, or the monitor stopped it)
    skipped: int = 0  # optimiser steps dropped by nonfinite=skip so far
    walls: dict = field(default_factory=dict)  # seconds of the cycle so far ("loop", "evaluation", "save")
    budget_stop: dict | None = None  # where max_seconds stopped the run
    # [[update, prompt indices, weights' version]] sampled by an async generator and not trained on yet
    in_flight: list = field(default_factory=list)
    generated: int = 0  # answers generated so far: `episode` (trained) plus what --dynamic_sampling dropped


def role_modules(roles: PolicyRoles) -> dict[str, torch.nn.Module]:
    named = {"policy": roles.policy, "value_head": roles.value_head, "value_model": roles.value_model}
    return {name: module for name, module in named.items() if module is not None}


def pack_online(roles: PolicyRoles, optimizer, scheduler, algorithm, generators: dict[str, torch.Generator],
                progress: Progress, watch: RunWatch, sharded: bool = False,
                rollouts: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """(weights, state) of a checkpoint; `sharded`: weights and moments are written apart by every rank;
    `rollouts`: tensors of the rollouts an asynchronous generator had in flight (in the state, beside the
    optimiser's moments)."""
    state = {"scheduler": scheduler.state_dict(), "algorithm": algorithm.state_dict(), "rng": rng_state(generators),
             "progress": dict(vars(progress)), "watch": watch.state_dict(),
             "amp": roles.precision.state_dict(),  # fp16's loss scale and skipped steps
             "in_flight_rollouts": rollouts or {}}
    if sharded:
        return {}, state
    return trainable_weights(role_modules(roles)), {"optimizer": optimizer.state_dict(), **state}


def unpack_online(resumed: Resumed, roles: PolicyRoles, optimizer, scheduler, algorithm,
                  generators: dict[str, torch.Generator], watch: RunWatch, trained=None) -> Progress:
    """Put a checkpoint back into freshly built roles / optimiser / ...; returns the loop's position.
    `trained`: the sharded layout's Wrapped trained module (FSDP2, DeepSpeed), whose weights and moments come
    from `step-N/sharded/`."""
    state = resumed.state
    where = str(resumed.checkpoint / "state.safetensors")
    if trained is not None:
        load_optimiser(optimizer, scheduler, state, where,
                       load_moments=lambda: trained.load_sharded(optimizer, resumed.checkpoint / SHARDED))
    else:
        load_trainable_weights(role_modules(roles), resumed.weights, str(resumed.checkpoint / "model.safetensors"))
        load_optimiser(optimizer, scheduler, state, where)  # config's lr etc.
    algorithm.load_state_dict(state["algorithm"])
    watch.load_state_dict(state["watch"])
    roles.precision.load_state_dict(state.get("amp", {}))
    restore_rng(state["rng"], generators)
    return Progress(**state["progress"])
