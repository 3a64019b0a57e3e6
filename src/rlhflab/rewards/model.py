"""A learned reward model as a reward source: text in, one scalar per response out.

The reward model keeps its own tokenizer, which may differ from the policy's: the
policy's tokens are decoded to text upstream and re-tokenised here exactly as the
reward-model data were (prompt like `encode_prompts`, response with
`add_special_tokens=False`, then EOS when the RM was trained with it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from rlhflab.data import encode_prompts
from rlhflab.errors import UserInputError
from rlhflab.data.prompt_rows import PromptRow
from rlhflab.models import build_random_reward_model, sequence_scores
from rlhflab.rewards.base import Scored, check_lengths, scored

logger = logging.getLogger(__name__)


class ModelReward:
    """`(sequence_scores(rm, prompt + response [+ EOS]) - shift) / scale`, in batches of `batch_size`.

    `max_length` (optional) keeps the LAST tokens of a longer row, where the score is read.
    """

    def __init__(self, reward_model: nn.Module, tokenizer, batch_size: int = 64, shift: float = 0.0,
                 scale: float = 1.0, append_eos: bool = True, max_length: int | None = None):
        if scale == 0:
            raise UserInputError("reward scale must not be 0", where="reward_scale", fix="use e.g. 1.0")
        if append_eos and tokenizer.eos_token_id is None:
            raise UserInputError("append_eos=True but the reward model's tokenizer has no eos token",
                                 fix="set append_eos=False or give the tokenizer an eos_token")
        self.reward_model = reward_model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.shift, self.scale = shift, scale
        self.append_eos = append_eos
        self.max_length = max_length

    def encode(self, prompts: list[str], responses: list[str]) -> list[list[int]]:
        """Token ids of each prompt + response (+ EOS), with the reward model's tokenizer."""
        prompt_ids = encode_prompts(self.tokenizer, prompts)
        response_ids = self.tokenizer(responses, add_special_tokens=False)["input_ids"] if responses else []
        eos = [self.tokenizer.eos_token_id] if self.append_eos else []
        rows = [[*p, *r, *eos] for p, r in zip(prompt_ids, response_ids)]
        if self.max_length is not None:
            cut = sum(len(row) > self.max_length for row in rows)
            if cut:
                logger.warning("%d of %d rows longer than max_length=%d were cut from the left",
                               cut, len(rows), self.max_length)
            rows = [row[-self.max_length:] for row in rows]
        return rows

    @torch.no_grad()
    def __call__(self, prompts: list[str], responses: list[str], rows: Sequence[PromptRow]) -> Scored:
        check_lengths(prompts, responses, rows)
        rows = self.encode(prompts, responses)
        device = next(self.reward_model.parameters()).device
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        raw = []
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start:start + self.batch_size]
            length = max(map(len, chunk))  # right padding
            ids = torch.tensor([row + [pad] * (length - len(row)) for row in chunk], device=device)
            mask = torch.tensor([[1] * len(row) + [0] * (length - len(row)) for row in chunk], device=device)
            raw.append(sequence_scores(self.reward_model, ids, mask, lean=True).float().cpu())
        scores = torch.cat(raw) if raw else torch.zeros(0)
        return scored((scores - self.shift) / self.scale, torch.ones_like(scores, dtype=torch.bool))


def random_model_reward(tokenizer, seed: int = 0, **sizes) -> ModelReward:
    """A deliberately random tiny reward head, for the smoke test (scores mean nothing)."""
    return ModelReward(build_random_reward_model(tokenizer, seed=seed, **sizes), tokenizer)
