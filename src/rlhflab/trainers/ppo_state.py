"""What a PPO checkpoint holds, and how a resumed run puts it back.

Weights: every trainable tensor of the roles (the full policy, or its LoRA adapters;
the value head / value model / value adapter); the frozen base and reference come back
from `cfg.model`. State: AdamW and LR schedule, the KL controller, the RNGs (global
ones and the loop's `order` / `sampler` generators), the loop's position (update,
episode, the rest of the shuffled prompt order) and the last metrics the summary needs,
and the monitor's side (alarms, the rows it saw, the best policy so far).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlhflab.checkpoint import Resumed, load_trainable_weights, restore_rng, rng_state, trainable_weights
from rlhflab.checkpoint.state import load_optimiser
from rlhflab.rollout.roles import PolicyRoles
from rlhflab.trainers.ppo_monitor import RunWatch


@dataclass
class PPOProgress:
    """The loop's counters and the rows the final summary reads."""

    update: int = 0
    episode: int = 0
    order: list[int] = field(default_factory=list)  # prompt indices not yet drawn from the current pass
    first: dict = field(default_factory=dict)  # the step-0 evaluation
    last_eval: dict = field(default_factory=dict)
    last: dict = field(default_factory=dict)  # the last update's metrics
    finished: bool = False  # the loop ended (all updates, or the monitor stopped it)
    skipped: int = 0  # optimiser steps dropped by nonfinite=skip so far


def role_modules(roles: PolicyRoles) -> dict[str, torch.nn.Module]:
    named = {"policy": roles.policy, "value_head": roles.value_head, "value_model": roles.value_model}
    return {name: module for name, module in named.items() if module is not None}


def pack_ppo(roles: PolicyRoles, optimizer, scheduler, kl_ctl, generators: dict[str, torch.Generator],
             progress: PPOProgress, watch: RunWatch) -> tuple[dict[str, torch.Tensor], dict]:
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "kl_controller": kl_ctl.state_dict(), "rng": rng_state(generators),
             "progress": dict(vars(progress)), "watch": watch.state_dict()}
    return trainable_weights(role_modules(roles)), state


def unpack_ppo(resumed: Resumed, roles: PolicyRoles, optimizer, scheduler, kl_ctl,
               generators: dict[str, torch.Generator], watch: RunWatch) -> PPOProgress:
    """Put a checkpoint back into freshly built roles / optimiser / ...; returns the loop's position."""
    state = resumed.state
    load_trainable_weights(role_modules(roles), resumed.weights, str(resumed.checkpoint / "model.safetensors"))
    load_optimiser(optimizer, scheduler, state, str(resumed.checkpoint / "state.safetensors"))  # config's lr etc.
    kl_ctl.load_state_dict(state["kl_controller"])
    watch.load_state_dict(state["watch"])
    restore_rng(state["rng"], generators)
    return PPOProgress(**state["progress"])
