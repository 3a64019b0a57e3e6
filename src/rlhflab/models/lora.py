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

from peft import LoraConfig, PeftModel, get_peft_model
from torch import Tensor, nn

from rlhflab.errors import UserInputError
from rlhflab.models.value import ValueHead, last_hidden_state


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


@contextmanager
def adapters_off(peft_model: PeftModel) -> Iterator[PeftModel]:
    """The reference model: the frozen base with every adapter off; trainability is kept as it was."""
    with _keep_requires_grad(peft_model), peft_model.disable_adapter():
        yield peft_model


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
