"""The last part of every optimiser update, guarded against NaN / inf (docs/reading-a-run.md "Checkpoints and resume").

`nonfinite="stop"` (default): a non-finite loss or gradient norm raises FloatingPointError;
the trainer adds the step and the batch's rows to the message, and no checkpoint or model
is written after it (the CLI exits 3). `nonfinite="skip"`: the update is dropped (gradients
zeroed, no AdamW step and no LR-schedule step, so the schedule counts applied updates only,
as torch.amp's GradScaler does) and the trainer counts it in `nonfinite/skipped_updates`.

fp16 (models/precision.py): the loss was scaled before backward; here the gradients are unscaled before
clipping, and a step whose gradients are inf / NaN although the loss is finite is an expected overflow, not
an error in either mode: skipped (no AdamW or LR-schedule step), counted in `amp/skipped_steps`, the scale
halved. A non-finite loss is no overflow (the scale does not touch the forward) and follows `mode`, and so
does a non-finite gradient once the scale is below `MIN_SCALE`: scaling no longer explains it.
"""

from __future__ import annotations

import math

import torch

from rlhflab import parallel
from rlhflab.models.precision import MixedPrecision, skip_overflow

# Below a loss scale of 1 an inf / NaN gradient is no fp16 overflow of the scaled loss but a real one (torch's
# GradScaler.update warns likewise): from 2**16 that is 17 overflows in a row without a good step between
MIN_SCALE = 1.0

def clip_and_step(optimizer, scheduler, params, max_grad_norm: float, loss: float, mode: str,
                  stage: str, engine: parallel.Wrapped | None = None,
                  precision: MixedPrecision | None = None) -> torch.Tensor | None:
    """Clip the gradient norm, step AdamW and the LR schedule (None: a step that leaves the schedule where it is,
    e.g. the first of two parts of one minibatch); the gradient norm, or None when skipped
    (`precision.overflowed` then says whether fp16's scaler skipped it, module doc).
    `engine`: the trained model's Wrapped; when it steps itself (DeepSpeed) it clips and steps instead."""
    if precision is not None:
        precision.overflowed = False
    if engine is not None and engine.steps_itself:  # no scaler there: fp16 under DeepSpeed is refused at setup
        return engine_step(engine, scheduler, loss, mode, stage)
    scaler = precision.scaler if precision is not None else None
    lr = optimizer.param_groups[0]["lr"]
    problem = f"non-finite {stage} loss {loss}" if not math.isfinite(loss) else None
    if problem is None:
        if scaler is not None:
            scaler.unscale_(optimizer)  # the gradients' true size before they are clipped
        clip = max_grad_norm if max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor; the norm over every rank's shards
            grad_norm = grad_norm.full_tensor()
        if not torch.isfinite(grad_norm) and scaler is not None and scaler.get_scale() >= MIN_SCALE:  # expected
            skip_overflow(precision)
            optimizer.zero_grad(set_to_none=True)
            return None
        if not torch.isfinite(grad_norm):
            problem = f"non-finite {stage} gradient norm"
    if problem is not None:
        if mode == "stop":
            raise FloatingPointError(f"{problem} at lr {lr:.2e}")
        if scaler is not None:  # forget this step's unscale_ (the next step would refuse to unscale again)
            scaler.update(scaler.get_scale())
        optimizer.zero_grad(set_to_none=True)
        return None
    if scaler is not None:
        scaler.step(optimizer)  # steps: every gradient is finite (the norm over all ranks' is)
        scaler.update()
    else:
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def engine_step(engine: parallel.Wrapped, scheduler, loss: float, mode: str, stage: str) -> torch.Tensor | None:
    """`clip_and_step` through an engine that clips and steps itself (DeepSpeed). Its norm is known only inside
    its step, where it drops an update whose norm is not finite (DeepSpeed's overflow rule): that is the skip.
    A non-finite loss whose gradients are finite is applied there, so it ends the run in either mode."""
    lr = scheduler.get_last_lr()[0] if scheduler is not None else float("nan")
    if not math.isfinite(loss) and mode == "stop":
        raise FloatingPointError(f"non-finite {stage} loss {loss} at lr {lr:.2e}")
    grad_norm = engine.step()
    dropped = not torch.isfinite(grad_norm)
    if not dropped and math.isfinite(loss):
        if scheduler is not None:
            scheduler.step()
        return grad_norm
    if mode == "stop":
        raise FloatingPointError(f"non-finite {stage} gradient norm at lr {lr:.2e}")
    if not dropped:
        raise FloatingPointError(f"non-finite {stage} loss {loss} at lr {lr:.2e} with finite gradients: the DeepSpeed "
                                 "engine applied the update (it drops only non-finite gradients)")
    return None


def guarded_step(train_step, where: str, rows: str, skipped: int, mode: str) -> tuple[dict, int]:
    """Run one SFT / RM optimiser step; a stop names `where` and the batch's `rows`, a skip is counted.

    Returns the step's stats (with the running `nonfinite/skipped_updates` in skip mode) and the new count.
    """
    try:
        stats = train_step()
    except FloatingPointError as err:
        raise FloatingPointError(f"{where}: {err} ({rows}); no checkpoint or model written after it") from err
    skipped += stats.pop("skipped")
    if mode == "skip":
        stats["nonfinite/skipped_updates"] = skipped
    return stats, skipped
