"""The lean forward's grouped-query attention: key / value heads repeated (what a GPU gets under a mask) or read
grouped by SDPA (enable_gqa): the same outputs bit for bit, the same gradients up to summation order."""

import pytest
import torch

from rlhflab.models.lean import attention_bias, causal_allowed, grouped_attention, repeats_kv_heads


def inputs(heads=14, kv_heads=2, length=9, dim=8, batch=3):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, length, dim, generator=gen, requires_grad=True)
    k = torch.randn(batch, kv_heads, length, dim, generator=gen, requires_grad=True)
    v = torch.randn(batch, kv_heads, length, dim, generator=gen, requires_grad=True)
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[0, :3] = False  # left padding in one row
    return q, k, v, causal_allowed(mask).unsqueeze(1)


def outputs_and_grads(repeat_kv, mask_kind):
    q, k, v, allowed = inputs()
    mask = {"bool": allowed, "additive": attention_bias(allowed, q.dtype)}[mask_kind]
    out = grouped_attention(q, k, v, mask, 0.3, repeat_kv=repeat_kv)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
def test_repeated_key_value_heads_give_the_grouped_numbers(mask_kind):
    grouped, repeated = outputs_and_grads(False, mask_kind), outputs_and_grads(True, mask_kind)
    assert torch.equal(grouped[0], repeated[0]) and torch.equal(grouped[1], repeated[1])  # outputs, query gradients
    for a, b in zip(grouped[2:], repeated[2:]):  # key / value gradients: the group's queries summed in another order
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-6)


def test_grouped_attention_is_plain_attention_over_each_querys_group():
    """Against a naive reference: query head h reads key / value head h // (heads / kv_heads)."""
    q, k, v, allowed = inputs(heads=6, kv_heads=3)
    out = grouped_attention(q, k, v, allowed, 0.5)
    group = torch.arange(6) // 2
    scores = (q @ k[:, group].transpose(-1, -2)) * 0.5
    expected = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v[:, group]
    assert torch.allclose(out, expected, atol=1e-6)


def test_the_lean_forward_asks_the_rule_and_repeats_the_heads_when_told(monkeypatch):
    """What a GPU gets (the heads repeated under a mask), forced on the CPU: the dispatch reads
    `repeats_kv_heads` with the device and whether a mask is given, and the numbers stay the grouped ones."""
    from rlhflab.models import lean

    q, k, v, allowed = inputs()
    grouped = grouped_attention(q, k, v, allowed, 0.3)
    asked = []
    monkeypatch.setattr(lean, "repeats_kv_heads", lambda device, masked: asked.append((device, masked)) or True)
    repeats = []
    real = torch.Tensor.repeat_interleave
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", lambda t, *a, **kw: repeats.append(a) or real(t, *a, **kw))
    assert torch.equal(lean.grouped_attention(q, k, v, allowed, 0.3), grouped)
    assert asked == [("cpu", True)] and repeats == [(7,), (7,)]


def test_only_a_masked_gpu_attention_repeats_the_heads():
    assert repeats_kv_heads("cuda", masked=True)
    assert not repeats_kv_heads("cuda", masked=False)  # the fused kernels take enable_gqa without a mask
    assert not repeats_kv_heads("cpu", masked=True)
