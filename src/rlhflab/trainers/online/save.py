"""Write what an online run trained as ordinary HF folders."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import save_file

from rlhflab import models
from rlhflab.rollout.roles import PolicyRoles


def save_policy_models(roles: PolicyRoles, tokenizer, run_path: Path) -> Path:
    """policy -> model/ (LoRA merged, so plain transformers loads it), adapter/ if LoRA,
    value head / value model -> value/ (with a critic)."""
    model_dir = run_path / "model"
    value_dir = run_path / "value"
    if roles.value_mode != "none":
        value_dir.mkdir(parents=True, exist_ok=True)
    if roles.value_model is not None:
        roles.value_model.save_pretrained(value_dir)
    if roles.value_head is not None:
        state = {k: v.detach().contiguous() for k, v in roles.value_head.state_dict().items()}
        save_file(state, str(value_dir / "value_head.safetensors"))
    policy = roles.policy
    if roles.lora:
        policy.save_pretrained(str(run_path / "adapter"))
        if roles.value_mode == "lora_adapter":
            policy.delete_adapter("value")
        policy = policy.merge_and_unload()
    models.save_model_folder(model_dir, policy, tokenizer)
    return model_dir
