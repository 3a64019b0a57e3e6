"""DeepSpeed ZeRO-2 / ZeRO-3 as the engine of a `Wrapped` model (`parallel_strategy deepspeed`).

DeepSpeed builds its engine around the model *and* its optimiser (ZeRO partitions the optimiser state), so a
DeepSpeed `Wrapped` is finished by `wrapped.prepare(optimizer, max_grad_norm)` once the AdamW exists; the
other strategies return the optimiser untouched there. The engine then owns the update: it reduces the
gradients (ZeRO-2: to the rank that owns each slice; ZeRO-3 also gathers each layer's weights around its
forward), clips them to `max_grad_norm` and steps AdamW on its slice (`Wrapped.step`).

Settings come from accelerate: `accelerate launch --config_file configs/accelerate/zero3.yaml` hands each
process its `zero_stage` and offload devices as ACCELERATE_DEEPSPEED_* variables; under torchrun set
ACCELERATE_DEEPSPEED_ZERO_STAGE yourself (unset: 2, accelerate's default). Everything else is rlhflab's:
float32 weights (models/precision.py; no fp16 / bf16 section, so ZeRO keeps no second copy), clipping from
`--max_grad_norm`, micro-batches cut by the trainer, which marks the step's last backward
(`set_gradient_accumulation_boundary`) instead of telling DeepSpeed a fixed accumulation count.

Every forward of ZeRO-3 and every backward of both stages is a collective: ranks run the same passes (the
trainers take the padded path with zero-weight rows, as under FSDP2; `holds_shards` says so).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from torch import nn

from rlhflab.errors import UserInputError
from rlhflab.parallel.world import World

STAGES = (2, 3)
_TAG = "engine"  # the one checkpoint DeepSpeed writes into a step's sharded/ folder
_STAGE_FILE = "zero.json"
_LAUNCH_FIX = "set zero_stage 2 or 3 in the accelerate config (or ACCELERATE_DEEPSPEED_ZERO_STAGE under torchrun)"


def zero_stage() -> int:
    """The ZeRO stage the launch asked for (accelerate sets ACCELERATE_DEEPSPEED_ZERO_STAGE from its config)."""
    raw = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    if not raw.isdigit() or int(raw) not in STAGES:
        raise UserInputError(f"ZeRO stage {raw!r} is not wired: rlhflab runs DeepSpeed ZeRO-2 and ZeRO-3",
                             "ACCELERATE_DEEPSPEED_ZERO_STAGE", f"{_LAUNCH_FIX}; for whole copies use ddp")
    return int(raw)


def check_launch_settings() -> None:
    """Refuse the accelerate DeepSpeed settings rlhflab would otherwise ignore silently."""
    if os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        raise UserInputError("a deepspeed_config_file is not read by rlhflab (it builds the engine's config from "
                             "the accelerate settings and its own flags)", "ACCELERATE_DEEPSPEED_CONFIG_FILE",
                             f"drop deepspeed_config_file and {_LAUNCH_FIX}")
    for what, held in (("optimizer", "optimiser state"), ("param", "weights")):
        device = os.environ.get(f"ACCELERATE_DEEPSPEED_OFFLOAD_{what.upper()}_DEVICE", "none")
        if device != "none":
            raise UserInputError(f"ZeRO offload of the {held} to {device} is not wired (offloaded, the engine "
                                 "steps its own CPU AdamW, not rlhflab's)", f"offload_{what}_device in the accelerate "
                                 "config", "set it to none; for less memory a process, run more processes")


# Test hook: DeepSpeed keeps parameters under 1e5 elements whole on every rank under ZeRO-3 ("persistent"), i.e.
# every weight of the tests' tiny models; the tests set 0 so that ZeRO-3 partitions them all.
PERSISTENCE_VARIABLE = "RLHFLAB_ZERO3_PERSISTENCE_THRESHOLD"


def engine_config(world: World, stage: int, max_grad_norm: float) -> dict:
    """DeepSpeed's config: one micro-batch per step as far as it knows (the trainer marks the boundary)."""
    zero: dict = {"stage": stage}
    if stage == 3 and os.environ.get(PERSISTENCE_VARIABLE, "").isdigit():
        zero["stage3_param_persistence_threshold"] = int(os.environ[PERSISTENCE_VARIABLE])
    return {
        "train_batch_size": world.world_size,  # DeepSpeed checks micro x accumulation x ranks; it batches nothing
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": max_grad_norm if max_grad_norm > 0 else 0.0,
        "zero_optimization": zero,
        "steps_per_print": 2**31 - 1,  # rlhflab logs its own metrics
        "wall_clock_breakdown": False,
    }


def initialize(module: nn.Module, optimizer: torch.optim.Optimizer, world: World, stage: int,
               max_grad_norm: float):
    """`deepspeed.initialize` on the process group `init_world` made; returns the engine (`optimizer` stays
    the AdamW whose param_groups the LR schedule drives: ZeRO steps it on its own slice)."""
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if world.device.type == "cpu":
        # DeepSpeed compiles a shared-memory all-reduce with a C++ compiler when its communication starts (a
        # minute on 2 cores); it serves only its inference all-reduce. ZeRO training goes through gloo.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer,
                                      config=engine_config(world, stage, max_grad_norm))
    return engine


def grad_norm(engine) -> torch.Tensor:
    """The last step's gradient norm over every rank's slice, before clipping (what clip_grad_norm_ returns);
    inf when the engine dropped the step (a non-finite norm: DeepSpeed's overflow rule)."""
    norm = engine.get_global_grad_norm()
    return torch.tensor(float("nan") if norm is None else float(norm))


def whole_state(engine, stage: int, prefix: str = "model.") -> dict[str, torch.Tensor] | None:
    """The model's whole state dict on rank 0 (None elsewhere), names as the unwrapped model's. ZeRO-3
    gathers each layer's partitions in turn (a collective: every rank calls); ZeRO-2 holds whole weights."""
    if stage == 3:
        state = engine._zero3_consolidated_16bit_state_dict()  # float32 here: it keeps the weights' dtype
    else:
        state = engine.module.state_dict()
    if state is None:
        return None
    return {name.removeprefix(prefix): tensor for name, tensor in state.items()}


def fill_whole(engine, into: nn.Module, prefix: str = "model.") -> None:
    """ZeRO-3: `into` (a plain copy of the engine's module, on every rank) takes the whole current weights; each
    module's partitions are gathered in turn (a collective: every rank calls), so at most one module's whole
    weights are held beside the copy. Buffers are not partitioned: the copy keeps its own."""
    targets = dict(into.named_parameters(remove_duplicate=False))
    for module_name, module in engine.module.named_modules():
        own = list(module.named_parameters(recurse=False))
        if not own:
            continue
        with gathered_parameters([p for _, p in own], modifier_rank=None), torch.no_grad():
            for name, param in own:
                targets[f"{module_name}.{name}".removeprefix(prefix)].copy_(param)


def gathered_parameters(params: list[nn.Parameter], modifier_rank: int | None = 0):
    """ZeRO-3's context in which `params` hold their whole values on every rank; with `modifier_rank`, that
    rank's changes are partitioned back on exit (a collective on entry and exit)."""
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)


def save_state(engine, folder: Path, stage: int, is_main: bool) -> None:
    """Every rank writes its ZeRO slices of weights and AdamW state (DeepSpeed's own checkpoint) into `folder`;
    rank 0 notes the stage beside them (a checkpoint of one stage does not load into the other)."""
    engine.save_checkpoint(str(folder), tag=_TAG, save_latest=False)
    if is_main:
        (folder / _STAGE_FILE).write_text(json.dumps({"zero_stage": stage}))


def load_state(engine, folder: Path, stage: int) -> None:
    """`save_state`'s folder back into an engine built the same way (same stage and processes)."""
    written = json.loads((folder / _STAGE_FILE).read_text())["zero_stage"]
    if written != stage:
        raise UserInputError(f"the checkpoint holds ZeRO-{written} slices; this run is ZeRO-{stage}", str(folder),
                             f"resume with zero_stage {written} in the accelerate config (or "
                             f"ACCELERATE_DEEPSPEED_ZERO_STAGE={written} under torchrun)")
    loaded, _ = engine.load_checkpoint(str(folder), tag=_TAG, load_optimizer_states=True,
                                       load_lr_scheduler_states=False)
    if loaded is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint in {folder}")
