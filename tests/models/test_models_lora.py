"""LoRA: the reference (adapters off) is the base model exactly; policy and value adapters both train."""

from __future__ import annotations

import copy

import pytest
import torch

from rlhflab.errors import UserInputError
from rlhflab.models import adapter_values, adapters_off, add_value_adapter, apply_lora, build_tiny_model, build_tokenizer
from rlhflab.models import trainable_parameters, use_adapter
from rlhflab.tasks import template_corpus

TINY = dict(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)


@pytest.fixture(scope="module")
def suite_tokenizer():
    return build_tokenizer(template_corpus(), 256)


@pytest.fixture()
def setup(suite_tokenizer):
    base = build_tiny_model(suite_tokenizer, **TINY).eval()
    reference = copy.deepcopy(base)
    ids = torch.tensor([suite_tokenizer.encode("Add 3 and 4.\nRESULT: 7") + [suite_tokenizer.eos_token_id]])
    mask = torch.ones_like(ids)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    return base, reference, (ids, mask, positions)


def base_weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


def lora_weights(model, adapter):
    return {n: p.detach().clone() for n, p in model.named_parameters() if f".{adapter}." in n and "lora_" in n}


def policy_step(model, ids, lr=0.1):
    optimizer = torch.optim.SGD(trainable_parameters(model), lr=lr)
    model(input_ids=ids).logits.logsumexp(-1).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_reference_is_the_base_model_before_and_after_a_step(setup):
    base, reference, (ids, _, _) = setup
    model = apply_lora(base, r=4, alpha=8)
    before = base_weights(model)
    with torch.no_grad():
        expected = reference(ids).logits
        assert torch.equal(model(input_ids=ids).logits, expected)  # B = 0 at init: policy == reference
        with model.disable_adapter():
            assert torch.equal(model(input_ids=ids).logits, expected)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    policy_step(model, ids)
    with torch.no_grad():
        assert not torch.equal(model(input_ids=ids).logits, expected)  # the policy moved
        with model.disable_adapter():
            assert torch.equal(model(input_ids=ids).logits, expected)  # the reference did not
    after = base_weights(model)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_value_adapter_and_policy_adapter_both_train(setup):
    base, reference, (ids, mask, positions) = setup
    model = apply_lora(base, r=4, alpha=8)
    head = add_value_adapter(model, r=4, alpha=8)
    torch.nn.init.normal_(head.summary.weight, std=0.1)  # a fresh head is zero: no gradient would reach the adapter
    assert model.active_adapter == "default"
    policy_before, value_before = lora_weights(model, "default"), lora_weights(model, "value")
    frozen_before = base_weights(model)
    assert policy_before and value_before
    # peft's add_adapter leaves a new adapter frozen; ours must be trainable
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)
    params = trainable_parameters(model) + list(head.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)

    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    values = adapter_values(model, head, ids, mask, positions)
    assert values.shape == ids.shape and model.active_adapter == "default"
    (logits.logsumexp(-1).mean() + values.square().mean()).backward()
    named = dict(model.named_parameters())
    for adapter in ("default", "value"):
        grads = [named[n].grad for n in lora_weights(model, adapter) if "lora_B" in n]
        assert all(g is not None and g.abs().sum() > 0 for g in grads), adapter
    assert head.summary.weight.grad.abs().sum() > 0
    optimizer.step()

    policy_after, value_after = lora_weights(model, "default"), lora_weights(model, "value")
    assert all(not torch.equal(policy_before[n], policy_after[n]) for n in policy_before if "lora_B" in n)
    assert all(not torch.equal(value_before[n], value_after[n]) for n in value_before if "lora_B" in n)
    assert all(torch.equal(frozen_before[n], p) for n, p in base_weights(model).items())
    with torch.no_grad(), adapters_off(model):  # reference is still the untouched base model
        assert torch.equal(model(input_ids=ids).logits, reference(ids).logits)
    # both adapters still trainable after switching back and forth
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)


def test_peft_disable_adapter_freezes_the_inactive_adapter(setup):
    """The peft behaviour `adapters_off` / `use_adapter` guard against (see rlhflab/models/lora.py)."""
    base, _, _ = setup
    model = apply_lora(base, r=4, alpha=8)
    add_value_adapter(model, r=4, alpha=8)
    with model.disable_adapter():
        pass
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" in n and ".value." in n)
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n and ".default." in n)


def test_use_adapter_switches_and_restores(setup):
    base, _, (ids, mask, positions) = setup
    model = apply_lora(base, r=4, alpha=8)
    add_value_adapter(model, r=4, alpha=8)
    with torch.no_grad():  # make the value adapter change the output
        for name, param in model.named_parameters():
            if "lora_B.value" in name:
                param.fill_(0.01)
        policy_logits = model(input_ids=ids).logits
        with use_adapter(model, "value"):
            assert model.active_adapter == "value"
            assert not torch.equal(model(input_ids=ids).logits, policy_logits)
        assert model.active_adapter == "default"
        assert torch.equal(model(input_ids=ids).logits, policy_logits)
    with pytest.raises(UserInputError, match="no adapter named 'critic'"):
        with use_adapter(model, "critic"):
            pass
    with pytest.raises(UserInputError, match="already exists"):
        add_value_adapter(model, r=4, alpha=8)


def _lora_with_moved_adapter(base, **kwargs):
    model = apply_lora(base, r=4, alpha=8, **kwargs)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)  # B starts at zero: move it so the adapter changes the output
    return model.eval()


def test_merged_generation_gives_the_same_tokens_and_restores_the_exact_weights(setup, suite_tokenizer):
    from rlhflab.models import merged_adapter
    from rlhflab.rollout import GenerationSettings, generate

    base, _, _ = setup
    model = _lora_with_moved_adapter(base)
    prompts = [suite_tokenizer.encode("Add 3 and 4."), suite_tokenizer.encode("Repeat the sentence exactly:\nab")]
    kwargs = dict(pad_id=suite_tokenizer.pad_token_id, eos_id=suite_tokenizer.eos_token_id,
                  settings=GenerationSettings(max_new_tokens=8, do_sample=False))
    tensors = {n: p.data for n, p in model.named_parameters()}  # the tensor objects themselves
    values = {n: t.clone() for n, t in tensors.items()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    unmerged = generate(model, prompts, lean=False, **kwargs)
    with merged_adapter(model):
        assert any(not torch.equal(p.data, values[n]) for n, p in model.named_parameters())  # merged inside
        merged_lean = generate(model, prompts, **kwargs)
        merged_hf = generate(model, prompts, lean=False, **kwargs)
    assert torch.equal(merged_lean.response_ids, unmerged.response_ids)
    assert torch.equal(merged_hf.response_ids, unmerged.response_ids)
    for name, param in model.named_parameters():
        assert param.data is tensors[name] or param.data.data_ptr() == tensors[name].data_ptr(), name
        assert torch.equal(param.data, values[name]), name  # bit-identical, not W + BA - BA
        assert param.requires_grad == flags[name], name
    assert not any(m.disable_adapters for m in model.modules() if hasattr(m, "lora_A"))  # adapters back on


def test_adapters_off_is_the_base_and_restores_switches_and_trainability(setup):
    base, reference, (ids, _, _) = setup
    model = _lora_with_moved_adapter(base)
    add_value_adapter(model, r=4, alpha=8)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    with torch.no_grad():
        policy = model(input_ids=ids).logits
        with adapters_off(model):
            assert torch.equal(model(input_ids=ids).logits, reference(ids).logits)
        assert torch.equal(model(input_ids=ids).logits, policy)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert any(flags[n] for n in flags if ".value." in n) and any(flags[n] for n in flags if ".default." in n)
