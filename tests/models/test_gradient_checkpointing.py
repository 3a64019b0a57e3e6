"""Gradient checkpointing (models/checkpointing.py) gives the gradients of the plain backward (<= 1e-6, float32) and
really recomputes: the lean and HF forwards, full weights and LoRA, a separate value model, a reward model.

Checkpointing gives equal numbers by design, so each test also counts the attention calls made during the
backward (`AttentionCalls`: HF's sdpa layers and the lean forward make one per decoder layer): one per layer
when it is on, none when it is off, so a silent no-op fails."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from rlhflab import models
from rlhflab.data import left_pad, position_ids_from_mask
from rlhflab.models.value import init_scalar_head

from tinyhf import PAD, build

ROWS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 1], [14, 15, 16, 17]]  # left padding of 0, 4 and 3 tokens
LAYERS = 2  # tinyhf's models


class AttentionCalls:
    """Counts F.scaled_dot_product_attention calls (looked up at call time by HF's sdpa attention and models.lean)."""

    def __init__(self, monkeypatch):
        self.count = 0
        original = F.scaled_dot_product_attention

        def counted(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)


def batch():
    ids, mask = left_pad(ROWS, PAD)
    attention = mask.long()
    return ids, attention, position_ids_from_mask(attention)


def lm_loss(model, lean: bool) -> torch.Tensor:
    """A loss over every real position's log-probs of the next token, by the lean or the HF forward."""
    ids, attention, positions = batch()
    if lean:
        plan = models.plan_lean(model, allow_training=True)
        assert plan is not None and plan.checkpoint == (models.checkpointing_on(model) and model.training)
        logits = plan.lm_head(models.lean_hidden(plan, ids, attention, positions))
    else:
        logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return -(logprobs * attention[:, 1:]).sum()


def grads_and_recomputes(model, loss_fn, monkeypatch, checkpointed: bool) -> tuple[dict, int]:
    """(name -> gradient of every trainable parameter, attention calls made by the backward) of a copy of
    `model` in training mode, with checkpointing on or off."""
    model = copy.deepcopy(model)
    if checkpointed:
        models.enable_gradient_checkpointing(model, "test model")
    model.train()
    calls = AttentionCalls(monkeypatch)
    loss = loss_fn(model)
    forward = calls.count
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())
    return grads, calls.count - forward


def assert_same_gradients_and_recomputed(model, loss_fn, monkeypatch, layers: int = LAYERS) -> None:
    plain, recomputed_off = grads_and_recomputes(model, loss_fn, monkeypatch, checkpointed=False)
    checked, recomputed_on = grads_and_recomputes(model, loss_fn, monkeypatch, checkpointed=True)
    assert plain.keys() == checked.keys()
    difference = max((plain[n] - checked[n]).abs().max().item() for n in plain)
    assert difference <= 1e-6, difference
    assert any(g.abs().max() > 0 for g in plain.values())  # the comparison is not of zeros
    assert (recomputed_off, recomputed_on) == (0, layers)  # off: nothing recomputed; on: every layer once


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "hf"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_full_fine_tuning_gradients_equal_and_every_layer_is_recomputed(arch, lean, monkeypatch):
    assert_same_gradients_and_recomputed(build(arch), lambda m: lm_loss(m, lean), monkeypatch)


def test_a_non_lean_architecture_checkpoints_through_hf(monkeypatch):
    model = build("gpt2")
    assert models.plan_lean(model) is None
    assert_same_gradients_and_recomputed(model, lambda m: lm_loss(m, False), monkeypatch)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "hf"])
def test_lora_gradients_equal_without_an_input_grad_hook(lean, monkeypatch):
    """use_reentrant=False needs no input that requires grad: HF's enable_input_require_grads hook is taken off
    and the adapters (A and B of every layer) still get the plain backward's gradients."""
    model = models.apply_lora(build("llama"), r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    checked = models.enable_gradient_checkpointing(copy.deepcopy(model), "lora")
    assert not getattr(checked.get_base_model(), "_require_grads_hooks", None)
    assert_same_gradients_and_recomputed(model, lambda m: lm_loss(m, lean), monkeypatch)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "hf"])
def test_a_separate_value_model_gradients_equal(lean, monkeypatch):
    value_model = models.ValueModel(build("llama").model)
    torch.manual_seed(1)
    init_scalar_head(value_model.value_head.summary)  # a zero head would give the trunk zero gradients
    ids, attention, positions = batch()

    def loss(model):
        if lean:
            assert models.plan_lean(model.backbone, allow_training=True).checkpoint == models.checkpointing_on(model)
        values = model(ids, attention, positions, keep=4, lean=lean)  # lean: its last layer at 4 columns only
        return (values * attention[:, -4:]).pow(2).sum()

    assert_same_gradients_and_recomputed(value_model, loss, monkeypatch)


@pytest.mark.parametrize("packed", [True, False], ids=["packed-lean", "hf"])
def test_a_reward_model_gradients_equal(tokenizer, packed, monkeypatch):
    reward_model = models.build_random_reward_model(tokenizer, seed=0)
    chosen = [[5, 6, 7, 8, 9], [10, 11, 12]]
    rejected = [[5, 6, 7, 13], [10, 11, 14, 15, 16]]

    def loss(model):
        if packed:
            assert models.can_pack_pairs(model)
            pairs = models.pack_shared_prefix(list(zip(chosen, rejected)), PAD)
            good, bad = models.packed_pair_scores(model, pairs)
        else:
            ids, mask = left_pad(chosen + rejected, PAD)
            scores = models.sequence_scores(model, ids, mask.long())
            good, bad = scores[:2], scores[2:]
        return -F.logsigmoid(good - bad).sum()

    assert_same_gradients_and_recomputed(reward_model, loss, monkeypatch)


def test_it_acts_only_in_training_mode_with_grad_on_as_hf_does(monkeypatch):
    model = models.enable_gradient_checkpointing(build("llama"), "policy")
    assert models.checkpointing_on(model) and not models.checkpointing_on(build("llama"))
    assert models.plan_lean(model).checkpoint is False  # eval mode (tinyhf builds in eval): plain lean forward
    for lean in (True, False):
        model.eval()
        calls = AttentionCalls(monkeypatch)
        loss = lm_loss(model, lean)  # eval mode, grad on: nothing recomputed
        forward = calls.count
        loss.backward()
        assert calls.count == forward
        model.train()
        with torch.no_grad():  # training mode, no grad (the rollout's forwards): no checkpoint to replay
            lm_loss(model, lean)


def test_a_model_without_checkpointing_support_is_a_clear_error():
    from rlhflab.errors import UserInputError

    with pytest.raises(UserInputError, match="--gradient_checkpointing"):
        models.enable_gradient_checkpointing(models.ValueHead(8), "value head")
