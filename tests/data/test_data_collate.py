"""tokenize_sft, collate_sft, left_pad, position_ids_from_mask: exact ids on hand-made cases."""

from __future__ import annotations

import logging

import pytest
import torch

from rlhflab.data import (SFTExample, TokenizedSFT, collate_sft, encode_prompts, left_pad,
                          position_ids_from_mask, tokenize_sft)
from rlhflab.data.tokenize import truncate_sft
from rlhflab.errors import UserInputError

# ids in the conftest vocabulary (checked in test_ids_match_the_test_vocabulary)
EOS, BOS = 1, 2  # EOS is also the pad id of the pad == eos tokenizer
HELLO, WORLD, SAY, HI, BYE, GOOD, BAD, ANSWER = 8, 9, 10, 11, 12, 13, 14, 15

EXAMPLES = [SFTExample("say hi", "hi"), SFTExample("say hello world", "bye"),
            SFTExample("hi", "good bad answer")]


def test_ids_match_the_test_vocabulary(tok):
    words = ["</s>", "<s>", "hello", "world", "say", "hi", "bye", "good", "bad", "answer"]
    assert tok.convert_tokens_to_ids(words) == [EOS, BOS, HELLO, WORLD, SAY, HI, BYE, GOOD, BAD,
                                                ANSWER]


def test_tokenize_sft_appends_eos_even_when_pad_is_eos(tok_pad_eos):
    assert tok_pad_eos.pad_token_id == tok_pad_eos.eos_token_id == EOS
    assert tokenize_sft(EXAMPLES, tok_pad_eos, max_length=16) == [
        TokenizedSFT([SAY, HI], [HI, EOS]),
        TokenizedSFT([SAY, HELLO, WORLD], [BYE, EOS]),
        TokenizedSFT([HI], [GOOD, BAD, ANSWER, EOS]),
    ]


def test_repeated_texts_are_encoded_once_into_lists_of_their_own(tok, make_tok, monkeypatch):
    """encode_distinct: a text met again (a pair's prompt in both sequences) is looked up, not re-encoded;
    every example still gets its own lists (truncating or extending one leaves the others alone)."""
    seen = []
    encode = type(tok).__call__
    monkeypatch.setattr(type(tok), "__call__",
                        lambda self, texts, **kw: seen.append(list(texts)) or encode(self, texts, **kw))
    examples = [SFTExample("say hi", "hi"), SFTExample("say hi", "bye"), SFTExample("say hi", "hi")]
    out = tokenize_sft(examples, tok, max_length=16)
    assert out == [TokenizedSFT([SAY, HI], [HI, EOS]), TokenizedSFT([SAY, HI], [BYE, EOS]),
                   TokenizedSFT([SAY, HI], [HI, EOS])]
    assert seen == [["say hi"], ["hi", "bye"]]  # the prompts, then the distinct completions
    out[0].prompt_ids.append(GOOD)
    out[0].completion_ids.append(BAD)
    assert out[2] == TokenizedSFT([SAY, HI], [HI, EOS])
    assert encode_prompts(make_tok(add_bos=True), ["say hi", "say hi"]) == [[BOS, SAY, HI], [BOS, SAY, HI]]


def test_collate_masks_prompt_and_padding_and_keeps_eos_when_pad_is_eos(tok_pad_eos):
    batch = collate_sft(tokenize_sft(EXAMPLES, tok_pad_eos, max_length=16), pad_id=EOS)
    assert batch.input_ids.dtype == batch.attention_mask.dtype == batch.labels.dtype == torch.long
    assert batch.input_ids.tolist() == [
        [SAY, HI, HI, EOS, EOS],  # the last EOS is padding
        [SAY, HELLO, WORLD, BYE, EOS],
        [HI, GOOD, BAD, ANSWER, EOS],
    ]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert batch.labels.tolist() == [
        [-100, -100, HI, EOS, -100],  # the real EOS is a label, the pad EOS is not
        [-100, -100, -100, BYE, EOS],
        [-100, GOOD, BAD, ANSWER, EOS],
    ]
    assert batch.num_label_tokens == 8 == int((batch.labels != -100).sum())


def test_bos_only_when_the_tokenizer_always_adds_it(make_tok):
    assert encode_prompts(make_tok(), ["say hi"]) == [[SAY, HI]]
    bos_tok = make_tok(add_bos=True)
    # a rendering that already starts with the BOS text does not get a second one
    assert encode_prompts(bos_tok, ["say hi", "<s> say hi"]) == [[BOS, SAY, HI], [BOS, SAY, HI]]
    assert tokenize_sft([EXAMPLES[0]], bos_tok, 16) == [TokenizedSFT([BOS, SAY, HI], [HI, EOS])]


def test_truncation_prompt_left_first_then_completion_right(tok, make_tok, caplog):
    with caplog.at_level(logging.WARNING, logger="rlhflab.data"):
        items = tokenize_sft(EXAMPLES, tok, max_length=4)
    assert items == [
        TokenizedSFT([SAY, HI], [HI, EOS]),  # fits exactly
        TokenizedSFT([HELLO, WORLD], [BYE, EOS]),  # prompt lost "say" on the left
        TokenizedSFT([], [GOOD, BAD, ANSWER, EOS]),  # completion alone fills the budget
    ]
    assert "2 of 3 examples exceed max_length=4: 2 prompts truncated from the left, " \
           "0 completions truncated from the right" in caplog.text
    assert tokenize_sft(EXAMPLES[2:], tok, max_length=3) == [TokenizedSFT([], [GOOD, BAD, ANSWER])]
    # the BOS survives left truncation
    bos_tok = make_tok(add_bos=True)
    assert tokenize_sft(EXAMPLES[1:2], bos_tok, max_length=4) == [
        TokenizedSFT([BOS, WORLD], [BYE, EOS])]
    assert truncate_sft([7, 8, 9], [5, 1], 3, keep_first=True) == ([7], [5, 1])
    assert truncate_sft([7, 8, 9], [5, 1], 3) == ([9], [5, 1])
    with pytest.raises(UserInputError, match="max_length must be at least 1"):
        tokenize_sft(EXAMPLES, tok, max_length=0)


def test_tokenizer_without_eos_is_a_user_error(make_tok):
    no_eos = make_tok()
    no_eos.eos_token = None
    with pytest.raises(UserInputError, match="the tokenizer has no eos_token"):
        tokenize_sft(EXAMPLES, no_eos, max_length=8)


def test_left_pad_and_position_ids():
    input_ids, attention_mask = left_pad([[5, 6, 7], [8], []], pad_id=0)
    assert input_ids.dtype == attention_mask.dtype == torch.long
    assert input_ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert attention_mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert position_ids_from_mask(attention_mask).tolist() == [[0, 1, 2], [0, 0, 0], [0, 0, 0]]
    # prompt + generated tokens: positions continue across the prompt's left padding
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 4]]
    with pytest.raises(ValueError):
        left_pad([], pad_id=0)
