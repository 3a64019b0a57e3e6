"""Log-probs of chosen tokens from final hidden states and the output layer, chunked at a large vocabulary.

Callers that need per-token log-probs (the rollout, the online training passes, the reference, DPO, SFT) get
`HeadInputs` — the (..., H) final-norm hidden states and the output layer — instead of (..., V) logits, and ask
`token_logprobs` for the numbers. When the positions' float32 logits fit in `LOGITS_CHUNK_BYTES` the logits are
formed whole (the same ops as before: a small vocabulary pays nothing); above it the positions are cut into
chunks (core/logprobs.py) so that no (B, T, V) float32 tensor exists in the forward or the backward: at
Qwen2.5-0.5B's 151,936 pieces one GRPO batch's logits would be 1.9 GB a copy (FACTS.md).
The chunk size is chosen here (models decide memory policy, core does the math; DESIGN.md wave 3).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import Tensor, nn

from rlhflab.core.logprobs import (chunked_head_logprobs, entropy_from_logits, recomputed_head_logprobs,
                                   selective_log_softmax)

# float32 logits of one chunk of positions: ~110 positions at a 151,936-piece vocabulary; the chunk's softmax and
# gradient are a few tensors of this size. Process-wide, set by `configure_logits_chunks` (--logits_chunk_mib);
# None = always whole
LOGITS_CHUNK_BYTES: int | None = 64 << 20


def configure_logits_chunks(mib: int) -> None:
    """Set the process's chunk size (a stage's --logits_chunk_mib), as torch.set_num_threads sets its threads;
    0 forms every logits tensor whole."""
    global LOGITS_CHUNK_BYTES
    LOGITS_CHUNK_BYTES = int(mib) << 20 if mib > 0 else None

# config fields of models whose logits are not the output layer's plain result (Gemma 2's soft-capping, Cohere's
# and Granite's scales): those keep the model's own logits
SCALED_LOGITS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@dataclass(frozen=True)
class HeadInputs:
    """What an output layer reads: `head(hidden)` are the logits, never formed whole unless they are small.
    Build it with `HeadInputs.of` where the trunk ran: the head then runs under the same autocast as the trunk
    (mixed precision) wherever the log-probs are taken later."""

    hidden: Tensor  # (..., H) final-norm hidden states; each predicts the token at its place
    head: Callable[[Tensor], Tensor]  # the output layer, (..., H) -> (..., V)
    autocast: torch.dtype | None = None  # the autocast dtype the head runs under; None = none

    @classmethod
    def of(cls, hidden: Tensor, head: Callable[[Tensor], Tensor]) -> HeadInputs:
        """`hidden` and `head`, with the autocast in force now on `hidden`'s device."""
        kind = hidden.device.type
        return cls(hidden, head, torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None)

    def __getitem__(self, index) -> HeadInputs:
        return replace(self, hidden=self.hidden[index])

    def reshape(self, *positions_then_hidden: int) -> HeadInputs:
        """The positions laid out anew, as logits.reshape(..., -1) would lay out theirs (the last size: -1)."""
        return replace(self, hidden=self.hidden.reshape(*positions_then_hidden))

    def autocast_context(self):
        """The head's autocast, to run it (or anything that must compute as it does) in."""
        kind = self.hidden.device.type
        return torch.autocast(kind, dtype=self.autocast) if self.autocast is not None else nullcontext()


def _linear_of(head: Callable) -> nn.Linear | None:
    """The plain Linear behind an output layer (a lean plan's tagged F.linear, or the module), else None."""
    module = getattr(head, "plain_linear", head)
    return module if type(module) is nn.Linear else None


def chunk_rows(vocab_size: int) -> int:
    """Positions per chunk at this vocabulary."""
    return max(1, LOGITS_CHUNK_BYTES // (4 * vocab_size))


def token_logprobs_and_entropy(scores: Tensor | HeadInputs, tokens: Tensor, temperature: float = 1.0,
                               entropy_grad: bool = False) -> tuple[Tensor, Tensor]:
    """log softmax(logits / temperature) at `tokens` and the entropy, (...) each, float32.

    `scores`: (..., V) logits, or `HeadInputs` whose logits are formed chunk by chunk when they are large. The
    entropy is differentiable only with `entropy_grad` (an entropy bonus) or when the logits are formed whole."""
    logits = _whole_logits(scores, tokens)
    if logits is not None:
        return selective_log_softmax(logits, tokens, temperature), entropy_from_logits(logits, temperature)
    return _chunked(scores, tokens, temperature, entropy_grad)


def token_logprobs(scores: Tensor | HeadInputs, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature) at `tokens`, (...) float32 (see `token_logprobs_and_entropy`)."""
    logits = _whole_logits(scores, tokens)
    if logits is not None:
        return selective_log_softmax(logits, tokens, temperature)
    return _chunked(scores, tokens, temperature, False)[0]


def _whole_logits(scores: Tensor | HeadInputs, tokens: Tensor) -> Tensor | None:
    """The logits when they are given, or small enough to form whole; None when they go chunk by chunk."""
    if isinstance(scores, Tensor):
        return scores
    linear = _linear_of(scores.head)
    if LOGITS_CHUNK_BYTES is None:
        with scores.autocast_context():
            return scores.head(scores.hidden)
    if linear is not None and tokens.numel() * linear.out_features * 4 <= LOGITS_CHUNK_BYTES:
        with scores.autocast_context():
            return scores.head(scores.hidden)
    return None


def _chunked(scores: HeadInputs, tokens: Tensor, temperature: float, entropy_grad: bool) -> tuple[Tensor, Tensor]:
    hidden, head = scores.hidden, scores.head
    linear = _linear_of(head)
    if linear is None:  # an adapted or unusual output layer: each chunk run again, as a module, in the backward
        with scores.autocast_context():
            vocab = getattr(head, "out_features", None) or head(hidden.reshape(-1, hidden.shape[-1])[:1]).shape[-1]
            return recomputed_head_logprobs(hidden, head, tokens, chunk=chunk_rows(vocab), temperature=temperature)
    return chunked_head_logprobs(hidden, linear.weight, tokens, chunk=chunk_rows(linear.out_features),
                                 temperature=temperature, bias=linear.bias,
                                 compute_dtype=scores.autocast or linear.weight.dtype, entropy_grad=entropy_grad)


def _sharded(weight) -> bool:
    """A weight held in shards (FSDP2's DTensor, ZeRO-3's partitions): only the model's own forward gathers it."""
    return weight is None or type(weight).__name__ == "DTensor" or hasattr(weight, "ds_id")


def output_layer(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(trunk, output layer) of a Hugging Face causal LM (or the PeftModel around one) whose logits are the output
    layer applied to the trunk's last hidden state; None when they are not (see SCALED_LOGITS), when it has no
    trunk, or when its weights are sharded (the root's forward gathers them: the caller runs the whole model)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    trunk = getattr(base, "base_model", None)
    config = getattr(base, "config", None)
    if head is None or trunk is None or trunk is base or config is None or _sharded(getattr(head, "weight", None)):
        return None
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in SCALED_LOGITS):
        return None
    return trunk, head


def head_inputs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor | None = None
                ) -> Tensor | HeadInputs:
    """What predicts every position of a causal LM's forward: `HeadInputs` (B, L) from its trunk, or (B, L, V)
    logits from the model's own forward where `output_layer` finds no plain output layer."""
    layers = output_layer(model)
    if layers is None:
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     use_cache=False).logits
    trunk, head = layers
    states = trunk(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).last_hidden_state
    return HeadInputs.of(states, head)
