"""A learned reward model as a reward source: text in, one scalar per response out.

The reward model keeps its own tokenizer, which may differ from the policy's: the
policy's tokens are decoded to text upstream and re-tokenised here exactly as the
reward-model data were (prompt like `encode_prompts`, response with
`add_special_tokens=False`, then EOS when the RM was trained with it). An encoder
reward model (BERT-like, no EOS) gets the same ids framed by its tokenizer's own
special tokens instead: `encoder_rows`, which `rlhflab rm` trains on too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Callable, ContextManager

import torch
from torch import nn

from rlhflab.data import encode_prompts
from rlhflab.data.tokenize import truncate_sft
from rlhflab.errors import UserInputError
from rlhflab.data.prompt_rows import PromptRow
from rlhflab.models import build_random_reward_model, can_pack_pairs, grouped_scores, is_encoder_reward_model
from rlhflab.models import pack_groups, sequence_scores, special_tokens_frame
from rlhflab.rewards.base import ScoreContext, Scored, check_lengths, scored

logger = logging.getLogger(__name__)


def encoder_rows(tokenizer, prompts: list[str], responses: list[str], max_length: int) -> list[list[int]]:
    """[CLS] prompt response [SEP] for an encoder reward model (`models.special_tokens_frame`), in at most
    `max_length` tokens: the prompt loses tokens from the left first, then the response from the right
    (`data.truncate_sft`); the frame always stays. `rlhflab rm` and `ModelReward` both encode with this,
    so an encoder is scored on exactly the ids it was trained on."""
    before, after = special_tokens_frame(tokenizer)
    budget = max_length - len(before) - len(after)
    if budget < 1:
        raise UserInputError(f"max_length={max_length} leaves no room for text inside the tokenizer's "
                             f"{len(before) + len(after)} special tokens", "max_length", "raise max_length")
    prompt_ids = encode_prompts(tokenizer, prompts)
    response_ids = tokenizer(responses, add_special_tokens=False)["input_ids"] if responses else []
    rows, cut = [], 0
    for prompt, response in zip(prompt_ids, response_ids):
        kept_prompt, kept_response = truncate_sft(prompt, list(response), budget)
        cut += len(kept_prompt) + len(kept_response) < len(prompt) + len(response)
        rows.append([*before, *kept_prompt, *kept_response, *after])
    if cut:
        logger.warning("%d of %d prompt + response texts longer than max_length=%d were cut (prompt from the "
                       "left first, then the response from the right)", cut, len(rows), max_length)
    return rows


class ModelReward:
    """`(sequence_scores(rm, prompt + response [+ EOS]) - shift) / scale`, in batches of `batch_size`.

    Where a prompt comes more than once (GRPO's k answers, `rlhflab rm diagnose`'s samples) and the lean forward
    runs the model (Llama / Qwen2 layouts), each prompt's distinct rows are scored as one group that runs the
    prompt once (`models.pack_groups`; the same scores up to float summation order).

    Decoder reward models: `max_length` (optional) keeps the LAST tokens of a longer row, where the
    score is read. Encoder reward models (`models.is_encoder_reward_model`): rows are `encoder_rows`,
    cut to `max_length` or else the model's position limit; `append_eos` does not apply (the frame's
    closing token, BERT's [SEP], ends the text as it did in training).

    `autocast`: the context every forward runs in (the run's mixed precision, models/precision.py); the scores
    come back float32 whatever it computes in.
    """

    def __init__(self, reward_model: nn.Module, tokenizer, batch_size: int = 64, shift: float = 0.0,
                 scale: float = 1.0, append_eos: bool = True, max_length: int | None = None,
                 autocast: Callable[[], ContextManager] = nullcontext):
        if scale == 0:
            raise UserInputError("reward scale must not be 0", where="reward_scale", fix="use e.g. 1.0")
        self.encoder = is_encoder_reward_model(reward_model)
        if append_eos and not self.encoder and tokenizer.eos_token_id is None:
            raise UserInputError("append_eos=True but the reward model's tokenizer has no eos token",
                                 fix="set append_eos=False or give the tokenizer an eos_token")
        self.reward_model = reward_model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.shift, self.scale = shift, scale
        self.append_eos = append_eos
        self.max_length = max_length
        self.groups_prompts = not self.encoder and can_pack_pairs(reward_model)
        self.autocast = autocast

    def encode(self, prompts: list[str], responses: list[str]) -> list[list[int]]:
        """Token ids of each prompt + response (+ EOS), with the reward model's tokenizer."""
        if self.encoder:
            limit = self.max_length or getattr(self.reward_model.config, "max_position_embeddings", None)
            limit = limit or self.tokenizer.model_max_length
            return encoder_rows(self.tokenizer, prompts, responses, limit)
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
    def __call__(self, prompts: list[str], responses: list[str], rows: Sequence[PromptRow],
                 context: ScoreContext | None = None) -> Scored:
        check_lengths(prompts, responses, rows)
        rows = self.encode(prompts, responses)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        with self.autocast():
            if self.groups_prompts and len(set(prompts)) < len(prompts) and all(rows):
                scores = self.scores_by_prompt(prompts, rows, pad)
            else:
                scores = self.padded_scores(rows, pad)
        return scored((scores - self.shift) / self.scale, torch.ones_like(scores, dtype=torch.bool))

    def scores_by_prompt(self, prompts: list[str], rows: list[list[int]], pad: int) -> torch.Tensor:
        """(N,) raw scores, each prompt's distinct rows in one group (about `batch_size` rows a forward pass)."""
        members: dict[str, dict[tuple, int]] = {}  # prompt -> {row: its number in the prompt's group}
        for prompt, row in zip(prompts, rows):
            group = members.setdefault(prompt, {})
            group.setdefault(tuple(row), len(group))
        first, start = {}, 0  # prompt -> the number of its group's first row among all distinct rows
        for prompt, group in members.items():
            first[prompt], start = start, start + len(group)
        groups = [[list(row) for row in group] for group in members.values()]
        raw, batch = [], []
        for group in groups:  # groups in order, cut where the next one would pass batch_size rows
            if batch and sum(map(len, batch)) + len(group) > self.batch_size:
                raw.append(grouped_scores(self.reward_model, pack_groups(batch, pad)).float().cpu())
                batch = []
            batch.append(group)
        raw.append(grouped_scores(self.reward_model, pack_groups(batch, pad)).float().cpu())
        distinct = torch.cat(raw)
        return distinct[torch.tensor([first[p] + members[p][tuple(row)] for p, row in zip(prompts, rows)])]

    def padded_scores(self, rows: list[list[int]], pad: int) -> torch.Tensor:
        """(N,) raw scores, `batch_size` right-padded rows a forward pass."""
        device = next(self.reward_model.parameters()).device
        raw = []
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start:start + self.batch_size]
            length = max(map(len, chunk))  # right padding
            ids = torch.tensor([row + [pad] * (length - len(row)) for row in chunk], device=device)
            mask = torch.tensor([[1] * len(row) + [0] * (length - len(row)) for row in chunk], device=device)
            raw.append(sequence_scores(self.reward_model, ids, mask, lean=True).float().cpu())
        return torch.cat(raw) if raw else torch.zeros(0)


class ReloadedModelReward:
    """A `ModelReward` whose model `load()` reads from disk for each call and frees after it (an online run's
    `reward_model_mode=reload`): between rollouts no reward model is held, for one more read of its checkpoint
    a rollout. `settings`: ModelReward's keyword arguments (shift, scale, autocast, ...)."""

    def __init__(self, load: Callable[[], nn.Module], tokenizer, **settings):
        self.load, self.tokenizer, self.settings = load, tokenizer, settings

    def __call__(self, prompts: list[str], responses: list[str], rows: Sequence[PromptRow],
                 context: ScoreContext | None = None) -> Scored:
        return ModelReward(self.load(), self.tokenizer, **self.settings)(prompts, responses, rows, context)


def random_model_reward(tokenizer, seed: int = 0, **sizes) -> ModelReward:
    """A deliberately random tiny reward head, for the smoke test (scores mean nothing)."""
    return ModelReward(build_random_reward_model(tokenizer, seed=seed, **sizes), tokenizer)
