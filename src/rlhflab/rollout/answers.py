"""Prompts in, decoded answers out: generation for evaluation and checking."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from rlhflab.data import encode_prompts
from rlhflab.rollout.backends import generate_with
from rlhflab.rollout.generate import GenerationSettings


@dataclass(frozen=True)
class Answer:
    text: str  # the response decoded up to (not including) the first EOS
    ended_with_eos: bool  # False when the response ran to max_new_tokens
    num_tokens: int  # response tokens, EOS included
    token_ids: tuple[int, ...] = ()  # the response's tokens, EOS included (TRL's completion_ids)


def decode_responses(tokenizer, response_ids: torch.Tensor, response_mask: torch.Tensor, eos_id: int) -> list[str]:
    """(B, T) ids -> text of each response, without the EOS and what follows."""
    texts = []
    for ids, mask in zip(response_ids.tolist(), response_mask.tolist()):
        kept = [tok for tok, real in zip(ids, mask) if real and tok != eos_id]
        texts.append(tokenizer.decode(kept, skip_special_tokens=True))
    return texts


def response_tokens(response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[list[int]]:
    """(B, T) ids -> each response's tokens, its EOS included, padding left out (TRL's `completion_ids`)."""
    return [[tok for tok, real in zip(ids, mask) if real]
            for ids, mask in zip(response_ids.tolist(), response_mask.tolist())]


def generate_answers(
    model: torch.nn.Module,
    tokenizer,
    prompts: list[str],
    settings: GenerationSettings,
    *,
    batch_size: int = 64,
    generator: torch.Generator | None = None,
    progress: bool = False,
) -> list[Answer]:
    """Answer every prompt in batches; the model is put in eval mode meanwhile."""
    was_training = model.training
    model.eval()
    answers: list[Answer] = []
    starts = range(0, len(prompts), batch_size)
    for start in tqdm(starts, desc="generating", unit="batch", disable=not progress):
        chunk = encode_prompts(tokenizer, prompts[start : start + batch_size])
        out = generate_with(
            model, chunk, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
            settings=settings, generator=generator,
        )
        texts = decode_responses(tokenizer, out.response_ids, out.response_mask, tokenizer.eos_token_id)
        ids = response_tokens(out.response_ids, out.response_mask)
        for text, eos, tokens in zip(texts, out.ended_with_eos.tolist(), map(tuple, ids)):
            answers.append(Answer(text=text, ended_with_eos=bool(eos), num_tokens=len(tokens), token_ids=tokens))
    model.train(was_training)
    return answers
