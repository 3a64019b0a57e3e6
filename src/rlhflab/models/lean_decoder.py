"""KV-cached decoding on the lean plan (models/lean.py): prefill, then one token at a time.

A decode step runs one token per row, so its matmuls are tiny and much of its cost is per-op overhead
and memory traffic (the key / value buffers are most of what a step reads). A step here:
- keeps hidden states 2-D, (B, H);
- runs q / k / v as one matmul and gate / up as one, on weights concatenated once per decoder
  (plain Linear layers only; LoRA or other layers are called one by one, adapters included), with the
  RMSNorm weight before each folded into them;
- rotates q and k in one op;
- scores with one batched matmul that adds the padding mask and scales (baddbmm), and adds the
  output and down projections to the residual in their matmuls (addmm).
Measured on the benchmark model (d 128, 4 layers, 32 rows, 1 thread, other jobs paused, old and new
interleaved): median 3.96 ms a step against 4.30 for the per-layer version, with identical logits; the
folded norms, baddbmm and addmm then took generation of a GRPO rollout (8 prompts x 4) from 88-116 ms to
78-100 (3 interleaved rounds). (Keys stored transposed or attention over the whole preallocated buffer
were tried and were slower: the strided key write and the longer rows cost more than the contiguous
reads saved.) The logits match the plain forward to float rounding (tests/models/test_models_lean.py);
the log-probs the losses use come from the lean forward, never from here.

Under autocast (`--bf16` / `--fp16`) every weight a step multiplies by is cast to the autocast dtype once per
decoder (`Precast`), not once per step: autocast caches the casts of trained leaf weights only, so the fused,
folded and transposed weights, and every frozen one (a LoRA base, the reference), would otherwise be cast again
at each of the rollout's tokens. The same casts, so the same logits bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhflab.models.lean import LeanLayer, LeanPlan, lora_forward, rotary_tables
from rlhflab.models.prompt_pass import prompt_pass


class Precast:
    """t -> t cast to the autocast dtype active on `device_type` now (each tensor once, then reused), or t itself
    without autocast or for a tensor that is not float32. Holds the originals, so ids stay unique while it lives."""

    def __init__(self, device_type: str):
        enabled = torch.is_autocast_enabled(device_type)
        self.dtype = torch.get_autocast_dtype(device_type) if enabled else None
        self._casts: dict[int, tuple[Tensor, Tensor]] = {}

    def __call__(self, t: Tensor | None) -> Tensor | None:
        if t is None or self.dtype is None or t.dtype != torch.float32:
            return t
        if id(t) not in self._casts:
            self._casts[id(t)] = (t, t.detach().to(self.dtype))
        return self._casts[id(t)][1]


def decode_linear(fn: Callable, cast: Precast) -> Callable:
    """A layer function of the plan (models/lean.py `_linear`) on weights cast once; anything else as it is."""
    if cast.dtype is None:
        return fn
    plain = _plain_parts(fn)
    if plain is not None:
        weight, bias = cast(plain[0]), cast(plain[1])
        return lambda x: F.linear(x, weight, bias)
    lora = getattr(fn, "lora_parts", None)
    if lora is not None:
        base, pairs, cast_input = lora
        weight, bias = cast(base.weight), cast(base.bias)
        return lambda x: lora_forward(x, weight, bias, pairs, cast_input)
    return fn


def _plain_parts(layer_fn: Callable) -> tuple[Tensor, Tensor | None] | None:
    """(weight, bias) of a callable `_linear` made from a plain nn.Linear, else None."""
    module = getattr(layer_fn, "plain_linear", None)
    return None if module is None else (module.weight, module.bias)


# Fuse only small layers: there a matmul costs about its per-op overhead, and the concatenated copy of the
# weights (held while the decoder lives) is small. A (32 x 1M) matmul is ~0.7 ms at 1 CPU thread, so
# above this size the ~15 us saved per op is noise and the copy is not.
FUSE_BELOW_ELEMENTS = 1 << 20


@dataclass
class SideBySide:
    """x -> the outputs of `parts` side by side on the last dim: one matmul on `weight` (the parts' weights
    concatenated) when every part is a small plain Linear, else each part called as it is (LoRA adapters
    and all) and the outputs concatenated."""
    parts: list[Callable]
    weight: Tensor | None = None
    bias: Tensor | None = None

    def __call__(self, x: Tensor) -> Tensor:
        if self.weight is not None:
            return F.linear(x, self.weight, self.bias)
        return torch.cat([fn(x) for fn in self.parts], dim=-1)


def side_by_side(fns: list[Callable]) -> SideBySide:
    plain = [_plain_parts(fn) for fn in fns]
    if any(p is None for p in plain) or sum(w.numel() for w, _ in plain) > FUSE_BELOW_ELEMENTS:
        return SideBySide(fns)
    weight = torch.cat([w for w, _ in plain])
    if all(b is None for _, b in plain):
        return SideBySide(fns, weight)
    bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in plain])
    return SideBySide(fns, weight, bias)


@dataclass
class DecodeLayer:
    input_norm: Callable
    qkv: SideBySide  # (B, H) -> (B, (heads + 2 kv_heads) * D): q, k, v side by side
    o: Callable  # (h, x) -> h + o(x)
    post_norm: Callable
    gate_up: SideBySide  # (B, H) -> (B, 2 I): gate, up side by side
    down: Callable  # (h, x) -> h + down(x)
    act: Callable
    scaling: float
    inner: int  # I, the MLP width


def decode_layer(layer: LeanLayer, mlp_width: int, cast: Precast) -> DecodeLayer:
    input_norm, qkv = folded_norm(layer.input_norm, side_by_side([layer.q, layer.k, layer.v]))
    post_norm, gate_up = folded_norm(layer.post_norm, side_by_side([layer.gate, layer.up]))
    return DecodeLayer(input_norm, cast_side_by_side(qkv, cast), residual_linear(layer.o, cast), post_norm,
                       cast_side_by_side(gate_up, cast), residual_linear(layer.down, cast), layer.act, layer.scaling,
                       mlp_width)


def cast_side_by_side(fused: SideBySide, cast: Precast) -> SideBySide:
    """`fused` with its concatenated (and norm-folded) weight cast once, or its parts on cast weights."""
    if cast.dtype is None:
        return fused
    if fused.weight is not None:
        return SideBySide(fused.parts, cast(fused.weight), cast(fused.bias))
    return SideBySide([decode_linear(fn, cast) for fn in fused.parts])


def folded_norm(norm: Callable, after: SideBySide) -> tuple[Callable, SideBySide]:
    """An RMSNorm's weight folded into the fused matmul after it, else both as they are. x / rms(x) * w =
    x / sqrt(sum(x^2) + H eps) * sqrt(H) w: the matmul's weight becomes W diag(sqrt(H) w) (once per decoder) and
    the norm x / hypot(||x||, sqrt(H eps)): one reduction kernel, one hypot, one division (~5 against ~14 us
    for x * rsqrt(sum(x * x) + H eps), five ops; a CPU mean would add a division and a cast)."""
    parts = getattr(norm, "rms_parts", None)
    if parts is None or after.weight is None:
        return norm, after
    weight, eps = parts
    size = weight.shape[0]
    floor = weight.new_tensor((size * eps) ** 0.5)
    return (lambda x: x / torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True), floor)), \
        SideBySide(after.parts, after.weight * (weight * size ** 0.5), after.bias)


def residual_linear(fn: Callable, cast: Precast) -> Callable[[Tensor, Tensor], Tensor]:
    """(h, x) -> h + fn(x), as one addmm for a plain bias-free Linear."""
    parts = _plain_parts(fn)
    if parts is None or parts[1] is not None:
        linear = decode_linear(fn, cast)
        return lambda h, x: h + linear(x)
    weight_t = cast(parts[0]).t()
    return lambda h, x: torch.addmm(h, x, weight_t)


def _mlp_width(layer: LeanLayer, hidden: int, sample: Tensor) -> int:
    parts = _plain_parts(layer.gate)
    return parts[0].shape[0] if parts is not None else layer.gate(sample.new_zeros(1, hidden)).shape[-1]


def _rope_2d(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, heads, D) rotated with cos / signed sin (B, 1, D): models.lean._rope on one position."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)


class LeanDecoder:
    """Prefill, then decode steps, over preallocated (B, H_kv, P + N, D) key / value buffers."""

    def __init__(self, plan: LeanPlan, query_ids: Tensor, query_mask: Tensor, positions: Tensor,
                 max_new_tokens: int):
        """Runs the prefill; `self.logits` (B, V) are the logits for the first new token."""
        self.plan = plan
        batch, prompt_len = query_ids.shape
        self.prompt_len = self.length = prompt_len
        total = prompt_len + max_new_tokens
        dtype = plan.embed.dtype
        kv, dim = plan.num_kv_heads, plan.head_dim
        self.keys = [plan.embed.new_empty((batch, kv, total, dim)) for _ in plan.layers]
        self.values = [plan.embed.new_empty((batch, kv, total, dim)) for _ in plan.layers]
        prompts = prompt_pass(plan, query_ids, query_mask, positions)
        for buffers, computed in ((self.keys, prompts.keys), (self.values, prompts.values)):
            for buffer, layer_kv in zip(buffers, computed):
                buffer[:, :, :prompt_len] = layer_kv
        cast = Precast(query_ids.device.type)
        self.lm_head = decode_linear(plan.lm_head, cast)
        self.logits = self.lm_head(prompts.last_hidden)
        # (B, 1, 1, P + N) additive mask: 0 on keys a new token may attend to (real prompt tokens and every
        # generated one), -inf on left padding
        self.key_bias = torch.zeros(batch, 1, 1, total, dtype=dtype, device=query_ids.device)
        self.key_bias[:, 0, 0, :prompt_len].masked_fill_(~query_mask.bool(), float("-inf"))
        # rotary tables for the positions of the N tokens still to come, (B, N, 1, D), computed once
        upcoming = positions[:, -1:] + torch.arange(1, max_new_tokens + 1, device=positions.device)
        cos, sin = rotary_tables(plan, upcoming)
        self.cos, self.sin = cos.transpose(1, 2).contiguous(), sin.transpose(1, 2).contiguous()
        self.groups = plan.num_heads // plan.num_kv_heads
        self._views()
        hidden_size = plan.embed.shape[1]
        self.layers = [decode_layer(layer, _mlp_width(layer, hidden_size, plan.embed), cast) for layer in plan.layers]

    def select_rows(self, rows: Tensor) -> None:
        """Decode rows `rows` of the current ones from now on: each distinct prompt prefilled once, then given
        to each of its answers (models/shared_prompt.py), or the rows still unfinished (rollout/generate.py)."""
        # index_select, not t[rows]: on the (B, H_kv, P + N, D) buffers advanced indexing is ~6x slower (1 MB:
        # 114 against 19 us at 1 thread), and a rollout selects rows a few times over 8 buffers
        pick = lambda t: t.index_select(0, rows)  # noqa: E731
        self.keys, self.values = [pick(k) for k in self.keys], [pick(v) for v in self.values]
        self.key_bias, self.cos, self.sin, self.logits = map(pick, (self.key_bias, self.cos, self.sin, self.logits))
        self._views()

    def _views(self) -> None:
        """What a step reads, made once per set of rows: key_bias per (row, key / value head), (B H_kv, 1, P + N),
        the additive mask of the batched matmuls; the key / value buffers as (B H_kv, P + N, D) rows, read up to
        the current length; and as (P + N, B, H_kv, D) slots, written one position a step."""
        batch, total = self.key_bias.shape[0], self.key_bias.shape[-1]
        kv, dim = self.plan.num_kv_heads, self.plan.head_dim
        self.head_bias = self.key_bias.view(batch, 1, total).expand(batch, kv, total).reshape(batch * kv, 1, total)
        self.key_rows, self.value_rows = ([b.view(batch * kv, total, dim) for b in buffers]
                                          for buffers in (self.keys, self.values))
        self.key_slots, self.value_slots = ([b.permute(2, 0, 1, 3) for b in buffers]
                                            for buffers in (self.keys, self.values))

    @torch.no_grad()
    def step(self, token: Tensor) -> Tensor:
        """(B,) tokens just sampled -> (B, V) logits for the next one."""
        plan, t, pos = self.plan, self.length - self.prompt_len, self.length
        batch, heads, kv_heads, dim = token.shape[0], plan.num_heads, plan.num_kv_heads, plan.head_dim
        cos, sin = self.cos[:, t], self.sin[:, t]  # (B, 1, D)
        bias, end = self.head_bias[..., : pos + 1], pos + 1  # (B H_kv, 1, L): the new token reads itself and all before
        h = F.embedding(token, plan.embed)  # (B, H)
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(layer.input_norm(h))
            qk = _rope_2d(qkv[:, : (heads + kv_heads) * dim].view(batch, heads + kv_heads, dim), cos, sin)
            self.key_slots[i][pos].copy_(qk[:, heads:])
            self.value_slots[i][pos].copy_(qkv[:, (heads + kv_heads) * dim:].view(batch, kv_heads, dim))
            # query head j*G+g reads key / value head j (HF's repeat_kv): (B H_kv, G, L) scores
            q = qk[:, :heads].reshape(batch * kv_heads, self.groups, dim)
            keys = self.key_rows[i].narrow(1, 0, end)
            scores = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=layer.scaling)
            attn = torch.bmm(torch.softmax(scores, dim=-1), self.value_rows[i].narrow(1, 0, end))  # (B H_kv, G, D)
            h = layer.o(h, attn.view(batch, heads * dim))
            gate_up = layer.gate_up(layer.post_norm(h))
            h = layer.down(h, layer.act(gate_up[:, : layer.inner]).mul_(gate_up[:, layer.inner:]))
        self.length = end
        return self.lm_head(plan.norm(h))
