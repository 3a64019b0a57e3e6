"""Shared-prefix packing of reward-model pairs (models/packing.py) against scoring each sequence alone."""

import pytest
from reward_scores import separate_scores
import torch

from rlhflab.models import (
    build_random_reward_model,
    build_tokenizer,
    can_pack_pairs,
    disable_dropout,
    pack_shared_prefix,
    packed_length,
    packed_pair_scores,
)
from rlhflab.tasks import template_corpus

TINY = dict(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)
PAD = 0
# (chosen, rejected): a shared prompt of different lengths; the second pair's rejected and the fourth's
# chosen lie wholly inside the shared prefix (a missing-EOS answer); the third shares nothing but the first
# token; the fifth is two identical sequences
PAIRS = [
    ([5, 6, 7, 8, 9, 10, 3], [5, 6, 7, 8, 11, 12, 13, 3]),
    ([5, 6, 14, 15, 3], [5, 6, 14, 15]),
    ([7, 8, 3], [7, 20, 21, 22, 23, 24, 3]),
    ([5, 6, 7], [5, 6, 7, 8, 3]),
    ([9, 10, 11, 3], [9, 10, 11, 3]),
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(template_corpus(), 64)


def test_layout_of_a_packed_row():
    packed = pack_shared_prefix([([1, 2, 3, 4], [1, 2, 5])], pad_id=PAD)
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 5]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2]]  # 5 sits where it would in [1, 2, 5]
    assert (packed.first_last.item(), packed.second_last.item()) == (3, 4)
    allowed = packed.allowed[0].int().tolist()
    assert allowed[4] == [1, 1, 0, 0, 1]  # the second rest reads the prefix and itself, never 3 or 4
    assert allowed[3] == [1, 1, 1, 1, 0]
    assert allowed[1] == [1, 1, 0, 0, 0]
    assert packed_length([1, 2, 3, 4], [1, 2, 5]) == 5


def test_a_sequence_inside_the_prefix_and_padding():
    packed = pack_shared_prefix([([1, 2, 3], [1, 2]), ([4, 5, 6, 7, 8], [9])], pad_id=PAD)
    assert packed.input_ids.tolist() == [[1, 2, 3, 0, 0, 0], [4, 5, 6, 7, 8, 9]]
    assert packed.second_last.tolist() == [1, 5]
    assert packed.position_ids[1].tolist() == [0, 1, 2, 3, 4, 0]  # nothing shared: the second starts at 0
    pad_rows = packed.allowed[0, 3:]
    assert pad_rows.sum(-1).tolist() == [1, 1, 1]  # a padding query reads itself only: no row fully masked
    assert not packed.allowed[0, :3, 3:].any()  # real tokens never read padding


def test_empty_input_is_refused():
    with pytest.raises(ValueError):
        pack_shared_prefix([([1], [])], pad_id=PAD)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_scores_and_gradients_equal_separate_sequences(tokenizer, arch):
    model = build_random_reward_model(tokenizer, arch=arch, **TINY, seed=1)
    disable_dropout(model)
    model.train()
    assert can_pack_pairs(model)
    with torch.no_grad():  # a non-zero head, so the gradient reaches the trunk
        model.score.weight.normal_(0, 1.0)

    def run(packed: bool):
        model.zero_grad()
        if packed:
            chosen, rejected = packed_pair_scores(model, pack_shared_prefix(PAIRS, PAD))
        else:
            scores = separate_scores(model, [c for c, _ in PAIRS] + [r for _, r in PAIRS], PAD)
            chosen, rejected = scores[: len(PAIRS)], scores[len(PAIRS) :]
        (chosen * torch.tensor([1.0, -2.0, 0.5, 1.5, -1.0]) + rejected ** 2).sum().backward()
        return chosen.detach(), rejected.detach(), [p.grad.clone() for p in model.parameters()]

    c_sep, r_sep, g_sep = run(packed=False)
    c_pack, r_pack, g_pack = run(packed=True)
    assert torch.allclose(c_pack, c_sep, atol=1e-5) and torch.allclose(r_pack, r_sep, atol=1e-5)
    assert c_sep.abs().max() > 0.1  # the head is not ~0, so equality is not trivial
    for a, b in zip(g_pack, g_sep):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_models_the_lean_forward_cannot_run_are_not_packed(tokenizer):
    gpt2 = build_random_reward_model(tokenizer, arch="gpt2", **TINY)
    assert not can_pack_pairs(gpt2)
    with pytest.raises(ValueError, match="can_pack_pairs"):
        packed_pair_scores(gpt2, pack_shared_prefix(PAIRS, PAD))
