"""LoRA via peft, and the memory mode where policy, reference and value share one frozen backbone.

Memory mode (one base model in memory):
- policy    = LoRA adapter "default" (active by default);
- reference = the same model with adapters off: `with adapters_off(peft_model): ...`
  (LoRA's B starts at zero, so at init policy == reference exactly);
- value     = LoRA adapter "value" + a `ValueHead`, run inside `use_adapter(peft_model, "value")`.

peft finding (peft 0.21, tuners_utils.BaseTunerLayer.set_adapter): `set_adapter(name)`
sets requires_grad=True on `name` and requires_grad=False on EVERY OTHER adapter;
`add_adapter` calls `set_adapter(active_adapters)`, so a freshly added second adapter
starts frozen. `PeftModel.disable_adapter()` does the same on exit (it calls
`enable_adapter_layers` -> `set_adapter(active)`), so computing reference log-probs
with it freezes the value adapter. Switching naively would therefore freeze one
adapter's weights and the optimiser would silently stop updating them. So
`add_value_adapter` re-enables the new adapter's gradients, and `use_adapter` /
`adapters_off` restore every parameter's requires_grad flag as it was before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from torch import Tensor, nn

from rlhflab.errors import UserInputError
from rlhflab.models.value import ValueHead, last_hidden_state

if TYPE_CHECKING:  # peft (with accelerate) is imported by the functions that use it: full fine-tuning never loads it
    from peft import PeftModel


def apply_lora(
    model: nn.Module,
    r: int,
    alpha: float,
    dropout: float = 0.0,
    target_modules: str | list[str] = "all-linear",
    adapter_name: str = "default",
) -> PeftModel:
    """Wrap `model` with a LoRA adapter; only adapter weights (and a classifier's score) train."""
    if r <= 0:
        raise UserInputError(f"LoRA rank must be positive; got {r}", where="lora_r", fix="use e.g. lora_r=8")
    from peft import LoraConfig, get_peft_model
    # a reward model's `score` head is new and must train too (peft's SEQ_CLS adds it to modules_to_save)
    task_type = "SEQ_CLS" if isinstance(getattr(model, "score", None), nn.Module) else "CAUSAL_LM"
    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules, task_type=task_type
    )
    return get_peft_model(model, config, adapter_name=adapter_name)


def add_value_adapter(
    peft_model: PeftModel,
    r: int,
    alpha: float,
    adapter_name: str = "value",
    dropout: float = 0.0,
    target_modules: str | list[str] | None = None,
) -> ValueHead:
    """Add a second, trainable LoRA adapter on the same frozen base; returns a fresh `ValueHead` for it.

    `target_modules=None` reuses the active adapter's targets. The active adapter is unchanged.
    """
    if adapter_name in peft_model.peft_config:
        raise UserInputError(f"adapter {adapter_name!r} already exists", where="adapter_name",
                             fix="pick another name")
    from peft import LoraConfig
    active = peft_model.peft_config[peft_model.active_adapter]
    targets = target_modules if target_modules is not None else active.target_modules
    if isinstance(targets, set):
        targets = sorted(targets)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type="CAUSAL_LM")
    peft_model.add_adapter(adapter_name, config)
    peft_model.set_requires_grad(adapter_name, True)  # add_adapter left it frozen (see module docstring)
    hidden_size = peft_model.get_base_model().config.get_text_config().hidden_size
    return ValueHead(hidden_size)


@contextmanager
def _keep_requires_grad(model: nn.Module) -> Iterator[None]:
    """Restore every parameter's requires_grad flag on exit (peft's switches change them)."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        yield
    finally:
        for param, flag in flags:
            param.requires_grad_(flag)


@contextmanager
def use_adapter(peft_model: PeftModel, name: str) -> Iterator[PeftModel]:
    """Make `name` the active adapter inside the block; restore the previous one and all requires_grad flags."""
    if name not in peft_model.peft_config:
        raise UserInputError(f"no adapter named {name!r}", where="adapter",
                             fix=f"use one of {sorted(peft_model.peft_config)}")
    previous = peft_model.active_adapter
    with _keep_requires_grad(peft_model):
        try:
            peft_model.set_adapter(name)
            yield peft_model
        finally:
            peft_model.set_adapter(previous)


def _plain_lora_layers(peft_model: nn.Module) -> list[nn.Module] | None:
    """Every adapter layer of the model when all of them are plain, unmerged LoRA Linears (no DoRA, no
    LoRA bias, no modules_to_save wrapper); None otherwise, and callers fall back to peft's own switches."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    layers = []
    for module in peft_model.modules():
        if not hasattr(module, "_disable_adapters"):  # peft's tuner layers and wrappers all carry this flag
            continue
        if (type(module) is not LoraLinear or module.merged or module.fan_in_fan_out
                or any(module.use_dora.values()) or any(module.lora_bias.values())):
            return None
        layers.append(module)
    return layers


@contextmanager
def adapters_off(peft_model: PeftModel) -> Iterator[PeftModel]:
    """The reference model: the frozen base with every adapter off; trainability is kept as it was.

    With plain LoRA layers only each layer's off switch is flipped and restored: peft's
    `disable_adapter()` also walks the model for its status and rewrites requires_grad flags
    (module docstring), ~14 ms per call on the demo model (benchmarks/RESULTS.md).
    """
    layers = _plain_lora_layers(peft_model)
    if layers is None:
        with _keep_requires_grad(peft_model), peft_model.disable_adapter():
            yield peft_model
        return
    flags = [layer._disable_adapters for layer in layers]
    try:
        for layer in layers:
            layer._disable_adapters = True  # LoraLayer.forward then runs base_layer(x) only
        yield peft_model
    finally:
        for layer, flag in zip(layers, flags):
            layer._disable_adapters = flag


@contextmanager
def merged_adapter(peft_model: PeftModel) -> Iterator[PeftModel]:
    """Inference with the active adapter merged into temporary copies of the base weights.

    Each adapted Linear's weight tensor is swapped for a new one, W + scale * B @ A, and its
    adapter path switched off, so a forward costs what the plain model's does (peft's per-layer
    LoRA branch made generation ~1.5x slower, benchmarks/RESULTS.md). On exit the original weight
    tensors themselves are put back (not W' - BA, which differs from W by rounding), so the frozen
    base, i.e. the reference, stays bit-identical. On a bf16 / fp16 base the float32 deltas are added
    in float32 and the sum rounded once to the base's dtype. Memory: one extra copy of every adapted
    weight matrix while the block runs. No grad inside. Models with other adapter kinds run unmerged.
    """
    import torch

    layers = _plain_lora_layers(peft_model)
    saved = []
    try:
        with torch.no_grad():
            for layer in layers or []:
                active = [a for a in layer.active_adapters if a in layer.lora_A]
                if layer.disable_adapters or not active:
                    continue
                weight = layer.get_base_layer().weight
                delta = sum(layer.get_delta_weight(adapter) for adapter in active)
                # summed in the deltas' dtype (float32 where peft keeps A / B in float32 on a half base)
                # and rounded to the base's dtype once, as peft's own merge (`weight.data += delta`) rounds
                merged = (weight.data.to(delta.dtype) + delta).to(weight.dtype)
                saved.append((layer, weight, weight.data))
                weight.data = merged
                layer._disable_adapters = True
            yield peft_model
    finally:
        for layer, weight, original in reversed(saved):
            weight.data = original
            layer._disable_adapters = False


def adapter_values(
    peft_model: PeftModel,
    value_head: ValueHead,
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    adapter_name: str = "value",
) -> Tensor:
    """(B, L) values from the shared backbone with the value adapter active."""
    with use_adapter(peft_model, adapter_name):
        hidden = last_hidden_state(peft_model, input_ids, attention_mask, position_ids)  # (B, L, H)
    return value_head(hidden)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimiser should update (requires_grad=True), each once."""
    return [p for p in model.parameters() if p.requires_grad]
