"""Fixtures for the rlhflab.data tests: tiny word-level tokenizers and a JSONL writer.

(Kept in conftest because pytest runs with --import-mode=importlib: test files here
cannot import a sibling helper module.)
"""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

WORDS = ["<pad>", "</s>", "<s>", "<unk>", "<end>", "<user>", "<assistant>", "<system>",
         "hello", "world", "say", "hi", "bye", "good", "bad", "answer", "be", "brief"]
VOCAB = {w: i for i, w in enumerate(WORDS)}  # <pad>=0 </s>=1 <s>=2 <unk>=3 ... hello=8 ...

# One turn per message, closed by <end>; the generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <end> {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


def make_tokenizer(pad: str = "<pad>", chat_template: str | None = None,
                   add_bos: bool = False) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", pad_token=pad,
                                  unk_token="<unk>", bos_token="<s>", add_bos_token=add_bos)
    tok.chat_template = chat_template
    return tok


@pytest.fixture
def make_tok():
    """The tokenizer factory: make_tok(pad="<pad>", chat_template=None, add_bos=False)."""
    return make_tokenizer


@pytest.fixture
def tok():
    return make_tokenizer()


@pytest.fixture
def tok_pad_eos():
    return make_tokenizer(pad="</s>")


@pytest.fixture
def tok_chat():
    return make_tokenizer(chat_template=CHAT_TEMPLATE)


@pytest.fixture
def write_jsonl(tmp_path):
    """write_jsonl(lines) -> path; dicts are dumped as JSON, strings written verbatim."""
    def write(lines, name="data.jsonl"):
        path = tmp_path / name
        text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines)
        path.write_text(text + "\n", encoding="utf-8")
        return path
    return write
