"""A lean forward for Llama-layout models (Llama, Qwen2): the same weights and math as the HF
layers, as plain tensor ops, for the passes where per-module overhead dominates.

Why: at the sizes PPO runs on a CPU, a Hugging Face forward is mostly Python and small-op
overhead (per-module `__call__`, a causal mask rebuilt per call, a cache concatenated per
decode step), not arithmetic. Measured on the demo model (1 thread, busy machine): a decode
step 5.5-6.5 ms in HF vs 2.7-4.2 ms here; a forward over 8 x 50 tokens 41 ms vs 26 ms.
Used for: generation (models/lean_decoder.py: prefill into preallocated key / value buffers, then
one token at a time; rollout/generate.py), reward-model scores (`sequence_scores(lean=True)`),
PPO's policy / reference forwards (rollout/roles.py) and reward-model training on packed pairs
(an explicit attention mask: models/packing.py). The rollout's log-probs and the training
forward's come from this same code, so ratio == 1 and KL == 0 at the start stay exact; against
the HF forward the numbers agree to ~1e-6 (tests/models/test_models_lean.py).

Only models whose decoder layers are exactly the Llama layout qualify, in eval mode or, when
the caller allows it, in training mode without dropout (`plan_lean` returns None otherwise and
callers keep the model's own forward). A plain peft
LoRA Linear runs as base(x) + scale * B(A(x)) on its own tensors, with peft's casts (x to the
adapter's dtype, the sum back to the base's); any other kind of layer is called as a module, so
adapters are never skipped.
A model whose layers checkpoint (models/checkpointing.py) keeps the lean path: in training mode with grad on,
each lean layer is recomputed in the backward too, where HF's own layers would be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

LEAN_MODEL_TYPES = ("llama", "qwen2")
_LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTN_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj"}
_MLP_CHILDREN = {"gate_proj", "up_proj", "down_proj", "act_fn"}


def _norm(module: nn.Module) -> Callable[[Tensor], Tensor]:
    """HF's Llama / Qwen2 RMSNorm (weight * x / rms(x), in float32) as one fused op; other norms as modules."""
    eps = getattr(module, "variance_epsilon", None)
    weight = getattr(module, "weight", None)
    if type(module).__name__ in ("LlamaRMSNorm", "Qwen2RMSNorm") and eps is not None and weight is not None \
            and weight.dtype == torch.float32:
        def rms_norm(x: Tensor) -> Tensor:
            return F.rms_norm(x, weight.shape, weight, eps)

        rms_norm.rms_parts = (weight, eps)  # tagged, so the decoder can fold the weight into the next matmul
        return rms_norm
    return module


def _activation(module: nn.Module) -> Callable[[Tensor], Tensor]:
    return F.silu if type(module).__name__ in ("SiLUActivation", "SiLU") else module


def _plain(module: nn.Linear) -> Callable[[Tensor], Tensor]:
    """F.linear on the layer's own tensors; tagged, so the decoder can fuse plain layers (models/lean_decoder.py)."""
    def linear(x: Tensor) -> Tensor:
        return F.linear(x, module.weight, module.bias)

    linear.plain_linear = module
    return linear


def _linear(module: nn.Module) -> Callable[[Tensor], Tensor]:
    """F.linear on a plain Linear's own tensors (no module call); a plain peft LoRA Linear as
    base(x) + scale * B(A(x)), what its forward computes in eval mode; anything else is called as a module."""
    if type(module) is nn.Linear:
        return _plain(module)
    base = getattr(module, "base_layer", None)
    if type(base) is not nn.Linear or not hasattr(module, "lora_A") or getattr(module, "merged", True):
        return module
    if module.disable_adapters:  # adapters off (or merged into temporary weights, models.merged_adapter)
        return _plain(base)
    active = [a for a in module.active_adapters if a in module.lora_A]
    if (getattr(module, "fan_in_fan_out", True) or any(getattr(module, "use_dora", {}).values())
            or any(getattr(module, "lora_bias", {}).values()) or getattr(module, "lora_variant", None)):
        return module
    if any(float(getattr(module.lora_dropout[a], "p", 0.0)) != 0.0 for a in active):
        return module
    pairs = [(module.lora_A[a].weight, module.lora_B[a].weight, module.scaling[a]) for a in active]
    cast = getattr(module, "cast_input_dtype_enabled", True)

    def lora_linear(x: Tensor) -> Tensor:
        return lora_forward(x, base.weight, base.bias, pairs, cast)

    lora_linear.lora_parts = (base, pairs, cast)  # tagged, so the decoder can give it other base tensors
    return lora_linear


def lora_forward(x: Tensor, weight: Tensor, bias: Tensor | None, pairs: list, cast: bool) -> Tensor:
    """As peft's lora.Linear.forward: base(x) + scale * B(A(x)) for each (A, B, scale) of `pairs`; the adapter
    reads x in its own dtype when `cast` (peft keeps A / B in float32 on a bf16 / fp16 base), the sum is formed
    in the promoted dtype, and the result is cast back."""
    out = F.linear(x, weight, bias)
    dtype = out.dtype
    for a, b, scale in pairs:
        x = x.to(a.dtype) if cast else x
        out = out + F.linear(F.linear(x, a), b) * scale
    return out.to(dtype)


@dataclass
class LeanLayer:
    input_norm: Callable
    q: Callable
    k: Callable
    v: Callable
    o: Callable
    post_norm: Callable
    gate: Callable
    up: Callable
    down: Callable
    act: Callable
    scaling: float


@dataclass
class LeanPlan:
    embed: Tensor  # (V, H) token embeddings
    layers: list[LeanLayer]
    norm: Callable
    lm_head: Callable | None  # None for a sequence classifier (reward model)
    rotary: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # the embedding's padding row (nn.Embedding padding_idx): looking it up gives it no gradient, as in the
    # model's own forward (a sampled pad token is an ordinary input, but its row must not learn from it)
    padding_idx: int | None = None
    # the model's decoder layers checkpoint (models/checkpointing.py) and it is in training mode: `lean_hidden`
    # recomputes each layer in the backward when grad is on, as HF's layers do
    checkpoint: bool = False


def rope_kind(config) -> str:
    """The RoPE variant a config asks for; "default" is plain RoPE. transformers 5 keeps it in
    `rope_parameters` (`rope_scaling` is an alias there), 4.x in `rope_scaling` (None = plain) with no
    `rope_parameters`; configs older than 4.43 name the key `type`. Both places are read."""
    for name in ("rope_parameters", "rope_scaling"):
        rope = getattr(config, name, None) or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            return kind
    return "default"


def _qualifies(config, inner: nn.Module) -> bool:
    return (
        getattr(config, "model_type", None) in LEAN_MODEL_TYPES
        and rope_kind(config) == "default"  # linear / dynamic / yarn / llama3 RoPE: the model's own forward
        and not getattr(config, "use_sliding_window", False)
        and all(t == "full_attention" for t in (getattr(config, "layer_types", None) or []))
        and float(getattr(config, "attention_dropout", 0.0) or 0.0) == 0.0
        and type(getattr(inner, "embed_tokens", None)) is nn.Embedding
        and all({n for n, _ in layer.named_children()} == _LAYER_CHILDREN
                and {n for n, _ in layer.self_attn.named_children()} == _ATTN_CHILDREN
                and {n for n, _ in layer.mlp.named_children()} == _MLP_CHILDREN
                for layer in getattr(inner, "layers", []))
    )


def _dropout_free(model: nn.Module) -> bool:
    """No dropout that would act in training mode (models.disable_dropout sets them all to 0)."""
    modules = list(model.modules())
    return all(float(m.p) == 0.0 for m in modules if isinstance(m, nn.modules.dropout._DropoutNd)) \
        and all(float(getattr(m, "attention_dropout", 0.0) or 0.0) == 0.0 for m in modules)


def plan_lean(model: nn.Module, allow_training: bool = False) -> LeanPlan | None:
    """The pieces the lean forward needs, or None when `model` (or the model inside a PeftModel) is not a
    Llama layout. A causal LM's head is `lm_head`; a sequence classifier (reward model) has none.
    In training mode only with `allow_training` and no dropout anywhere (the lean ops have none)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # a causal LM or classifier keeps its trunk in `model`; a bare trunk (a value model's backbone) is its own
    inner = getattr(base, "model", None)
    if inner is None and hasattr(base, "embed_tokens"):
        inner = base
    config = getattr(base, "config", None)
    if inner is None or config is None or not _qualifies(config, inner):
        return None
    if getattr(inner, "rotary_emb", None) is None:
        return None
    if base.training and not (allow_training and _dropout_free(model)):
        return None
    layers = [
        LeanLayer(_norm(layer.input_layernorm), _linear(layer.self_attn.q_proj), _linear(layer.self_attn.k_proj),
                  _linear(layer.self_attn.v_proj), _linear(layer.self_attn.o_proj),
                  _norm(layer.post_attention_layernorm), _linear(layer.mlp.gate_proj), _linear(layer.mlp.up_proj),
                  _linear(layer.mlp.down_proj), _activation(layer.mlp.act_fn), float(layer.self_attn.scaling))
        for layer in inner.layers
    ]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    lm_head = _linear(base.lm_head) if isinstance(getattr(base, "lm_head", None), nn.Module) else None
    checkpointed = base.training and any(getattr(layer, "gradient_checkpointing", False) for layer in inner.layers)
    return LeanPlan(inner.embed_tokens.weight, layers, _norm(inner.norm), lm_head, inner.rotary_emb,
                    config.num_attention_heads, config.num_key_value_heads, head_dim, inner.embed_tokens.padding_idx,
                    checkpointed)


def plan_lean_decode(model: nn.Module) -> LeanPlan | None:
    """`plan_lean` for a causal LM (a model with an LM head), else None."""
    plan = plan_lean(model)
    return plan if plan is not None and plan.lm_head is not None else None


def rotary_tables(plan: LeanPlan, positions: Tensor) -> tuple[Tensor, Tensor]:
    """(B, L) positions -> cos, signed sin, each (B, 1, L, D), from the model's own rotary module.

    rotate_half(x) * sin == roll(x, D/2) * [-sin_1, sin_2], one op instead of three."""
    cos, sin = plan.rotary(plan.embed[:1].unsqueeze(0), positions)
    half = plan.head_dim // 2
    return cos.unsqueeze(1), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)


def causal_allowed(attention_mask: Tensor) -> Tensor:
    """(B, L) mask -> (B, L, L) bool, query i may read key j: j <= i and j real; a padding query
    reads itself only, so no row is fully masked (its output is never read)."""
    length = attention_mask.shape[1]
    eye = torch.eye(length, dtype=torch.bool, device=attention_mask.device)
    return (eye.cumsum(0).bool() & attention_mask.bool()[:, None, :]) | eye


# Below this many mask entries, attention reads one additive float mask made once per forward instead of the bool
# one, which scaled_dot_product_attention would turn into floats again in every layer (forward and backward):
# the same numbers, ~15 % less attention time at the GRPO benchmark's sizes (4 x 150 x 150, 1 thread); above it
# the float mask's memory (4 bytes an entry, alive for the backward) is not worth it.
FLOAT_MASK_BELOW = 1 << 22


def attention_bias(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask (True = may read), or, when small, the same as an additive mask: 0 where allowed, -inf not."""
    if allowed.numel() >= FLOAT_MASK_BELOW:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def lean_hidden(plan: LeanPlan, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor,
                allowed: Tensor | None = None, read: Tensor | None = None,
                kv_keep: list[tuple[Tensor, Tensor]] | None = None) -> Tensor:
    """(B, L) ids, mask (True / 1 on real tokens), positions -> (B, L, H) final-norm hidden states
    (HF's `hidden_states[-1]`, what the LM head reads). Differentiable when grad is on.

    Causal attention over real keys (`causal_allowed`), or the (B, L, L) `allowed` given instead
    (several continuations of one shared prefix in a row: models.pack_shared_prefix).
    `read` (B, m): the columns of each row whose hidden states the caller reads (repeats allowed); then
    (B, m, H) is returned and the last layer runs its queries, attention output and MLP at those columns
    only (`read_columns`). The same numbers: a later position depends on an earlier one only through
    the earlier one's keys and values, which every position still computes.
    `kv_keep`: each layer's rotated keys and values (B, H_kv, L, D) are appended to it (models/prompt_pass.py).
    `plan.checkpoint` and grad on: each layer runs under a non-reentrant checkpoint (its input kept, its
    activations recomputed in the backward; models/checkpointing.py); the same numbers.
    """
    if attention_mask is None and allowed is None:
        raise ValueError("lean_hidden needs an attention_mask or an explicit allowed mask")
    allowed = (causal_allowed(attention_mask) if allowed is None else allowed).unsqueeze(1)  # (B, 1, L, L)
    allowed = attention_bias(allowed, plan.embed.dtype)
    cos, sin = rotary_tables(plan, position_ids)
    h = F.embedding(input_ids, plan.embed, padding_idx=plan.padding_idx)
    checkpointed = plan.checkpoint and torch.is_grad_enabled()
    last = len(plan.layers) - 1
    for i, layer in enumerate(plan.layers):
        at = read if i == last else None
        if checkpointed:
            # the lean ops draw no random numbers (no dropout in training: plan_lean), so no RNG state is kept
            h, k, v = checkpoint(_decoder_layer, plan, layer, h, allowed, cos, sin, at, use_reentrant=False,
                                 preserve_rng_state=False)
        else:
            h, k, v = _decoder_layer(plan, layer, h, allowed, cos, sin, at)
        if kv_keep is not None:
            kv_keep.append((k, v))
    return plan.norm(h)


def _decoder_layer(plan: LeanPlan, layer: LeanLayer, h: Tensor, allowed: Tensor, cos: Tensor, sin: Tensor,
                   read: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """One decoder layer: (B, L, H) input -> its output (B, L, H), or (B, m, H) at the columns `read`
    (`_layer_at`), and its rotated keys and values (B, H_kv, L, D)."""
    batch, length = h.shape[:2]
    heads, kv_heads, dim = plan.num_heads, plan.num_kv_heads, plan.head_dim
    x = layer.input_norm(h)
    k = _rope(layer.k(x).view(batch, length, kv_heads, dim).transpose(1, 2), cos, sin)
    v = layer.v(x).view(batch, length, kv_heads, dim).transpose(1, 2)
    if read is not None:
        return _layer_at(plan, layer, h, x, k, v, allowed, cos, sin, read), k, v
    q = _rope(layer.q(x).view(batch, length, heads, dim).transpose(1, 2), cos, sin)
    attn = grouped_attention(q, k, v, allowed, layer.scaling)
    h = h + layer.o(attn.transpose(1, 2).reshape(batch, length, heads * dim))
    x = layer.post_norm(h)
    return h + layer.down(layer.act(layer.gate(x)) * layer.up(x)), k, v


def _layer_at(plan: LeanPlan, layer: LeanLayer, h: Tensor, x: Tensor, k: Tensor, v: Tensor, allowed: Tensor,
              cos: Tensor, sin: Tensor, read: Tensor) -> Tensor:
    """One layer's output (B, m, H) at the (B, m) columns `read`, given its input h, normed input x and the
    keys / values of every column."""
    batch, m = read.shape
    heads, dim = plan.num_heads, plan.head_dim
    at = lambda t: torch.take_along_dim(t, read[:, :, None], dim=1)  # noqa: E731  (B, L, X) -> (B, m, X)
    at_query = lambda t: torch.take_along_dim(t, read[:, None, :, None], dim=2)  # noqa: E731  (B, 1, L, Y) -> m
    q = _rope(layer.q(at(x)).view(batch, m, heads, dim).transpose(1, 2), at_query(cos), at_query(sin))
    attn = grouped_attention(q, k, v, at_query(allowed), layer.scaling)
    h = at(h) + layer.o(attn.transpose(1, 2).reshape(batch, m, heads * dim))
    x = layer.post_norm(h)
    return h + layer.down(layer.act(layer.gate(x)) * layer.up(x))


def grouped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
                      repeat_kv: bool | None = None) -> Tensor:
    """Attention of (B, Hq, Lq, D) queries over (B, Hkv, L, D) keys and values (Hq a multiple of Hkv: grouped-query
    attention) under `mask` (bool, True = may read, or additive). CUDA's fused attention kernels take no mask
    together with `enable_gqa` (scaled_dot_product_attention then falls back to its math kernel, which forms every
    (Lq, L) score matrix in full), so with a mask on a GPU the key and value heads are repeated to the query heads
    first (`repeat_kv` None: decided by `repeats_kv_heads`); elsewhere SDPA reads them grouped. The same numbers."""
    groups = q.shape[1] // k.shape[1]
    if groups == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if repeat_kv is None:
        repeat_kv = repeats_kv_heads(q.device.type, mask is not None)
    if repeat_kv:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def repeats_kv_heads(device_type: str, masked: bool) -> bool:
    """Whether `grouped_attention` repeats the key / value heads: with a mask on a GPU (see there)."""
    return masked and device_type == "cuda"


def read_columns(flags: Tensor) -> tuple[Tensor, Tensor]:
    """(B, L) bool, the positions a caller reads -> `lean_hidden`'s `read` (B, m) (each row's flagged columns
    in order, then repeats of its first column) and (B, m) bool, True on the flagged ones: `out[valid]` lists
    the flagged positions' states in row-major order, as `hidden[flags]` would."""
    counts = flags.sum(dim=1)
    m = max(int(counts.max()), 1)
    read = torch.argsort((~flags).to(torch.uint8), dim=1, stable=True)[:, :m]
    valid = torch.arange(m, device=flags.device) < counts[:, None]
    return torch.where(valid, read, read[:, :1]), valid
