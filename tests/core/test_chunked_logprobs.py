"""Vocabulary-chunked log-probs and entropy equal the full-logits ones, values and gradients."""

import math

import pytest
import torch

from rlhflab.core.logprobs import (chunked_head_logprobs, entropy_from_logits, recomputed_head_logprobs,
                                   selective_log_softmax)


def _inputs(bias: bool, seed: int = 0, shape=(3, 7), hidden_size=16, vocab=50, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, hidden_size, generator=g).to(dtype).requires_grad_()
    # logits of std ~1 as a language model's; the matmul of a chunk may round its last bit differently from the
    # whole batch's (BLAS blocks by row count), so larger logits would differ by more than 1e-6 for that alone
    weight = (torch.randn(vocab, hidden_size, generator=g) * 0.25).to(dtype).requires_grad_()
    b = torch.randn(vocab, generator=g).to(dtype).requires_grad_() if bias else None
    tokens = torch.randint(0, vocab, shape, generator=g)
    return hidden, weight, b, tokens


def _full(hidden, weight, bias, tokens, temperature):
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return selective_log_softmax(logits, tokens, temperature), entropy_from_logits(logits, temperature)


def _grads(tensors, outputs, seed: int = 1):
    """Gradients of a random weighted sum of log-probs and entropies (both enter the loss)."""
    g = torch.Generator().manual_seed(seed)
    logprobs, entropy = outputs
    loss = (torch.randn(logprobs.shape, generator=g).to(logprobs.dtype) * logprobs).sum() + \
        (torch.randn(entropy.shape, generator=g).to(entropy.dtype) * entropy).sum()
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


# within 1e-6 absolute or relative, a few float32 ulps: both sides take the softmax in float32, and a chunk's
# matmul may round its last bit differently from the whole batch's (BLAS blocks by row count)
TOLERANCE = {torch.float32: dict(atol=1e-6, rtol=1e-6)}


def assert_gradients_close(got, want):
    """Within 1e-6 of the gradient's largest entry: a weight's gradient sums over positions, chunk by chunk here."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-6 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_chunked_head_equals_full_logits_values_and_gradients(dtype, temperature, bias, chunk):
    hidden, weight, b, tokens = _inputs(bias, dtype=dtype)
    full = _full(hidden, weight, b, tokens, temperature)
    got = chunked_head_logprobs(hidden, weight, tokens, chunk=chunk, temperature=temperature, bias=b,
                                compute_dtype=dtype, entropy_grad=True)
    for x, y in zip(got, full):
        assert x.shape == tokens.shape
        torch.testing.assert_close(x, y.float(), **TOLERANCE[torch.float32])
    for x, y in zip(_grads((hidden, weight, b), got), _grads((hidden, weight, b), full)):
        assert_gradients_close(x, y)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recomputed_head_equals_full_logits_values_and_gradients(temperature):
    hidden, weight, b, tokens = _inputs(True)
    head = lambda h: torch.nn.functional.linear(h, weight, b)  # noqa: E731
    full = _full(hidden, weight, b, tokens, temperature)
    got = recomputed_head_logprobs(hidden, head, tokens, chunk=4, temperature=temperature)
    for x, y in zip(got, full):
        torch.testing.assert_close(x, y, **TOLERANCE[torch.float32])
    for x, y in zip(_grads((hidden, weight, b), got), _grads((hidden, weight, b), full)):
        assert_gradients_close(x, y)


def test_chunked_head_hand_worked():
    # hidden [1], weight [[0], [ln 3]] -> logits [0, ln 3] -> probs [1/4, 3/4]
    hidden = torch.ones(1, 1)
    weight = torch.tensor([[0.0], [math.log(3.0)]])
    logprobs, entropy = chunked_head_logprobs(hidden[0], weight, torch.tensor(1), chunk=1)
    assert math.isclose(logprobs.item(), math.log(0.75), rel_tol=1e-6)
    assert math.isclose(entropy.item(), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), rel_tol=1e-6)


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_frozen_head_precomputes_the_hidden_gradient(entropy_grad, temperature):
    """A frozen head (a LoRA base): the hidden states' gradient, formed in the forward, equals the full path's."""
    hidden, weight, b, tokens = _inputs(True)
    weight.requires_grad_(False)
    b.requires_grad_(False)
    got = chunked_head_logprobs(hidden, weight, tokens, chunk=3, temperature=temperature, bias=b,
                                entropy_grad=entropy_grad)
    full = _full(hidden, weight, b, tokens, temperature)
    if not entropy_grad:
        assert not got[1].requires_grad
        got, full = (got[0], got[0].detach() * 0), (full[0], full[0].detach() * 0)
    for x, y in zip(_grads((hidden,), got), _grads((hidden,), full)):
        assert_gradients_close(x, y)


def test_entropy_without_entropy_grad_is_not_differentiable():
    hidden, weight, _, tokens = _inputs(False)
    logprobs, entropy = chunked_head_logprobs(hidden, weight, tokens, chunk=4)
    assert logprobs.requires_grad and not entropy.requires_grad


def test_bf16_compute_dtype_matches_bf16_autocast_logits():
    """Under bf16 the head's matmul runs in bf16 (as autocast would) and the softmax in float32."""
    hidden, weight, _, tokens = _inputs(False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = torch.nn.functional.linear(hidden, weight)
    assert logits.dtype == torch.bfloat16
    want = selective_log_softmax(logits, tokens)
    got, _ = chunked_head_logprobs(hidden, weight, tokens, chunk=4, compute_dtype=torch.bfloat16)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_bf16_trained_head_gradients_match_bf16_autocast():
    """A trained head under bf16: the weight's gradient, summed chunk by chunk in float32 from bf16 products, is
    the autocast path's to bf16 rounding; the hidden states' too."""
    hidden, weight, _, tokens = _inputs(False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = selective_log_softmax(torch.nn.functional.linear(hidden, weight), tokens)
    got, _ = chunked_head_logprobs(hidden, weight, tokens, chunk=4, compute_dtype=torch.bfloat16)
    for x, y in zip(torch.autograd.grad(got.sum(), [hidden, weight]), torch.autograd.grad(want.sum(), [hidden, weight])):
        assert x.dtype == y.dtype == torch.float32
        torch.testing.assert_close(x, y, atol=2e-2, rtol=2e-2)
