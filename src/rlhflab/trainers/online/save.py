"""Write what an online run trained as ordinary HF folders, each whole or not at all (checkpoint.atomic_folder)."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import save_file

from rlhflab import models
from rlhflab.checkpoint import atomic_folder, weight_bytes
from rlhflab.rollout.roles import PolicyRoles


def save_policy_models(roles: PolicyRoles, tokenizer, run_path: Path) -> Path:
    """policy -> model/ (LoRA merged, so plain transformers loads it), adapter/ if LoRA,
    value head / value model -> value/ (with a critic). model/ is renamed into place last, so a model/ folder
    means its run's value/ and adapter/ were complete before it; a failed write is a `WriteFailed` naming it."""
    model_dir = run_path / "model"
    if roles.value_mode != "none":
        needed = weight_bytes(roles.value_model, roles.value_head)
        with atomic_folder(run_path / "value", "the final value folder", run_path, needed) as value_dir:
            if roles.value_model is not None:
                roles.value_model.save_pretrained(value_dir)
            if roles.value_head is not None:
                state = {k: v.detach().contiguous() for k, v in roles.value_head.state_dict().items()}
                save_file(state, str(value_dir / "value_head.safetensors"))
    policy = roles.policy
    needed = weight_bytes(policy)
    if roles.lora:
        with atomic_folder(run_path / "adapter", "the final adapter folder", run_path, needed) as adapter_dir:
            policy.save_pretrained(str(adapter_dir))
        if roles.value_mode == "lora_adapter":
            policy.delete_adapter("value")
        policy = policy.merge_and_unload()
    with atomic_folder(model_dir, "the final model folder", run_path, needed) as tmp:
        models.save_model_folder(tmp, policy, tokenizer)
    return model_dir
