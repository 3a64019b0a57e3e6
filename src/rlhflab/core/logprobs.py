"""Token log-probabilities and entropy from logits.

The log-prob of token t comes from the logits at position t-1, divided by the
same temperature used for sampling (DESIGN.md, correctness rules).
"""

from __future__ import annotations

import torch
from torch import Tensor


def selective_log_softmax(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature) picked at `tokens`.

    logits: (B, T, V); tokens: (B, T) -> (B, T), float32 whatever the logits' dtype:
    in bf16 a log-prob near -4 moves in steps of ~0.03, which would put noise of the
    order of the clip range into ratios and KL. logsumexp avoids a (B, T, V) log-softmax.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = torch.gather(logits, dim=-1, index=tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / temperature) per position. (B, T, V) -> (B, T), float32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def shifted_token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-prob of each token given the ones before it.

    logits: (B, L, V) from a forward pass over input_ids (B, L) -> (B, L-1),
    where entry j is log p(input_ids[:, j+1] | input_ids[:, :j+1]).
    """
    return selective_log_softmax(logits[:, :-1], input_ids[:, 1:], temperature)


# --- vocabulary-chunked log-probs: no (N, V) float32 tensor for all positions at once -------------------------
#
# At a 150k-piece vocabulary the logits of one GRPO batch (16 x 192 positions) are 1.9 GB in float32, and autograd
# keeps the log-softmax's input and output for the backward on top. Here the positions are cut into chunks of
# `chunk` rows: each chunk's logits are formed, reduced to its (chunk,) log-probs / entropies and freed; the
# backward forms them again chunk by chunk. Peak extra memory is a few (chunk, V) tensors whatever N is.


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float,
                  compute_dtype: torch.dtype) -> Tensor:
    """One chunk's float32 logits / temperature (n, V); `weight` and `bias` already in `compute_dtype`."""
    logits = torch.nn.functional.linear(hidden.to(compute_dtype), weight, bias).float()
    return logits / temperature if temperature != 1.0 else logits


class _ChunkedHead(torch.autograd.Function):
    """log-probs (N,) and entropies (N,) of softmax((hidden @ weight.T + bias) / temperature), chunk by chunk.

    With z = logits / T, p = softmax(z), lse = logsumexp(z), H = -sum(p log p):
        d logp_tok / dz = onehot(tok) - p,      dH / dz = -p (z - lse + H),      d / dlogits = d / dz / T.
    Two ways to the backward, both without an (N, V) tensor:
    - a trained head (full fine-tuning): the forward keeps the (N,) logsumexp and entropy, and the backward forms
      each chunk's logits again (one more head matmul) for the weight's gradient, summed in float32;
    - a frozen head (LoRA, a reference): only the hidden states need a gradient, and it is (N,) per-position
      weights times (N, H) vectors the forward already has its hands on: (W[tok] - p @ W) / T for the log-probs
      (and -(p (z - lse + H)) @ W / T for the entropy when `entropy_grad`), so the backward is free and the
      head's matmuls are as many as the unchunked forward and backward.
    The matmuls run in `compute_dtype` (the autocast dtype, or the weight's); softmax and sums in float32."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature, chunk, compute_dtype, entropy_grad):
        w = weight.to(compute_dtype)
        b = bias.to(compute_dtype) if bias is not None else None
        frozen = hidden.requires_grad and not weight.requires_grad and not (bias is not None and bias.requires_grad)
        n = hidden.shape[0]
        logprobs = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n, dtype=torch.float32)
        lse_all = hidden.new_empty(n, dtype=torch.float32)
        d_logprobs = torch.empty_like(hidden, dtype=torch.float32) if frozen else None
        d_entropy = torch.empty_like(hidden, dtype=torch.float32) if frozen and entropy_grad else None
        for s in range(0, n, chunk):
            tok = tokens[s:s + chunk]
            logits = _chunk_logits(hidden[s:s + chunk], w, b, temperature, compute_dtype)
            lse = torch.logsumexp(logits, dim=-1)
            logp = logits - lse[:, None]  # what log_softmax computes
            probs = logp.exp()
            logprobs[s:s + chunk] = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
            entropy[s:s + chunk] = -(probs * logp).sum(dim=-1)
            lse_all[s:s + chunk] = lse
            if frozen:
                d_logprobs[s:s + chunk] = (w[tok] - (probs.to(compute_dtype) @ w)).float() / temperature
            if d_entropy is not None:
                spread = probs * (logp + entropy[s:s + chunk, None])
                d_entropy[s:s + chunk] = -(spread.to(compute_dtype) @ w).float() / temperature
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)  # an output no loss reads gets None in the backward, not a zero tensor
        ctx.frozen = frozen
        ctx.settings = (temperature, chunk, compute_dtype)
        if frozen:
            ctx.save_for_backward(d_logprobs, d_entropy)
        else:
            ctx.save_for_backward(hidden, weight, bias, tokens, lse_all, entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        if ctx.frozen:
            d_logprobs, d_entropy = ctx.saved_tensors
            grad = d_logprobs * grad_logprobs[:, None] if grad_logprobs is not None else None
            if grad_entropy is not None and d_entropy is not None:
                grad = d_entropy * grad_entropy[:, None] + (grad if grad is not None else 0)
            return grad, None, None, None, None, None, None, None
        hidden, weight, bias, tokens, lse_all, entropy = ctx.saved_tensors
        temperature, chunk, compute_dtype = ctx.settings
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        w = weight.to(compute_dtype)
        b = bias.to(compute_dtype) if bias is not None else None
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if want_bias else None
        # a (V, H) product per chunk goes into one buffer (bf16) or straight into the float32 sum: no new (V, H)
        # tensor per chunk (at 151,936 x 896 each is 0.5 GB, and the peak of a full fine-tuning step)
        product = None
        for s in range(0, hidden.shape[0], chunk):
            h, tok = hidden[s:s + chunk], tokens[s:s + chunk]
            logits = _chunk_logits(h, w, b, temperature, compute_dtype)
            logp = logits - lse_all[s:s + chunk, None]
            probs = logp.exp()  # (n, V)
            grad = torch.zeros_like(logits)
            if grad_logprobs is not None:
                grad -= probs * grad_logprobs[s:s + chunk, None]
                grad.scatter_add_(-1, tok.unsqueeze(-1), grad_logprobs[s:s + chunk, None])
            if grad_entropy is not None:
                grad -= probs * (logp + entropy[s:s + chunk, None]) * grad_entropy[s:s + chunk, None]
            if temperature != 1.0:
                grad /= temperature
            del logits, logp, probs
            low = grad.to(compute_dtype)
            if want_hidden:
                grad_hidden[s:s + chunk] = (low @ w).to(hidden.dtype)
            if want_weight and compute_dtype == torch.float32:
                grad_weight.addmm_(low.T, h.to(compute_dtype))
            elif want_weight:
                product = torch.mm(low.T, h.to(compute_dtype), out=product)
                grad_weight += product
            if want_bias:
                grad_bias += grad.sum(dim=0)
        return (grad_hidden, grad_weight.to(weight.dtype) if want_weight else None,
                grad_bias.to(bias.dtype) if want_bias else None, None, None, None, None, None)


def chunked_head_logprobs(hidden: Tensor, weight: Tensor, tokens: Tensor, *, chunk: int, temperature: float = 1.0,
                          bias: Tensor | None = None, compute_dtype: torch.dtype | None = None,
                          entropy_grad: bool = False) -> tuple[Tensor, Tensor]:
    """log softmax((hidden @ weight.T + bias) / temperature) at `tokens`, and the entropy, `chunk` positions at a time.

    hidden: (..., H); weight: (V, H); bias: (V,) or None; tokens: (...) -> log-probs (...), entropy (...), both
    float32. Equal to `selective_log_softmax` / `entropy_from_logits` on the full logits (the same ops per
    position); no tensor larger than a few (chunk, V) is ever held. The log-probs are differentiable (hidden,
    weight, bias); the entropy only with `entropy_grad` (an entropy bonus), which costs a matmul more when the
    head is frozen. `compute_dtype`: dtype of the head's matmuls (bf16 under autocast); default the weight's."""
    shape = tokens.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    logprobs, entropy = _ChunkedHead.apply(flat_hidden, weight, bias, tokens.reshape(-1), float(temperature),
                                           max(int(chunk), 1), compute_dtype or weight.dtype, bool(entropy_grad))
    return logprobs.view(shape), entropy.view(shape)


def recomputed_head_logprobs(hidden: Tensor, head, tokens: Tensor, *, chunk: int, temperature: float = 1.0
                             ) -> tuple[Tensor, Tensor]:
    """`chunked_head_logprobs` for any head callable (e.g. a LoRA-adapted output layer): each chunk's forward runs
    under torch.utils.checkpoint, which keeps only the chunk's hidden states and runs the chunk again, with
    autograd, in the backward. hidden: (..., H); tokens: (...) -> log-probs, entropy (...), float32."""
    from torch.utils.checkpoint import checkpoint

    def one_chunk(h: Tensor, tok: Tensor) -> tuple[Tensor, Tensor]:
        logits = head(h)
        return selective_log_softmax(logits, tok, temperature), entropy_from_logits(logits, temperature)

    flat_hidden, flat_tokens = hidden.reshape(-1, hidden.shape[-1]), tokens.reshape(-1)
    parts = [checkpoint(one_chunk, flat_hidden[s:s + chunk], flat_tokens[s:s + chunk], use_reentrant=False)
             if torch.is_grad_enabled() else one_chunk(flat_hidden[s:s + chunk], flat_tokens[s:s + chunk])
             for s in range(0, flat_hidden.shape[0], max(int(chunk), 1))]
    return (torch.cat([p[0] for p in parts]).view(tokens.shape), torch.cat([p[1] for p in parts]).view(tokens.shape))
