"""A trainable (or frozen) model wrapped by the engine a strategy names: none, DDP, FSDP2, DeepSpeed.

    wrapped = parallel.wrap_model(model, world, cfg.parallel_strategy)
    optimizer = wrapped.prepare(make_optimizer(wrapped.model.parameters(), cfg), cfg.max_grad_norm)
    #   ^ after wrapping: FSDP2 swaps the parameters, DeepSpeed builds its engine around the AdamW
    with wrapped.sync(last_micro_batch):
        loss_part = wrapped(completion_loss_sum, batch) / global_tokens   # fn(model, ...) through the engine
        wrapped.backward(loss_part)                                        # sum over ranks = the global loss
    grad_norm = wrapped.step() if wrapped.steps_itself else ...           # DeepSpeed clips and steps itself
    with wrapped.gathered() as plain:                                      # rank 0: a plain model, else None
        ...evaluate / save on rank 0...

Why `wrapped(fn, ...)`: the engines hook the forward of the module they wrap (DDP prepares its gradient
all-reduce there; FSDP2 all-gathers a layer's shards there). Our forwards take other paths too — a
reward model's trunk then its score head, the packed pair forward that reads weights directly — so the
engine wraps a small module whose forward *is* `fn(model, ...)`: every training forward goes through it.

FSDP2 (`fully_shard` on each decoder layer, then on that module as the root) keeps only shards of the
weights on each rank. Forwards that read whole weights directly (the lean paths of `models`) cannot
run on it: `holds_shards(model)` says when to take the ordinary forward. Rank 0 keeps one plain copy
of the model for held-out evaluation and the final save (`gathered`): it costs one model's memory
there, and keeps evaluation the single-process one, bit for bit.

DeepSpeed ZeRO-2 / ZeRO-3 (parallel/deepspeed_engine.py) wraps the same `_Forward`; ZeRO-3 partitions the
weights, so rank 0 keeps a plain copy there too (every rank with `plain_on_every_rank`, to generate from).
Its engine clips and steps the optimiser itself (`step`); a step abandoned half-way is handed to it as a
non-finite one (`drop_step`), which it drops with every gradient accumulated so far.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from rlhflab.errors import UserInputError
from rlhflab.parallel.world import World

log = logging.getLogger("rlhflab")

STRATEGIES = ("auto", "ddp", "fsdp2", "deepspeed")


class _DeepSpeedCpuNotice(logging.Filter):
    """Drops DeepSpeed's "Setting accelerator to CPU" warning until `parallel_strategy deepspeed` is in use.

    Without DeepSpeed in the run it still printed on every CPU run that saved a model: transformers'
    `save_pretrained` unwraps the model through accelerate's `extract_model_from_parallel`, which imports deepspeed
    whenever it is installed (to test `isinstance(model, DeepSpeedEngine)`), and DeepSpeed picks its accelerator at
    import, warning when it finds no GPU (issue 32 item 5). The filter goes on the "DeepSpeed" logger before
    deepspeed exists: its LoggerFactory resets that logger's level and handler at import, but keeps its filters."""

    deepspeed_in_use = False

    def filter(self, record: logging.LogRecord) -> bool:
        return self.deepspeed_in_use or not record.getMessage().startswith("Setting accelerator to CPU")


DEEPSPEED_CPU_NOTICE = _DeepSpeedCpuNotice()
logging.getLogger("DeepSpeed").addFilter(DEEPSPEED_CPU_NOTICE)


@dataclass(frozen=True)
class Layout:
    """How a run's processes hold the trained model: what a checkpoint records and a resume must match."""

    strategy: str  # "none" (one process), "ddp", "fsdp2", "deepspeed"
    world: World

    @property
    def sharded(self) -> bool:
        """Each rank holds only part of the optimiser state (and FSDP2 / ZeRO-3: of the weights): each rank saves
        its own (torch.distributed.checkpoint, or DeepSpeed's checkpoint)."""
        return self.strategy in ("fsdp2", "deepspeed")

    def describe(self) -> dict:
        return {"strategy": self.strategy, "world_size": self.world.world_size, "sharded_state": self.sharded}


def resolve_strategy(requested: str, world: World) -> str:
    """'none' in one process; 'auto' = what `accelerate launch --config_file` asked for (FSDP, DeepSpeed), else ddp."""
    if requested not in STRATEGIES:
        raise UserInputError(f"unknown parallel_strategy '{requested}'", "--parallel_strategy",
                             f"use one of {', '.join(STRATEGIES)}")
    if not world.distributed:
        return "none"
    if requested != "auto":
        return requested
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return "deepspeed"
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return "fsdp2"
    return "ddp"


_ZERO3_MODELS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # wrapped for ZeRO-3 (partitioned at `prepare`)


def holds_shards(model: nn.Module) -> bool:
    """Whether the model's parameters are FSDP2 shards (DTensors) or ZeRO-3 partitions: then no forward may
    read whole weights."""
    return model in _ZERO3_MODELS or any(type(p).__name__ == "DTensor" for p in model.parameters())


class _Forward(nn.Module):
    """What the engine wraps: its forward runs `fn(model, *args, **kwargs)` (see the module doc)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn: Callable, *args, **kwargs):
        return fn(self.model, *args, **kwargs)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the classes transformers lists in `_no_split_modules` (accelerate's
    FSDP auto-wrap reads the same list), found inside a PeftModel too."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise UserInputError(f"{type(base).__name__} names no decoder-layer class (_no_split_modules), so FSDP2 "
                             "cannot shard it layer by layer", "--parallel_strategy fsdp2", "use ddp")
    return layers


class Wrapped:
    """A model and the engine around it; see the module doc for the calls a trainer makes."""

    def __init__(self, model: nn.Module, engine: nn.Module | None, layout: Layout, plain: nn.Module | None = None,
                 zero_stage: int = 0):
        self.model = model  # as built: parameter names unchanged (FSDP2: DTensor shards)
        self.engine = engine  # the wrapped _Forward (DeepSpeed: None until `prepare`)
        self.layout = layout
        self._plain = plain  # FSDP2, ZeRO-3, rank 0: an unsharded copy that `gathered` fills
        self.zero_stage = zero_stage  # DeepSpeed's ZeRO stage (2 or 3), else 0

    @property
    def world(self) -> World:
        return self.layout.world

    @property
    def strategy(self) -> str:
        return self.layout.strategy

    @property
    def same_passes(self) -> bool:
        """Every rank must run the same forward / backward passes: under FSDP2 and DeepSpeed each is a collective
        (DDP's no_sync micro-batches communicate nothing, so there ranks may run different counts)."""
        return self.strategy in ("fsdp2", "deepspeed")

    @property
    def steps_itself(self) -> bool:
        """The engine clips and steps the optimiser (DeepSpeed): call `step`, not clip_grad_norm_ / optimizer.step."""
        return self.strategy == "deepspeed"

    def prepare(self, optimizer: torch.optim.Optimizer, max_grad_norm: float) -> torch.optim.Optimizer:
        """The optimiser to schedule and checkpoint. DeepSpeed builds its engine around it here (ZeRO
        partitions its state; clipping at `max_grad_norm` happens inside `step`); other strategies: as is."""
        if self.strategy == "deepspeed":
            from rlhflab.parallel import deepspeed_engine

            self.engine = deepspeed_engine.initialize(_Forward(self.model), optimizer, self.world, self.zero_stage,
                                                      max_grad_norm)
        return optimizer

    def step(self) -> torch.Tensor:
        """DeepSpeed: clip and step (the engine drops a step whose gradient norm is not finite); the norm before
        clipping, inf when dropped. Gradients are zeroed for the next step."""
        from rlhflab.parallel import deepspeed_engine

        self.engine.step()
        return deepspeed_engine.grad_norm(self.engine)

    def drop_step(self, loss_part: torch.Tensor) -> None:
        """Every rank, instead of this micro-batch's backward, when the step is abandoned half-way (a non-finite
        loss): DeepSpeed has reduced the earlier micro-batches' gradients into its own buffers, which only its
        step clears. A NaN-scaled backward, marked as the step's last, makes every gradient non-finite: the
        engine's `step` then drops the update and clears those buffers (its overflow rule; `step` returns inf).
        Other strategies: nothing (the trainer zeroes `.grad` itself)."""
        if self.strategy != "deepspeed":
            return
        self.engine.set_gradient_accumulation_boundary(True)
        self.backward(loss_part * float("nan"))

    def __call__(self, fn: Callable, *args, **kwargs):
        """`fn(model, *args, **kwargs)` as a forward of the engine (gradient hooks, shard gathering)."""
        if self.engine is None:
            raise RuntimeError("parallel_strategy deepspeed: call wrapped.prepare(optimizer, ...) before a forward")
        return self.engine(fn, *args, **kwargs)

    def backward(self, loss_part: torch.Tensor) -> None:
        """Backward of this rank's part of the global loss (the parts sum to it over ranks). The engines
        average gradients over ranks, so the part is scaled by the world size first."""
        scale = self.world.world_size if self.world.distributed else 1
        loss = loss_part * scale if scale != 1 else loss_part
        if self.strategy == "deepspeed":
            self.engine.backward(loss, scale_wrt_gas=False)  # the trainer normalised by the whole step already
        else:
            loss.backward()

    @contextlib.contextmanager
    def sync(self, enabled: bool = True) -> Iterator[None]:
        """Wrap forward and backward of a micro-batch: gradients are reduced over ranks only when `enabled`
        (the step's last micro-batch); the others accumulate locally, the same sum with fewer collectives."""
        if enabled or self.strategy == "none":
            yield
        elif self.strategy == "ddp":
            with self.engine.no_sync():
                yield
        elif self.strategy == "fsdp2":
            self.engine.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.engine.set_requires_gradient_sync(True)
        else:  # deepspeed: the engine reduces and steps at the backward marked as the step's last
            self.engine.set_gradient_accumulation_boundary(False)
            try:
                yield
            finally:
                self.engine.set_gradient_accumulation_boundary(True)

    @contextlib.contextmanager
    def gathered(self, all_ranks: bool = False) -> Iterator[nn.Module | None]:
        """Rank 0: a plain (unwrapped, whole-weight) model holding the current weights; other ranks: None.
        Every rank must enter it (FSDP2 gathers the shards here). `all_ranks`: every rank gets one (FSDP2:
        only when wrapped with `plain_on_every_rank`), e.g. for every rank to generate from."""
        if self.strategy not in ("fsdp2", "deepspeed") or self.zero_stage == 2:  # whole weights on every rank
            yield self.model if self.world.is_main or all_ranks else None
            return
        if self.strategy == "deepspeed" and all_ranks:  # ZeRO-3 on every rank: gathered straight into the copy
            from rlhflab.parallel import deepspeed_engine

            if self._plain is None:
                raise RuntimeError("ZeRO-3 gathers whole weights on every rank only when wrapped with "
                                   "plain_on_every_rank")
            deepspeed_engine.fill_whole(self.engine, self._plain)  # collective
            self._plain.train(self.model.training)
            yield self._plain
            return
        full = self._whole_state(all_ranks)  # collective; whole on rank 0 (or on every rank)
        if self._plain is None or not (self.world.is_main or all_ranks):
            yield None
            return
        self._plain.load_state_dict(full)
        self._plain.train(self.model.training)
        yield self._plain

    def _whole_state(self, all_ranks: bool) -> dict[str, torch.Tensor]:
        if self.strategy == "fsdp2":
            from rlhflab.parallel.state import full_model_state

            return full_model_state(self.model, every_rank=all_ranks)
        from rlhflab.parallel import deepspeed_engine

        return deepspeed_engine.whole_state(self.engine, self.zero_stage) or {}

    @contextlib.contextmanager
    def whole_parameters(self, enabled: bool = True) -> Iterator[None]:
        """Every rank enters: inside, the trained parameters hold their whole values on every rank (ZeRO-3 gathers
        its partitions; rank 0's changes are partitioned back on exit), e.g. to copy or restore a best policy.
        Other strategies: a no-op (FSDP2 parameters gather themselves through `full_tensor`)."""
        if not enabled or self.strategy != "deepspeed" or self.zero_stage != 3:
            yield
            return
        from rlhflab.parallel import deepspeed_engine

        with deepspeed_engine.gathered_parameters([p for p in self.model.parameters() if p.requires_grad]):
            yield

    def save_sharded(self, optimizer: torch.optim.Optimizer, folder: Path) -> None:
        """Every rank writes its part of the trainable weights and optimiser state into `folder` (a collective)."""
        if self.strategy == "deepspeed":
            from rlhflab.parallel import deepspeed_engine

            deepspeed_engine.save_state(self.engine, folder, self.zero_stage, self.world.is_main)
            return
        from rlhflab.parallel.state import save_sharded

        save_sharded(self.model, optimizer, folder)

    def load_sharded(self, optimizer: torch.optim.Optimizer, folder: Path) -> None:
        """`save_sharded`'s folder back, on every rank, into a model wrapped (and prepared) the same way."""
        if self.strategy == "deepspeed":
            from rlhflab.parallel import deepspeed_engine

            deepspeed_engine.load_state(self.engine, folder, self.zero_stage)
            return
        from rlhflab.parallel.state import load_sharded

        load_sharded(self.model, optimizer, folder)


def _broadcast_parameters(model: nn.Module) -> None:
    """Rank 0's weights everywhere, so the shards FSDP2 keeps all come from one model (DDP does it itself)."""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)


def _fsdp2(model: nn.Module, world: World, keep_plain: bool,
           every_rank: bool = False) -> tuple[nn.Module, nn.Module | None]:
    from torch.distributed.fsdp import fully_shard

    _broadcast_parameters(model)
    plain = copy.deepcopy(model) if keep_plain and (world.is_main or every_rank) else None
    for layer in decoder_layers(model):
        fully_shard(layer)
    engine = _Forward(model)
    fully_shard(engine)  # the root: embeddings, final norm, heads
    return engine, plain


def _ddp(model: nn.Module, world: World) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [world.device.index] if world.device.type == "cuda" else None
    return DistributedDataParallel(_Forward(model), device_ids=device_ids)


def require_deepspeed() -> None:
    if importlib.util.find_spec("deepspeed") is None:
        raise UserInputError("parallel_strategy deepspeed needs the deepspeed package, which is not installed",
                             "--parallel_strategy deepspeed",
                             "pip install 'rlhflab[deepspeed]', or use fsdp2: torch's own sharding "
                             "of weights, gradients and optimiser state, ZeRO-3's equivalent")


def _deepspeed(model: nn.Module, world: World, layout: Layout, every_rank: bool = False) -> Wrapped:
    """A DeepSpeed Wrapped without its engine yet (`prepare` builds it around the optimiser)."""
    from rlhflab.parallel import deepspeed_engine

    require_deepspeed()
    DEEPSPEED_CPU_NOTICE.deepspeed_in_use = True  # DeepSpeed on a CPU is worth its warning
    deepspeed_engine.check_launch_settings()
    stage = deepspeed_engine.zero_stage()
    plain = None
    if stage == 3:  # ZeRO-3 partitions the weights: rank 0 (or every rank) keeps a plain copy to evaluate and save
        _ZERO3_MODELS.add(model)
        plain = copy.deepcopy(model) if world.is_main or every_rank else None
    return Wrapped(model, None, layout, plain, zero_stage=stage)


def wrap_model(model: nn.Module, world: World, strategy: str = "auto",
               plain_on_every_rank: bool = False) -> Wrapped:
    """`model` (already on `world.device`, LoRA applied) wrapped for training by `strategy`; build the
    optimiser afterwards, on `wrapped.model.parameters()`. `plain_on_every_rank` (FSDP2, ZeRO-3): every rank keeps
    a whole-weight copy for `gathered(all_ranks=True)` (the online loop generates on every rank).
    DeepSpeed: the engine is built by `wrapped.prepare(optimizer, max_grad_norm)`."""
    layout = Layout(resolve_strategy(strategy, world), world)
    if layout.strategy == "none":
        return Wrapped(model, _Forward(model), layout)
    if layout.strategy == "ddp":
        return Wrapped(model, _ddp(model, world), layout)
    if layout.strategy == "fsdp2":
        engine, plain = _fsdp2(model, world, keep_plain=True, every_rank=plain_on_every_rank)
        return Wrapped(model, engine, layout, plain)
    return _deepspeed(model, world, layout, every_rank=plain_on_every_rank)


def wrap_frozen(model: nn.Module, world: World, strategy: str = "auto", shard: bool = True) -> Wrapped:
    """A model that never trains (reference, reward model): under FSDP2 sharded like the policy when
    `shard` (every rank must then run its forwards in lockstep), else replicated on every rank (DeepSpeed too:
    a frozen model has no optimiser state for ZeRO to partition)."""
    model.requires_grad_(False)
    layout = Layout(resolve_strategy(strategy, world), world)
    if layout.strategy == "fsdp2" and shard:
        engine, _ = _fsdp2(model, world, keep_plain=False)
        return Wrapped(model, engine, layout)
    return Wrapped(model, _Forward(model), Layout("none" if not world.distributed else "replicated", world))
