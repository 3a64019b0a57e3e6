"""Shared fixtures for the models tests: a small template corpus and its tokenizer."""

from __future__ import annotations

import string

import pytest

from rlhflab.models import build_tokenizer

# stand-in for the task templates with content slots removed, plus the alphabet line
CORPUS = [
    "Write the word  in capital letters. Answer as RESULT: ",
    "Add  and . Answer as RESULT: ",
    "Repeat the sentence exactly:\n",
    "Count the words in the sentence. Answer with a number.",
    "Reverse the list: . Separate items with commas.",
    " ".join(string.ascii_lowercase + string.ascii_uppercase + string.digits) + " . , : ; ! ? ' \" ( ) -",
]



@pytest.fixture(scope="session")
def corpus() -> list[str]:
    return list(CORPUS)


@pytest.fixture(scope="session")
def tokenizer(corpus):
    return build_tokenizer(corpus)
