"""Gradient checkpointing: each decoder layer's activations are recomputed in the backward instead of kept.

One switch for every model a stage trains (`--gradient_checkpointing`: the policy, a separate value model,
the reward model; frozen references and reward models run without grad and need none):
- the Hugging Face forward: the model's own checkpointing (`activation_checkpointing_enable`, called
  `gradient_checkpointing_enable` before transformers 5) with use_reentrant=False;
- the lean forward (models/lean.py) reads the same per-model flag (`plan_lean` -> `LeanPlan.checkpoint`)
  and runs each of its decoder layers under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`.
Both act only in training mode with autograd on, as HF's layers do: evaluation, generation and the
rollout's no-grad forwards run exactly as without it. The gradients are the same numbers (the recompute
repeats the forward's ops on the same inputs; tests/models/test_gradient_checkpointing.py).

Why use_reentrant=False: the non-reentrant checkpoint needs no input that requires grad, so a LoRA model
on a frozen base needs no `enable_input_require_grads` hook (HF adds one anyway; it is taken off again here,
as it only makes the backward run down into the frozen embeddings); it also works under DDP without a
static graph and under FSDP2, whose hooks HF keeps outside the checkpointed `forward` (modeling_layers.py).
The cost: about one more forward of the trained model per backward.
"""

from __future__ import annotations

import logging

from torch import nn

from rlhflab.errors import UserInputError

log = logging.getLogger("rlhflab")

CHECKPOINT_KWARGS = {"use_reentrant": False}


def checkpointed_part(model: nn.Module) -> nn.Module:
    """The Hugging Face model whose decoder layers checkpoint: the model inside a PeftModel, a ValueModel's
    backbone, else the model itself."""
    if hasattr(model, "get_base_model"):
        return model.get_base_model()
    backbone = getattr(model, "backbone", None)  # models.ValueModel: trunk + value head
    return backbone if isinstance(backbone, nn.Module) else model


def _input_grad_hooked(model: nn.Module) -> bool:
    return bool(getattr(model, "_require_grads_hooks", None)) or hasattr(model, "_require_grads_hook")


def enable_gradient_checkpointing(model: nn.Module, what: str) -> nn.Module:
    """Turn checkpointing on for `model` (a causal LM, PeftModel, ValueModel or reward model), in place; logs
    it once. Call before the model is wrapped (DDP / FSDP2 / DeepSpeed) and before any deep copy of it."""
    target = checkpointed_part(model)
    if not getattr(target, "supports_gradient_checkpointing", False):
        raise UserInputError(f"{what}: {type(target).__name__} does not support gradient checkpointing",
                             "--gradient_checkpointing", "leave it off for this model")
    hooked = _input_grad_hooked(target)
    if hasattr(target, "activation_checkpointing_enable"):  # transformers >= 5; the old name warns there
        target.activation_checkpointing_enable(activation_checkpointing_kwargs=dict(CHECKPOINT_KWARGS))
    else:
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(CHECKPOINT_KWARGS))
    if not hooked and _input_grad_hooked(target):
        # HF's hook for reentrant checkpoints of adapters; non-reentrant ones need no input that requires grad
        target.disable_input_require_grads()
    log.info("%s: gradient checkpointing on (each decoder layer recomputed in the backward, use_reentrant=False)",
             what)
    return model


def checkpointing_on(model: nn.Module) -> bool:
    """Whether `enable_gradient_checkpointing` was applied to `model` (its decoder layers checkpoint when training)."""
    target = checkpointed_part(model)
    return any(getattr(m, "gradient_checkpointing", False) for m in target.modules())
