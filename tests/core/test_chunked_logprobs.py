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
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
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


@pytest.mark.parametrize("frozen", [True, False])
def test_a_loss_reading_only_the_entropy_gets_its_gradient(frozen):
    """An entropy bonus alone (the log-probs unread: autograd hands the backward None for them): the hidden
    states' gradient equals the full path's, for a frozen head and a trained one."""
    hidden, weight, b, tokens = _inputs(True)
    weight.requires_grad_(not frozen)
    b.requires_grad_(not frozen)
    _, entropy = chunked_head_logprobs(hidden, weight, tokens, chunk=3, temperature=0.7, bias=b, entropy_grad=True)
    _, full = _full(hidden, weight, b, tokens, 0.7)
    scale = torch.linspace(-1.0, 2.0, entropy.numel()).view(entropy.shape)
    got, = torch.autograd.grad((scale * entropy).sum(), [hidden])
    want, = torch.autograd.grad((scale * full).sum(), [hidden])
    assert_gradients_close(got, want)


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


@pytest.mark.parametrize("trained_head", [False, True])
def test_bf16_hidden_states_give_float32_outputs_and_the_float32_runs_gradient_rounded_once(trained_head):
    """A model in bf16 hands the head bf16 hidden states: the log-probs, entropies and the float32 softmax
    statistics kept for the backward stay float32, equal bit for bit to the same values in float32, and the
    hidden states' gradient is the float32 one rounded to bf16 once (a frozen head's per-position vectors kept in
    bf16 would round it twice: a loss weight of 3 makes that visible)."""
    hidden, weight, b, tokens = _inputs(True)
    hidden = hidden.detach().to(torch.bfloat16)
    weight.requires_grad_(trained_head)
    b.requires_grad_(trained_head)
    runs = []
    for h in (hidden.float().requires_grad_(), hidden.clone().requires_grad_()):
        logprobs, entropy = chunked_head_logprobs(h, weight, tokens, chunk=4, temperature=0.7, bias=b,
                                                  entropy_grad=True)
        loss = 3.0 * logprobs.sum() + 3.0 * entropy.sum()
        runs.append((logprobs, entropy, *torch.autograd.grad(loss, [h, weight, b] if trained_head else [h])))
    (lp32, ent32, grad32, *head32), (lp16, ent16, grad16, *head16) = runs
    assert lp16.dtype == ent16.dtype == torch.float32 and grad16.dtype == torch.bfloat16
    assert torch.equal(lp16, lp32) and torch.equal(ent16, ent32)
    assert torch.equal(grad16, grad32.to(torch.bfloat16))
    for x, y in zip(head16, head32):
        assert torch.equal(x, y)


def test_a_bf16_heads_gradients_are_summed_in_float32_then_rounded_once():
    """bf16 weight and bias, trained: each chunk's products are summed in float32 and rounded to bf16 at the end,
    so the gradients equal a float32 head holding the same bf16 values (matmuls in bf16), rounded; summing 21
    one-position chunks in bf16 would lose ~8 bits."""
    hidden, weight, b, tokens = _inputs(True)
    hidden = hidden.detach()
    weight, b = weight.detach().to(torch.bfloat16), b.detach().to(torch.bfloat16)
    grads = []
    for w_, b_ in ((weight.float(), b.float()), (weight, b)):
        w_, b_ = w_.clone().requires_grad_(), b_.clone().requires_grad_()
        logprobs, entropy = chunked_head_logprobs(hidden, w_, tokens, chunk=1, bias=b_,
                                                  compute_dtype=torch.bfloat16, entropy_grad=True)
        grads.append(torch.autograd.grad(logprobs.sum() + entropy.sum(), [w_, b_]))
    for x, y in zip(grads[1], grads[0]):
        assert x.dtype == torch.bfloat16
        assert torch.equal(x, y.to(torch.bfloat16))


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_a_frozen_head_with_bf16_matmuls_gives_the_trained_paths_hidden_gradient(entropy_grad):
    """compute_dtype bf16 (autocast) and a frozen float32 head: the per-position vectors formed in the forward take
    their matmul in bf16 too, and give the hidden gradient a trained head's backward gives, to bf16 rounding."""
    hidden, weight, b, tokens = _inputs(True)
    b = b.detach()
    grads = []
    for frozen in (True, False):
        weight.requires_grad_(not frozen)
        h = hidden.detach().clone().requires_grad_()
        logprobs, entropy = chunked_head_logprobs(h, weight, tokens, chunk=4, temperature=0.7, bias=b,
                                                  compute_dtype=torch.bfloat16, entropy_grad=entropy_grad)
        loss = logprobs.sum() + (entropy.sum() if entropy_grad else 0.0)
        grads.append(torch.autograd.grad(loss, [h])[0])
    torch.testing.assert_close(grads[0], grads[1], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("trains", ["hidden", "hidden weight", "hidden bias", "weight"])
def test_the_head_is_formed_once_per_chunk_and_again_only_for_a_trained_head(monkeypatch, trains):
    """7 positions in chunks of 3 are 3 head matmuls forward; a frozen head (only the hidden states trained)
    needs none in the backward, a trained weight or bias 3 more. A chunk of 0 or 1 is one position a chunk."""
    calls = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: calls.append(1) or linear(*a))
    hidden, weight, b, tokens = _inputs(True, shape=(1, 7))
    hidden.requires_grad_("hidden" in trains)
    weight.requires_grad_("weight" in trains)
    b.requires_grad_("bias" in trains)
    logprobs, _ = chunked_head_logprobs(hidden, weight, tokens, chunk=3, bias=b)
    assert len(calls) == 3
    logprobs.sum().backward()
    assert len(calls) == (3 if trains == "hidden" else 6)
    for chunk in (0, 1):
        calls.clear()
        with torch.no_grad():
            chunked_head_logprobs(hidden, weight, tokens, chunk=chunk, bias=b)
        assert len(calls) == 7


def test_the_recomputed_head_runs_each_chunk_again_in_the_backward_only():
    """torch.utils.checkpoint is what keeps the (chunk, V) logits out of memory: under autograd each chunk's head
    runs once forward and once more in the backward; without autograd once. The gradient still reaches a head
    whose input needs none (non-reentrant checkpointing)."""
    hidden, weight, b, tokens = _inputs(True, shape=(1, 7))
    calls = []
    head = lambda h: calls.append(h.shape[0]) or torch.nn.functional.linear(h, weight, b)  # noqa: E731
    with torch.no_grad():
        recomputed_head_logprobs(hidden, head, tokens, chunk=3)
    assert calls == [3, 3, 1]
    calls.clear()
    logprobs, entropy = recomputed_head_logprobs(hidden.detach(), head, tokens, chunk=3)
    assert calls == [3, 3, 1]
    (logprobs.sum() + entropy.sum()).backward()
    assert sorted(calls) == [1, 1, 3, 3, 3, 3]
    full = _full(hidden.detach(), weight, b, tokens, 1.0)
    want = torch.autograd.grad(full[0].sum() + full[1].sum(), [weight])[0]
    assert_gradients_close(weight.grad, want)
