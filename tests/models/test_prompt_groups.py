"""Sequences grouped by their shared prompt (models/prompt_groups.py) against scoring each sequence alone."""

import pytest
from reward_scores import separate_scores
import torch

from rlhflab.models import build_random_reward_model, build_tokenizer, disable_dropout, grouped_scores, pack_groups
from rlhflab.models.prompt_groups import group_prefix_length
from rlhflab.tasks import template_corpus

TINY = dict(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)
PAD = 0
# groups of distinct sequences: a prompt with four answers of different lengths; a group whose second
# sequence is the first's prefix (a missing-EOS answer); a lone sequence; two sequences sharing one token;
# a long group that forces a second row
GROUPS = [
    [[5, 6, 7, 8, 9, 3], [5, 6, 7, 8, 11, 12, 3], [5, 6, 7, 8, 13], [5, 6, 7, 8, 9, 10, 14, 15, 3]],
    [[5, 6, 14, 15, 3], [5, 6, 14, 15]],
    [[9, 10, 11, 3]],
    [[7, 8, 3], [7, 20, 21, 22, 23, 24, 3]],
    [[4] * 12 + [30, 3], [4] * 12 + [31, 32, 3], [4] * 12 + [33, 3]],
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(template_corpus(), 64)


def test_layout_of_one_group():
    packed = pack_groups([[[1, 2, 3, 4], [1, 2, 5], [1, 2, 6, 7]]], pad_id=PAD)
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2, 2, 3]]  # each rest sits where it would alone
    allowed = packed.allowed()[0].int().tolist()
    assert allowed[4] == [1, 1, 0, 0, 1, 0, 0]  # the second rest reads the prefix and itself, never the first
    assert allowed[6] == [1, 1, 0, 0, 0, 1, 1]
    assert allowed[3] == [1, 1, 1, 1, 0, 0, 0]
    flat_reads = packed.read.reshape(-1)[packed.score_index].tolist()
    assert flat_reads == [3, 4, 6]  # each sequence's last token


def test_prefix_leaves_every_sequence_a_token_of_its_own():
    assert group_prefix_length([[1, 2, 3], [1, 2]]) == 1  # [1, 2] lies inside the shared part: it keeps its 2
    assert group_prefix_length([[1, 2, 3]]) == 2
    assert group_prefix_length([[1, 2, 3], [4, 5]]) == 0


def test_groups_share_rows_and_no_token_reads_another_group_or_sequence():
    groups = [[[1, 2, 3], [1, 2, 4]], [[5, 6], [5, 7]], [[8] * 6]]
    packed = pack_groups(groups, pad_id=PAD)
    rows, width = packed.input_ids.shape
    assert rows * width < 3 + 2 + 6 + 3 + 6  # fewer slots than one padded row per group
    group_tokens = sorted(t for t in packed.input_ids.reshape(-1).tolist() if t != PAD)
    assert group_tokens == sorted([1, 2, 3, 4, 5, 6, 7] + [8] * 6)
    allowed, group, part = packed.allowed(), packed.group.tolist(), packed.part.tolist()
    for r in range(rows):  # against the rule spelt out slot by slot
        for i in range(width):
            for j in range(width):
                own = group[r][i] >= 0 and group[r][j] == group[r][i] and part[r][j] in (0, part[r][i])
                assert bool(allowed[r, i, j]) == ((j <= i and own) or i == j), (r, i, j)


def test_empty_input_is_refused():
    with pytest.raises(ValueError):
        pack_groups([[[1], []]], pad_id=PAD)
    with pytest.raises(ValueError):
        pack_groups([], pad_id=PAD)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_grouped_scores_and_gradients_equal_separate_sequences(tokenizer, arch):
    model = build_random_reward_model(tokenizer, arch=arch, **TINY, seed=1)
    disable_dropout(model)
    model.train()
    with torch.no_grad():  # a non-zero head, so the gradient reaches the trunk
        model.score.weight.normal_(0, 1.0)
    sequences = [s for g in GROUPS for s in g]
    weights = torch.linspace(-2.0, 2.0, len(sequences))

    def run(grouped: bool):
        model.zero_grad()
        scores = grouped_scores(model, pack_groups(GROUPS, PAD)) if grouped else separate_scores(model, sequences, PAD)
        (scores * weights + scores ** 2).sum().backward()
        return scores.detach(), [p.grad.clone() for p in model.parameters()]

    s_sep, g_sep = run(grouped=False)
    s_grp, g_grp = run(grouped=True)
    assert s_grp.shape == (len(sequences),)
    assert torch.allclose(s_grp, s_sep, atol=1e-5)
    assert s_sep.std() > 0.1  # the head is not ~0 and the sequences differ, so equality is not trivial
    for a, b in zip(g_grp, g_sep):  # float summation order only: within 1e-6 of each gradient's largest entry
        assert torch.allclose(a, b, atol=1e-6 * b.abs().max().item())


def test_models_the_lean_forward_cannot_run_are_refused(tokenizer):
    gpt2 = build_random_reward_model(tokenizer, arch="gpt2", **TINY)
    with pytest.raises(ValueError, match="can_pack_pairs"):
        grouped_scores(gpt2, pack_groups(GROUPS, PAD))
