"""ValueHead init, ValueModel save/load round trip, init from a reward-model folder, shared-trunk hidden states."""

from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file

from rlhflab.models import ValueHead, ValueModel, build_reward_model_from_causal, build_tiny_model, build_tokenizer
from rlhflab.models import last_hidden_state, save_model_folder
from rlhflab.tasks import template_corpus

TINY = dict(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)


@pytest.fixture(scope="module")
def suite_tokenizer():
    return build_tokenizer(template_corpus(), 256)


@pytest.fixture(scope="module")
def batch(suite_tokenizer):
    ids = [suite_tokenizer.encode(t) for t in ("Add 3 and 4.\nRESULT: 7", "yes")]
    length = max(map(len, ids))
    input_ids = torch.tensor([[0] * (length - len(x)) + x for x in ids])  # left padded
    mask = torch.tensor([[0] * (length - len(x)) + [1] * len(x) for x in ids])
    return input_ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def test_value_head_starts_at_zero_and_is_linear():
    head = ValueHead(99)
    assert torch.count_nonzero(head.summary.weight) == 0 and torch.equal(head.summary.bias, torch.zeros(1))
    hidden = torch.randn(2, 5, 99)
    assert torch.equal(head(hidden), torch.zeros(2, 5))
    with torch.no_grad():
        head.summary.weight.normal_()
        head.summary.bias.fill_(0.5)
    values = head(hidden)
    assert values.shape == (2, 5)
    assert torch.allclose(values, hidden @ head.summary.weight[0] + 0.5, atol=1e-5)


def test_value_model_round_trip(tmp_path, suite_tokenizer, batch):
    folder = save_model_folder(tmp_path / "sft", build_tiny_model(suite_tokenizer, **TINY), suite_tokenizer)
    model = ValueModel.from_pretrained(folder).eval()
    assert type(model.backbone).__name__ == "LlamaModel"
    with torch.no_grad():
        model.value_head.summary.bias.fill_(0.25)  # something a fresh head would not have
        values = model(*batch)
    assert values.shape == batch[0].shape and values.dtype == torch.float32
    out = model.save_pretrained(tmp_path / "value")
    assert (out / "value_head.safetensors").is_file() and (out / "model.safetensors").is_file()
    loaded = ValueModel.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(loaded(*batch), values)
    assert loaded.value_head.summary.bias.item() == 0.25


def test_value_model_from_reward_model_copies_score(tmp_path, suite_tokenizer, batch):
    reward_model = build_reward_model_from_causal(build_tiny_model(suite_tokenizer, **TINY), suite_tokenizer)
    reward_model.save_pretrained(tmp_path / "rm")
    model = ValueModel.from_pretrained(tmp_path / "rm").eval()
    saved = load_file(str(tmp_path / "rm" / "model.safetensors"))
    assert torch.equal(model.value_head.summary.weight, saved["score.weight"])
    assert torch.equal(model.value_head.summary.bias, torch.zeros(1))
    with torch.no_grad():  # value at every position = the reward model's score at that position
        hidden = reward_model.eval().model(input_ids=batch[0], attention_mask=batch[1],
                                           position_ids=batch[2]).last_hidden_state
        assert torch.equal(model(*batch), reward_model.score(hidden)[..., 0])


def test_last_hidden_state_is_the_backbone_output(suite_tokenizer, batch):
    policy = build_tiny_model(suite_tokenizer, **TINY).eval()
    with torch.no_grad():
        hidden = last_hidden_state(policy, *batch)
        expected = policy.model(input_ids=batch[0], attention_mask=batch[1], position_ids=batch[2]).last_hidden_state
    assert hidden.shape == (*batch[0].shape, 32)
    assert torch.equal(hidden, expected)
