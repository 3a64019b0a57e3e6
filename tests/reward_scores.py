"""The naive reference the packed / grouped reward-model scorers are held to: each sequence scored on its own."""

import torch

from rlhflab.models import sequence_scores


def separate_scores(model, seqs: list[list[int]], pad: int) -> torch.Tensor:
    """(N,) scores of `seqs`, right-padded with `pad` into one batch, each read at its own last token."""
    length = max(map(len, seqs))
    ids = torch.tensor([s + [pad] * (length - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (length - len(s)) for s in seqs])
    return sequence_scores(model, ids, mask)
