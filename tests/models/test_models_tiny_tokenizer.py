"""The tiny BPE tokenizer: exact round trip, template words whole, content spelled out."""

from __future__ import annotations

import string

from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from rlhflab.models import EOS_TOKEN, PAD_TOKEN, build_tokenizer, template_words


def pieces(tokenizer, text: str) -> list[str]:
    return tokenizer.convert_ids_to_tokens(tokenizer.encode(text))


def corpus_pieces(tokenizer, corpus) -> set[str]:
    return {p for text in corpus for p in pieces(tokenizer, text)}


def is_single_char(tokenizer, piece: str) -> bool:
    return len(tokenizer.convert_tokens_to_string([piece])) == 1


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=string.printable, max_size=80))
def test_round_trip_printable_ascii(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_round_trip_whitespace_cases(tokenizer):
    for text in ["", " ", "  ", "a  b", "\n\n", " Answer\n  Answer ", "RESULT:  7\t\r\n", "the  the"]:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_tokens(tokenizer):
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == (PAD_TOKEN, 0)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == (EOS_TOKEN, 1)
    assert tokenizer.bos_token is None
    assert tokenizer.model_max_length == 256
    assert tokenizer.padding_side == "right"
    assert tokenizer.encode("Add") == tokenizer.encode("Add", add_special_tokens=True)  # nothing added


def test_template_words_are_whole_pieces(tokenizer):
    assert pieces(tokenizer, "Add 4 and 5. Answer as RESULT: 9") == [
        "Add", "Ġ", "4", "Ġand", "Ġ", "5", ".", "ĠAnswer", "Ġas", "ĠRESULT", ":", "Ġ", "9",
    ]


def test_unseen_words_are_spelled_out(tokenizer):
    # "into" shares "in", "there" shares "the" with template words: still spelled out
    assert pieces(tokenizer, "into") == ["i", "n", "t", "o"]
    assert pieces(tokenizer, " there") == ["Ġ", "t", "h", "e", "r", "e"]
    assert pieces(tokenizer, "Answers") == ["A", "n", "s", "w", "e", "r", "s"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet=string.ascii_letters, min_size=1, max_size=12), min_size=1, max_size=6))
def test_unseen_word_pieces_are_single_chars_or_corpus_pieces(tokenizer, corpus, words):
    known = corpus_pieces(tokenizer, corpus)
    vocab_words = set(template_words(corpus))
    # a template word may split differently where the corpus never has it (e.g. "items" at the
    # start of a text: "ite" + "ms"), so the joined text holds only the other words
    text = " ".join(w for w in words if w not in vocab_words)
    for piece in pieces(tokenizer, text):
        assert is_single_char(tokenizer, piece) or piece in known, (text, piece)
    for word in words:
        if word not in vocab_words:
            assert all(is_single_char(tokenizer, p) for p in pieces(tokenizer, word)), word


def test_digits_are_single_tokens(tokenizer):
    ids = tokenizer.encode("2024")
    assert tokenizer.convert_ids_to_tokens(ids) == ["2", "0", "2", "4"]
    for digit in string.digits:
        assert len(tokenizer.encode(digit)) == 1
        assert len(tokenizer.encode("x" + digit * 3)) == 4


def test_vocab_size_is_an_upper_bound(corpus):
    small = build_tokenizer(corpus, vocab_size=270)  # 256 bytes + 2 specials + 12 merges
    assert len(small) == 270
    assert small.decode(small.encode("Answer as RESULT: 12")) == "Answer as RESULT: 12"
    assert len(build_tokenizer(corpus, vocab_size=384)) <= 384


def test_deterministic(corpus, tokenizer):
    assert build_tokenizer(corpus).get_vocab() == tokenizer.get_vocab()


def test_save_and_reload_unchanged(tmp_path, tokenizer):
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.get_vocab() == tokenizer.get_vocab()
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.bos_token_id) == (0, 1, None)
    assert loaded.model_max_length == 256
    for text in ["Add 10 and 1. Answer as RESULT: 11", "into  there\n", "zebra ~!@#$%^&*()"]:
        assert loaded.encode(text) == tokenizer.encode(text)
