"""The rollout's diversity metrics against hand-computed values."""

import pytest
import torch

from rlhflab.rollout.diversity import capped_share, distinct_n, diversity_metrics, duplicate_share, response_tokens


def batch():
    """Four responses (EOS = 2, pad after it); row 3 hit the length cap."""
    ids = torch.tensor([[5, 6, 7, 2, 0],
                        [5, 6, 5, 6, 2],
                        [5, 6, 7, 2, 0],
                        [9, 9, 9, 9, 9]])
    mask = torch.tensor([[1, 1, 1, 1, 0],
                         [1, 1, 1, 1, 1],
                         [1, 1, 1, 1, 0],
                         [1, 1, 1, 1, 1]], dtype=torch.bool)
    ended = torch.tensor([True, True, True, False])
    return ids, mask, ended


def test_response_tokens_drop_what_follows_eos():
    ids, mask, _ = batch()
    assert response_tokens(ids, mask) == [(5, 6, 7, 2), (5, 6, 5, 6, 2), (5, 6, 7, 2), (9, 9, 9, 9, 9)]


def test_distinct_2_hand_worked():
    ids, mask, _ = batch()
    # bigrams: (5,6)(6,7)(7,2) | (5,6)(6,5)(5,6)(6,2) | (5,6)(6,7)(7,2) | (9,9)x4  -> 14 in all
    # distinct: (5,6) (6,7) (7,2) (6,5) (6,2) (9,9) -> 6
    assert distinct_n(response_tokens(ids, mask), 2) == pytest.approx(6 / 14)
    assert distinct_n([(1, 2, 3), (4, 5)], 2) == 1.0  # no bigram spans two responses: (3,4) is not one
    assert distinct_n([(1,), ()], 2) == 0.0


def test_capped_share():
    assert capped_share(torch.tensor([True, True, True, False])) == 0.25


def test_duplicates_over_the_batch_and_within_a_prompt():
    ids, mask, _ = batch()
    responses = response_tokens(ids, mask)
    assert duplicate_share(responses) == 0.5  # rows 0 and 2 are the same response
    # prompts: rows 0 and 1 answer prompt "a", rows 2 and 3 prompt "b": no duplicate within a prompt
    assert duplicate_share(responses, ["a", "a", "b", "b"]) == 0.0
    # rows 0 and 2 answer the same prompt; rows 1 and 3 have a prompt each, so they are not counted
    assert duplicate_share(responses, ["a", "c", "a", "d"]) == 1.0
    assert duplicate_share(responses, ["a", "b", "c", "d"]) is None  # no prompt repeats


def test_diversity_metrics_names_and_values():
    ids, mask, ended = batch()
    metrics = diversity_metrics(ids, mask, ended, [10, 11, 10, 12])
    assert metrics == {"response/capped_share": 0.25, "response/distinct_2": pytest.approx(6 / 14),
                       "response/duplicate_share_batch": 0.5, "response/duplicate_share": 1.0}
    assert "response/duplicate_share" not in diversity_metrics(ids, mask, ended, [1, 2, 3, 4])


def test_with_k_samples_per_prompt_the_batch_share_reads_one_sample_per_prompt():
    ids, mask, ended = batch()
    # rows (0, 1) answer prompt 7, rows (2, 3) prompt 8: the first samples (rows 0 and 2) are identical
    metrics = diversity_metrics(ids, mask, ended, [7, 7, 8, 8], group_size=2)
    assert metrics["response/duplicate_share_batch"] == 1.0
    assert metrics["response/duplicate_share_group"] == 0.0  # no prompt's two samples repeat each other
    assert "response/duplicate_share" not in metrics  # each prompt once among the first samples
    same = torch.tensor([[5, 6, 7, 2, 0]] * 4)
    metrics = diversity_metrics(same, mask & torch.tensor([True] * 4 + [False]), ended, [7, 7, 8, 8], group_size=2)
    assert metrics["response/duplicate_share_group"] == 1.0
