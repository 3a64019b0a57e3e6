"""Half precision and training: whole weights train in float32, adapters on a half base in their own dtype.

DESIGN.md: half-precision weights are never updated in place by AdamW without float32 master
weights. bf16 keeps 8 significant bits, so a weight w only moves in steps of ~0.4 % of |w| (fp16:
~0.05 %); an AdamW step of lr ~1e-5 on a weight of ~0.02 is 0.05 % and rounds away entirely.

Rule used everywhere (SFT, reward model, PPO policy and separate value model, `dtype=auto` included):
- a model whose whole weights train (no LoRA) and that was loaded in bf16 / fp16 is cast to float32
  before its optimiser is built, and trains, and is saved, in float32: the weights themselves are the
  float32 master copy. That costs the same memory as bf16 weights plus float32 master copies would
  (4 bytes a weight either way once AdamW's two float32 moments are counted: 16 vs 16-18 bytes);
  what it gives up is bf16 matmul speed, which a CPU mostly does not have;
- under LoRA the frozen base stays in the dtype asked for; peft keeps the adapters in float32
  (`autocast_adapter_dtype`), and every trainable tensor is float32;
- `check_trainable_float32` is asserted where every optimiser is built (trainers/setup.py).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

HALF_DTYPES = (torch.bfloat16, torch.float16)


def half_trainable(module: nn.Module) -> list[str]:
    """Names of the trainable parameters stored in bf16 / fp16."""
    return [name for name, p in module.named_parameters() if p.requires_grad and p.dtype in HALF_DTYPES]


def float32_for_training(module: nn.Module, what: str) -> nn.Module:
    """Cast `module` to float32 (in place) when any of its trainable parameters is half precision.

    Frozen half-precision parts of a LoRA model have no trainable parameter and stay as they are."""
    half = half_trainable(module)
    if not half:
        return module
    dtype = next(p.dtype for p in module.parameters() if p.requires_grad and p.dtype in HALF_DTYPES)
    logger.info("%s: its whole weights train, so its %s weights are cast to float32 and trained and saved in "
                "float32 (AdamW steps below ~0.4 %% of a bf16 weight would round away); for half-precision "
                "memory, train LoRA adapters on the half-precision base (--lora_r 8)", what,
                str(dtype).removeprefix("torch."))
    return module.float()


def check_trainable_float32(params) -> None:
    """Raise when an optimiser would update a half-precision tensor in place (no float32 master copy)."""
    half = [tuple(p.shape) for p in params if p.requires_grad and p.dtype in HALF_DTYPES]
    if half:
        raise TypeError(f"{len(half)} trainable tensors are half precision (shapes {half[:3]}...): AdamW would "
                        "round small updates away; cast the model with models.float32_for_training first")
