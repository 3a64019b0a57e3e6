"""Half precision and training: float32 master weights, optional bf16 / fp16 autocast over them.

Two separate choices (docs/scaling-out.md "Precision"):
- storage (`--dtype`): how weights are loaded and kept. Frozen weights (a LoRA base, a reward model)
  stay in that dtype; whatever trains is float32 (below);
- compute (`--mixed_precision` / TRL's `--bf16` / `--fp16`, `resolve_precision`): forward passes run
  under `torch.autocast`, so matmuls run in bf16 / fp16 over the float32 masters, the accelerate way;
  fp16 adds a loss scaler (`MixedPrecision.scaler`, stepped by trainers/nonfinite.clip_and_step).

DESIGN.md: half-precision weights are never updated in place by AdamW without float32 master
weights. bf16 keeps 8 significant bits, so a weight w only moves in steps of ~0.4 % of |w| (fp16:
~0.05 %); an AdamW step of lr ~1e-5 on a weight of ~0.02 is 0.05 % and rounds away entirely.

Rule used everywhere (SFT, reward model, PPO policy and separate value model, `dtype=auto` included):
- a model whose whole weights train (no LoRA) and that was loaded in bf16 / fp16 is cast to float32
  before its optimiser is built, and trains, and is saved, in float32: the weights themselves are the
  float32 master copy. That costs the same memory as bf16 weights plus float32 master copies would
  (4 bytes a weight either way once AdamW's two float32 moments are counted: 16 vs 16-18 bytes);
  bf16 matmul speed comes back through autocast, which casts the masters for each forward;
- under LoRA the frozen base stays in the dtype asked for; peft keeps the adapters in float32
  (`autocast_adapter_dtype`), and every trainable tensor is float32;
- `check_trainable_float32` is asserted where every optimiser is built (trainers/setup.py).
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import ContextManager

import torch
from torch import nn

from rlhflab.errors import UserInputError

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


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def requested_precision(mixed_precision: str, bf16: bool, fp16: bool) -> tuple[str, str]:
    """The one choice the three fields make ("auto", "no", "bf16" or "fp16") and the flag that made it.

    `--bf16` / `--fp16` are TRL's names for `--mixed_precision bf16` / `fp16`; both set, or one that
    contradicts an explicit `--mixed_precision`, is refused rather than guessed."""
    if bf16 and fp16:
        raise UserInputError("--bf16 and --fp16 are both set", "--bf16 / --fp16", "set one of them")
    trl = "bf16" if bf16 else "fp16" if fp16 else None
    if trl is None:
        return mixed_precision, f"--mixed_precision {mixed_precision}"
    if mixed_precision not in ("auto", trl):
        raise UserInputError(f"--{trl} contradicts --mixed_precision {mixed_precision}",
                             f"--{trl} / --mixed_precision", f"drop one of them (--{trl} means --mixed_precision {trl})")
    return trl, f"--{trl}"


def resolve_precision(mixed_precision: str, bf16: bool, fp16: bool, device: torch.device,
                      strategy: str = "none") -> str:
    """"no", "bf16" or "fp16" for this device; raises before any model is loaded when the device cannot.

    auto = bf16 on a CUDA device that has it; float32 ("no") on a CPU, where autocast on the demo's small
    matmuls was slower than float32 (docs/scaling-out.md "Precision"). fp16 autocast on a CPU is refused (its point is
    a GPU's fp16 units; a CPU has bf16 or nothing), so is bf16 on a GPU without bf16 (pre-Ampere).
    DeepSpeed (`strategy`) scales fp16 losses with its own engine config, which rlhflab does not build."""
    choice, flag = requested_precision(mixed_precision, bf16, fp16)
    cuda = device.type == "cuda"
    has_bf16 = cuda and torch.cuda.is_bf16_supported()
    if choice == "auto":
        return "bf16" if has_bf16 else "no"
    if choice == "fp16" and not cuda:
        raise UserInputError(f"fp16 autocast on a {device.type} device: fp16 mixed precision is for CUDA GPUs",
                             flag, "use --bf16 (bf16 autocast) or --mixed_precision no (float32)")
    if choice == "bf16" and cuda and not has_bf16:
        raise UserInputError(f"this GPU ({torch.cuda.get_device_name(device)}) has no bf16", flag,
                             "use --fp16 (fp16 autocast with a loss scaler) or --mixed_precision no")
    if choice == "fp16" and strategy == "deepspeed":
        raise UserInputError("fp16 with parallel_strategy deepspeed: DeepSpeed scales fp16 losses in its own engine "
                             "config, which rlhflab does not build", flag,
                             "use --bf16 (autocast works inside DeepSpeed's forward), or --parallel_strategy ddp / fsdp2")
    return choice


class MixedPrecision:
    """The resolved choice for one run: `autocast()` around every forward, and for fp16 a loss scaler.

        with precision.autocast():
            loss = loss_fn(model, batch)     # matmuls in bf16 / fp16 over float32 weights
        precision.scale(loss).backward()     # backward outside autocast (torch's AMP recipe)
        clip_and_step(..., precision=precision)  # fp16: unscale, clip, skip a step with inf / NaN gradients

    The forwards whose numbers must agree (rollout, reference, training: ratio == 1 and KL == 0 at the first
    step) all run under the same `autocast()`, so they are the same casts and the same kernels."""

    def __init__(self, mode: str = "no", device_type: str = "cpu"):
        if mode not in ("no", *AUTOCAST_DTYPES):
            raise ValueError(f"mixed precision {mode!r}: use no, bf16 or fp16")
        self.mode, self.device_type = mode, device_type
        self.dtype = AUTOCAST_DTYPES.get(mode)  # None: float32, no autocast
        self.scaler = torch.amp.GradScaler(device_type) if mode == "fp16" else None
        self.skipped_steps = 0  # optimiser steps the scaler skipped (inf / NaN gradients)
        self.overflowed = False  # the last clip_and_step was such a skip

    def autocast(self) -> ContextManager:
        return torch.autocast(self.device_type, dtype=self.dtype) if self.dtype is not None else nullcontext()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: fp16 multiplies it by the scale so small gradients stay representable."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def metrics(self) -> dict:
        """`amp/scale` and `amp/skipped_steps` for metrics.jsonl (fp16 only)."""
        if self.scaler is None:
            return {}
        return {"amp/scale": float(self.scaler.get_scale()), "amp/skipped_steps": self.skipped_steps}

    def describe(self) -> dict:
        """What summary.json records."""
        return {"mixed_precision": self.mode, "autocast_dtype": str(self.dtype).removeprefix("torch.") if self.dtype
                else None, "device": self.device_type, "master_weights": "float32",
                **({"skipped_steps": self.skipped_steps} if self.scaler is not None else {})}

    def state_dict(self) -> dict:
        """The scaler's state, for exact resume (empty without fp16)."""
        if self.scaler is None:
            return {}
        return {"scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state["scaler"])
            self.skipped_steps = state["skipped_steps"]


def precision_from_config(cfg, device: torch.device, strategy: str = "none") -> MixedPrecision:
    """`resolve_precision` of a config's `mixed_precision` / `bf16` / `fp16` fields (config.PrecisionFields)."""
    mode = resolve_precision(cfg.mixed_precision, cfg.bf16, cfg.fp16, device, strategy)
    return MixedPrecision(mode, device.type)


def skip_overflow(precision: MixedPrecision) -> None:
    """After an fp16 step whose unscaled gradients hold inf / NaN (the optimiser step is skipped by the caller):
    count it and halve the scale, with GradScaler.update's rule (backoff, growth count back to 0). The verdict
    comes from the gradient norm over every rank, so every rank lowers its scale alike."""
    scaler = precision.scaler
    state = scaler.state_dict()
    scaler.update(state["scale"] * state["backoff_factor"])  # also forgets this step's unscale_
    scaler.load_state_dict({**scaler.state_dict(), "_growth_tracker": 0})
    precision.skipped_steps += 1
    precision.overflowed = True
