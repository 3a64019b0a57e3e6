"""Train the byte-level BPE tokenizer of the embedded tiny default model.

The corpus is the task templates with their content slots removed, plus an
alphabet line. The merges therefore build template words ("Answer", "RESULT",
...) while everything else — content words, numbers — is spelled from
single-character pieces.

Why not a plain byte-level BPE: BPE merges are pairwise, so a template word such
as "instruction" is built through intermediate pieces ("in", "ins", ...) that
never appear when the corpus itself is encoded. A plain BPE applies those
merges inside unseen words too ("into" -> "in" "t" "o"), and such pieces are
never seen in training, so the tiny model cannot use them (FACTS.md: "a BPE
trained on a narrow corpus may not generalise to unseen words — check it").
So a `Split` pre-tokenizer keeps a whole template word (with its leading space)
as one pre-token and cuts everything else into single characters: merges can
only ever apply inside a template word.

Everything is an ordinary `tokenizers` pipeline stored in `tokenizer.json`;
`AutoTokenizer.from_pretrained` loads it back unchanged.
"""

from __future__ import annotations

import re

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
MODEL_MAX_LENGTH = 256

_WORD = re.compile(r"[A-Za-z]+")


def template_words(corpus: list[str]) -> list[str]:
    """The distinct letter-only words of the corpus, longest first."""
    words = {w for text in corpus for w in _WORD.findall(text)}
    return sorted(words, key=lambda w: (-len(w), w))


def _split_pattern(words: list[str]) -> str:
    """Regex whose matches are pre-tokens: a whole template word, or one character.

    A word counts only when it stands alone: not preceded or followed by a letter
    ("the" inside "there" is spelled out). An optional single leading space is
    kept with the word, like GPT-2's " word" pieces.
    """
    alternation = "|".join(re.escape(w) for w in words)
    word = rf" ?(?<![A-Za-z])(?:{alternation})(?![A-Za-z])" if words else None
    single = r"[\s\S]"  # any one character, newlines included
    return f"{word}|{single}" if word else single


def build_tokenizer(corpus: list[str], vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `corpus` (template text + an alphabet line).

    Pieces: the 256 byte symbols, `<|pad|>` (id 0), `<|endoftext|>` (id 1), and
    merges that build template words. The vocabulary may stop short of
    `vocab_size` once every template word is a single piece. No BOS token;
    padding side is the default (right) — generation code left-pads itself.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_split_pattern(template_words(corpus))), behavior="isolated"),
            # a no-op after the split above; kept so digits stay single tokens
            # even if the word pattern ever changes
            pre_tokenizers.Digits(individual_digits=True),
            # use_regex=False: the split above already cut the text into pre-tokens
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=[PAD_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
